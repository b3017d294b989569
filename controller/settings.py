"""The controller's settings, derived from the config dataclasses of each concern.

Each tunable lives in the dataclass of its concern (``CONCERNS``): the server's below, the core's
in their core modules. There, once, are its default, its constraints
(``specpilot.controller.core.tunable``) and its documentation with the unit (the docstring under the
field). ``Settings`` is generated from them with flat names: the field's name with the concern's
prefix (``cost_prior_`` for ``CostPrior``, none for the others), e.g. ``half_life_seconds`` or
``cost_prior_base_seconds``.

Sources, later ones win: defaults < YAML file (``--config`` or ``SPECPILOT_CONFIG``) <
environment (``SPECPILOT_<NAME>``, e.g. ``SPECPILOT_HALF_LIFE_SECONDS=120``) < command-line flags.
Lists in the environment are JSON (``SPECPILOT_OFFLINE_CLASSES='["batch"]'``).
Bad settings stop start-up with one line per problem, every problem at once: the setting, what
is wrong, where it was given (file and line, variable or flag) and, for a name that is not a
setting, the closest ones (see ``load_settings``). ``unknown_environment`` names SPECPILOT_*
variables that nothing reads (a misspelt one would otherwise be ignored silently).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from functools import partial
from pathlib import Path
from types import GenericAlias
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Literal,
    TypeVar,
    get_args,
    get_origin,
    get_type_hints,
)

import yaml
from pydantic import AfterValidator, SecretStr, ValidationError, create_model, model_validator
from pydantic import Field as PydanticField
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from specpilot.contract.fielddocs import field_docs, markdown_table
from specpilot.controller.core.acceptance import EstimatorConfig
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.cost_model import CostPrior
from specpilot.controller.core.policy import PolicyConfig
from specpilot.controller.core.tunable import CONSTRAINTS, Constraints, tunable

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

ENV_PREFIX = "SPECPILOT_"
# Settings never echoed in a message nor accepted on a command line.
SECRET_SETTINGS = ("policy_token", "engine_secret", "engine_token")
# The engine plugin's variables (specpilot.engine_plugin.config): the plugin checks those itself.
PLUGIN_ENV_PREFIX = "SPECPILOT_PLUGIN_"


class SettingsError(ValueError):
    """Settings that cannot be used: ``lines``, one per problem (every problem found at once),
    each naming the setting; the message is the lines joined by newlines."""

    def __init__(self, *lines: str) -> None:
        super().__init__("\n".join(lines))
        self.lines: tuple[str, ...] = lines


@dataclass(frozen=True)
class ServerConfig:
    """Server: where the sidecar listens, what it accepts, and what it tells engines."""

    grpc_host: str = "127.0.0.1"
    """Address the gRPC services bind to."""
    grpc_port: int = tunable(50051, ge=0, le=65535)
    """gRPC port; 0 picks a free one."""
    http_host: str = "127.0.0.1"
    """Address of /metrics, /healthz and /api."""
    http_port: int = tunable(9464, ge=0, le=65535)
    """HTTP port; 0 picks a free one."""
    policy_token: SecretStr | None = None
    """Bearer token that PolicyService writes must carry. Unset: a random token is generated at
    start-up and printed once."""
    policy_token_file: str = ""
    """File holding the policy token, e.g. a mounted Secret (used when policy_token is unset);
    if it does not exist, the generated token is written there (mode 0600), so a restarted
    controller keeps it."""
    engine_secret: SecretStr | None = None
    """Secret from which each engine's own token is derived (``specpilot engine-token --id
    ID``: HMAC-SHA256 of the engine id, hex), at least 32 characters. Set: an engine stream
    must present the token of the engine_id its hello names (gRPC metadata ``authorization:
    Bearer <token>``; the plugin's SPECPILOT_PLUGIN_TOKEN or _TOKEN_FILE), so a holder of one
    engine's token cannot open or take over another's. Give engines their tokens, never the
    secret. Unset, with no engine_token nor client certificates: engine streams need no
    credential, which the server allows only when grpc_host is a loopback address (the
    sidecar's own pod) or allow_unauthenticated_engines is set."""
    engine_token: SecretStr | None = None
    """One bearer token shared by every engine, instead of engine_secret (not both): it lets a
    stream in but identifies no engine, so with it, as with no credential, a stream cannot
    replace a connected engine's stream."""
    allow_unauthenticated_engines: bool = False
    """Accept engine streams without a credential although grpc_host is not loopback: only on
    a network where every client is trusted (anyone who reaches the port could register an
    engine and steer policy)."""
    tls_cert_file: str = ""
    """PEM certificate (chain) of both listeners: with tls_key_file set, gRPC serves TLS and
    HTTP serves HTTPS; both or neither. Read at start-up (a rotated certificate takes a
    restart)."""
    tls_key_file: str = ""
    """PEM private key (unencrypted) of tls_cert_file; it must match the certificate."""
    tls_client_ca_file: str = ""
    """PEM CA bundle that engine client certificates must be signed by (mTLS; needs
    tls_cert_file): an engine stream without a verified client certificate is refused
    (UNAUTHENTICATED), and engine streams then need no token to listen beyond loopback.
    Which gRPC clients must present one: tls_client_auth. HTTP never asks for one."""
    tls_client_auth: Literal["all", "engines"] = "all"
    """With tls_client_ca_file: "all": every client of the gRPC port (policy API, health,
    reflection, engines) must present a client certificate signed by it, or the handshake
    fails; "engines": only engine streams, on engine_grpc_port (which requires one at the
    handshake), while grpc_port asks no client certificate and refuses engine streams
    (UNAUTHENTICATED)."""
    engine_grpc_port: int | None = tunable(None, ge=0, le=65535)
    """Port of the engines' mTLS listener on grpc_host (tls_client_auth "engines" only, and
    needed there); 0 picks a free one; unset: no second listener."""
    tls_bind_engine_id: bool = False
    """With tls_client_ca_file: an engine's hello must name an engine_id equal to its client
    certificate's common name or one of its subject alternative names, else PERMISSION_DENIED,
    so one engine's certificate cannot open or take over another engine's id (without it a
    certificate identifies no engine, and cannot replace a connected engine's stream)."""
    max_report_bytes: int = tunable(1 << 20, ge=1024, le=4 << 20)
    """Largest accepted engine report, bytes; larger ones are rejected with a reason and the
    stream stays up. At most 4 MiB: applying a report takes about 20 times its size in memory
    while it is ingested (benchmarks/sidecar_memory.py)."""
    report_interval_seconds: float = tunable(1.0, gt=0)
    """How often engines report, seconds (sent in the hello ack)."""
    decide_min_interval_seconds: float = tunable(0.01, ge=0)
    """Shortest time between two report-prompted decide rounds, seconds (a round that took
    longer spaces the next by its own duration): reports that arrive closer together share one
    round; a lone report is decided at once."""
    report_budget_share: float = tunable(0.5, gt=0, le=1)
    """Share of the controller's event loop that engine reports (their ingest and the decide
    rounds they prompt) may take per second, ratio; reports beyond it are shed unapplied
    (RESOURCE_EXHAUSTED; the plugin sends them again later and slows its reports), so health
    checks and the policy API always find the loop free. 1 never sheds below saturation."""
    max_watch_streams: int = tunable(32, ge=1, le=1024)
    """WatchDecisions streams served at once; one more is refused (RESOURCE_EXHAUSTED) until
    one ends. Each costs the loop its replay of the decision log and every event after it:
    150 that never read kept a core busy for seconds after a burst of 10 policy writes
    (benchmarks/sidecar_memory.py). The dashboard's event stream is not one of them."""
    fail_static_timeout_seconds: float = tunable(30.0, gt=0)
    """Engines fall back to their static config after this long without hearing from the
    controller, seconds."""
    engine_silence_timeout_seconds: float = tunable(60.0, gt=0)
    """An engine stream with no report for this long is ended (UNAVAILABLE) and the engine
    forgotten, seconds: a live plugin sends at least a heartbeat every two report intervals
    (and a third of its fail-static timeout), so only a hung or vanished engine goes silent; a
    live one reconnects."""
    seed: int | None = None
    """Seed of the Thompson-sampling RNG; unset: random."""


@dataclass(frozen=True)
class FleetConfig:
    """Fleet: the shared state store that sidecars of one model learn through."""

    state_store: str = "memory"
    """Where state is shared: "memory" (this process only, no fleet) or a Redis URL,
    redis://host:port/db (rediss:// for TLS) or redis+cluster://host:port for a Cluster."""
    sidecar_id: str = ""
    """This sidecar's name in the store (its own evidence is published and restored under it);
    unset: the host name (the pod's name on Kubernetes)."""
    fleet_model: str = ""
    """Model whose fleet this sidecar joins; unset: the model of the first engine's hello."""
    fleet_flush_interval_seconds: float = tunable(5.0, gt=0)
    """How often evidence is published and the fleet's loaded, seconds: the most evidence a
    SIGKILL loses."""
    fleet_max_age_seconds: float = tunable(600.0, gt=0)
    """A sidecar's export older than this is left out (and expires in the store), seconds:
    departed sidecars age out."""
    fleet_recommend_min_tries: float = tunable(200.0, ge=0)
    """Position-1 tries (after forgetting) a draft's estimate for a class needs before the
    fleet's recommendations count that draft for it, tries."""
    fleet_decision_log_size: int = tunable(10_000, ge=1)
    """Decisions the fleet's log in the store keeps (a capped stream shared by every sidecar
    of the model; about this many, newest kept), entries."""


@dataclass(frozen=True)
class Concern:
    """One config dataclass whose fields are settings: ``prefix`` + field name."""

    config: type[DataclassInstance]
    prefix: str = ""


# The concerns, in the order of the reference. A field with a default is a setting; one without
# is wiring: a nested concern is built from its own settings, any other field takes the setting
# of its name that another concern owns (the estimator's max_k is the policy's).
CONCERNS: tuple[Concern, ...] = (
    Concern(ServerConfig),
    Concern(FleetConfig),
    Concern(CoreConfig),
    Concern(EstimatorConfig),
    Concern(CostPrior, prefix="cost_prior_"),
    Concern(PolicyConfig),
)
_PREFIX: dict[type[Any], str] = {c.config: c.prefix for c in CONCERNS}


@dataclass(frozen=True)
class _Setting:
    name: str
    concern: type[Any]
    default: Any
    hint: Any  # the field's type in its dataclass
    doc: str
    constraints: Constraints


# Each concern's field types, resolved once (the modules use postponed annotations).
_HINTS: dict[type[Any], dict[str, Any]] = {c.config: get_type_hints(c.config) for c in CONCERNS}


def _collect() -> dict[str, _Setting]:
    """Every setting by name, from CONCERNS; TypeError on a clash or a dangling reference."""
    found: dict[str, _Setting] = {}
    wiring: list[str] = []
    for concern in CONCERNS:
        docs = field_docs(concern.config)
        for f in fields(concern.config):
            name = concern.prefix + f.name
            hint = _HINTS[concern.config][f.name]
            if f.default is MISSING:
                if hint not in _PREFIX:
                    wiring.append(name)
                continue
            if name in found:
                raise TypeError(f"setting {name} is defined by {found[name].concern.__name__} "
                                f"and {concern.config.__name__}")
            found[name] = _Setting(name, concern.config, f.default, hint, docs[f.name],
                                   f.metadata.get(CONSTRAINTS, Constraints()))
    named = wiring + [other for s in found.values()
                      for other in (s.constraints.at_most, s.constraints.one_of) if other]
    if unknown := [n for n in named if n not in found]:
        raise TypeError(f"no setting named {', '.join(unknown)}")
    return found


SETTINGS: dict[str, _Setting] = _collect()


def _as_setting(value: Any) -> Any:
    """A core value as the settings hold it: tuples and sets as (sorted) lists."""
    if isinstance(value, frozenset):
        return sorted(value)
    return list(value) if isinstance(value, tuple) else value


def _as_core(value: Any, hint: Any) -> Any:
    """A setting's value as its dataclass field holds it (the inverse of ``_as_setting``)."""
    origin = get_origin(hint)
    return origin(value) if origin in (tuple, frozenset) else value


def _increasing(values: list[int]) -> list[int]:
    if not values or any(v <= 0 for v in values) or values != sorted(set(values)):
        raise ValueError("must be positive and strictly increasing")
    return values


def _pydantic_field(s: _Setting) -> tuple[Any, Any]:
    """(type, FieldInfo) of one setting: lists where the core holds tuples or sets."""
    c = s.constraints
    kind = s.hint
    if get_origin(kind) in (tuple, frozenset):
        kind = GenericAlias(list, get_args(kind)[0])
    if c.increasing:
        kind = Annotated[kind, AfterValidator(_increasing)]
    default = _as_setting(s.default)
    if isinstance(default, list):
        return kind, PydanticField(default_factory=partial(list, default), description=s.doc,
                                   ge=c.ge, gt=c.gt, le=c.le)
    return kind, PydanticField(default, description=s.doc, ge=c.ge, gt=c.gt, le=c.le)


class _SettingsModel(BaseSettings):
    """The base of ``Settings``: strictness and the checks between settings. Its only source is
    its arguments: ``load_settings`` reads the file and the environment itself, so that it can
    say where each bad value came from and report every one at once."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    if TYPE_CHECKING:
        # The fields are generated from CONCERNS, so the type checker cannot see them.
        def __getattr__(self, name: str) -> Any: ...

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)

    @model_validator(mode="after")
    def _check_relations(self) -> _SettingsModel:
        # One line per broken relation, each starting with its setting (load_settings splits).
        broken: list[str] = []
        for s in SETTINGS.values():
            value = getattr(self, s.name)
            if (other := s.constraints.at_most) and value > getattr(self, other):
                broken.append(f"{s.name}: must not exceed {other} ({getattr(self, other)}), "
                              f"got {value!r}")
            if (other := s.constraints.one_of) and value not in getattr(self, other):
                broken.append(f"{s.name}: must be one of {other} {getattr(self, other)}, "
                              f"got {value!r}")
        if broken:
            raise ValueError("\n".join(broken))
        return self


if TYPE_CHECKING:
    Settings = _SettingsModel
else:
    Settings = create_model(
        "Settings", __base__=_SettingsModel, __module__=__name__,
        __doc__="Controller configuration: one field per setting of CONCERNS, flat names.",
        **{s.name: _pydantic_field(s) for s in SETTINGS.values()})


def env_name(setting: str) -> str:
    """The environment variable of a setting: SPECPILOT_<NAME>."""
    return ENV_PREFIX + setting.upper()


def close_settings(key: str, names: Iterable[str] | None = None) -> list[str]:
    """The name a mistyped ``key`` probably meant (``names``: the settings by default), as a
    list of one or none; a key that is a setting's name in another spelling (``max-k``, ``MAX_K``,
    ``SPECPILOT_MAX_K``) gives that setting alone."""
    known = list(SETTINGS if names is None else names)
    folded = key.strip().lower().replace("-", "_")
    for candidate in (folded, folded.removeprefix(ENV_PREFIX.lower())):
        if exact := [n for n in known if n.lower() == candidate]:
            return exact
    near = difflib.get_close_matches(folded, [n.lower() for n in known], n=1, cutoff=0.6)
    return [n for n in known if n.lower() in near]


def _did_you_mean(names: Sequence[str]) -> str:
    if not names:
        return ""
    return f"; did you mean {' or '.join(names)}?"


@dataclass(frozen=True)
class _Origin:
    """Where a value was given: the settings file (``line``), the environment or a flag."""

    label: str  # "FILE:LINE", "SPECPILOT_<NAME>", a flag such as "--grpc-port", or ""
    rank: int  # the file 0, the environment 1, arguments 2: the order problems are listed in
    line: int = 0
    in_file: bool = False

    def say(self, key: str, what: str) -> str:
        if self.in_file:
            return f"{self.label}: bad setting {key}: {what}"
        return f"bad setting {key}: {what}" + (f" (from {self.label})" if self.label else "")


@dataclass(frozen=True)
class _Problem:
    origin: _Origin
    key: str
    what: str

    def __str__(self) -> str:
        return self.origin.say(self.key, self.what)


def _not_a_setting(key: str, origin: _Origin) -> _Problem:
    near = close_settings(key)
    hint = _did_you_mean(near) or " (specpilot settings --markdown lists every setting)"
    return _Problem(origin, key, "not a setting" + hint)


def _file_values(config_file: str | Path) -> tuple[dict[str, tuple[Any, _Origin]],
                                                  list[_Problem]]:
    """The settings file's values by key with the line of each key, and its keys' problems
    (not a setting, set twice). SettingsError for a file that cannot be read or is not a
    mapping."""
    try:
        text = Path(config_file).read_text()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        loaded = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(f"config file {config_file}: {exc}") from exc
    if loaded is None:
        return {}, []
    if not isinstance(loaded, dict) or not isinstance(node, yaml.MappingNode):
        raise SettingsError(f"config file {config_file}: expected a mapping of settings "
                            "(NAME: VALUE, one a line)")
    lines: dict[str, list[int]] = {}
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode):
            lines.setdefault(key_node.value, []).append(key_node.start_mark.line + 1)
    values: dict[str, tuple[Any, _Origin]] = {}
    problems: list[_Problem] = []
    for key, value in loaded.items():
        at = lines.get(str(key), [0])
        origin = _Origin(f"{config_file}:{at[-1]}" if at[-1] else str(config_file), 0,
                         at[-1], in_file=True)
        if not isinstance(key, str) or key not in SETTINGS:
            problems.append(_not_a_setting(str(key), origin))
            continue
        if len(at) > 1:
            problems.append(_Problem(origin, key, f"set twice (also on line "
                                                  f"{', '.join(map(str, at[:-1]))}): keep one"))
        values[key] = (value, origin)
    return values, problems


def _is_list(s: _Setting) -> bool:
    return get_origin(s.hint) in (tuple, frozenset, list, set)


def _environment_values(environ: Mapping[str, str]
                        ) -> tuple[dict[str, tuple[Any, _Origin]], list[_Problem]]:
    """Each setting's SPECPILOT_<NAME> variable (any case, as pydantic-settings reads them); a
    list setting's value is JSON there."""
    given = {k.upper(): v for k, v in environ.items() if k.upper().startswith(ENV_PREFIX)}
    values: dict[str, tuple[Any, _Origin]] = {}
    problems: list[_Problem] = []
    for s in SETTINGS.values():
        var = env_name(s.name)
        if var not in given:
            continue
        origin = _Origin(var, 1)
        raw: Any = given[var]
        if _is_list(s):
            try:
                raw = json.loads(raw)
            except ValueError:
                example = json.dumps(_as_setting(s.default) or ["name"])
                problems.append(_Problem(origin, s.name, f"not JSON, got {raw!r}: a list in the "
                                                         f"environment is JSON, e.g. "
                                                         f"{var}='{example}'"))
                continue
        values[s.name] = (raw, origin)
    return values, problems


def _what_is_wrong(name: str, err: Mapping[str, Any]) -> str:
    """Pydantic's complaint about one value, with the value (never a secret's)."""
    what = str(err["msg"]).removeprefix("Value error, ").removeprefix("Input ")
    # Inside a list: its item, counted from 1.
    item = [str(p + 1) if isinstance(p, int) else str(p) for p in err["loc"][1:]]
    if item:
        what = f"item {'.'.join(item)}: {what}"
    if err.get("type") != "missing" and name not in SECRET_SETTINGS:
        what += f", got {err['input']!r}"
    return what


def unknown_environment(environ: Mapping[str, str], also_known: Iterable[str] = ()
                        ) -> list[str]:
    """A warning for each SPECPILOT_* variable in ``environ`` that is neither a setting's nor
    one of ``also_known`` (the tools' own, such as SPECPILOT_TARGET) nor the engine plugin's
    (SPECPILOT_PLUGIN_*, which the plugin checks itself), with the closest names. Warnings,
    not errors: another program may share the prefix."""
    known = {env_name(n) for n in SETTINGS} | {v.upper() for v in also_known}
    warnings = []
    for var in sorted(environ):
        name = var.upper()
        if not name.startswith(ENV_PREFIX) or name.startswith(PLUGIN_ENV_PREFIX) \
                or name in known:
            continue
        # Matched without the prefix, which every candidate shares.
        near = [ENV_PREFIX + n for n in close_settings(
            name.removeprefix(ENV_PREFIX), sorted(k.removeprefix(ENV_PREFIX) for k in known))]
        hint = _did_you_mean(near) or " (specpilot settings --markdown lists the variables)"
        warnings.append(f"{var} is not a specpilot setting or variable, so it is ignored{hint}")
    return warnings


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from file < environment < ``overrides`` (None values are ignored).

    Raises SettingsError with one line per problem, every problem at once, each naming the
    setting (``settings_from`` says where each bad value came from).
    """
    return settings_from(config_file, overrides)


def settings_from(config_file: str | Path | None, overrides: Mapping[str, Any],
                  origins: Mapping[str, str] | None = None,
                  environ: Mapping[str, str] | None = None) -> Settings:
    """``load_settings`` for the command line: ``origins`` names the flag each override came
    from (``--grpc-port``), ``environ`` is ``os.environ`` by default.

    Raises SettingsError with one line per problem: every key that is not a setting (with the
    closest names), every bad value (what is wrong and the value given) and every broken
    relation between settings (checked once every value is good), file problems first in line
    order, each with where it was given: ``FILE:LINE: bad setting NAME: ...`` or ``bad setting
    NAME: ... (from SPECPILOT_<NAME>)``.
    """
    problems: list[_Problem] = []
    given: dict[str, tuple[Any, _Origin]] = {}
    if config_file is not None:
        file_values, file_problems = _file_values(config_file)
        given.update(file_values)
        problems += file_problems
    env_values, env_problems = _environment_values(os.environ if environ is None else environ)
    given.update(env_values)
    problems += env_problems
    for key, value in overrides.items():
        if value is None:
            continue
        origin = _Origin((origins or {}).get(key, ""), 2)
        if key not in SETTINGS:
            problems.append(_not_a_setting(key, origin))
        else:
            given[key] = (value, origin)
    try:
        settings = Settings(**{k: v for k, (v, _) in given.items()})
    except ValidationError as exc:
        by_name: dict[str, list[str]] = {}
        for err in exc.errors():
            if err["loc"]:
                name = str(err["loc"][0])
                by_name.setdefault(name, []).append(_what_is_wrong(name, err))
                continue
            # Relations between settings: a line per broken one, starting with its setting.
            for line in str(err["msg"]).removeprefix("Value error, ").splitlines():
                name, _, what = line.partition(": ")
                by_name.setdefault(name, []).append(what)
        for name, whats in by_name.items():
            origin = given[name][1] if name in given else _Origin("", 2)
            problems.append(_Problem(origin, name, "; ".join(whats)))
    else:
        if not problems:
            return settings
    problems.sort(key=lambda p: (p.origin.rank, p.origin.line))
    raise SettingsError(*map(str, problems))


def core_config(settings: Settings) -> CoreConfig:
    """The pure core's configuration from the settings (the core never sees pydantic)."""
    return _build(CoreConfig, settings)


def server_config(settings: Settings) -> ServerConfig:
    """The server's own settings, typed (``Settings`` is generated, so its fields are not)."""
    return _build(ServerConfig, settings)


def fleet_config(settings: Settings) -> FleetConfig:
    """The fleet's settings, typed."""
    return _build(FleetConfig, settings)


def _build(config: type[T], settings: Settings) -> T:
    """``config`` filled from the settings, nested concerns built from their own settings."""
    values: dict[str, Any] = {}
    for f in fields(config):
        hint = _HINTS[config][f.name]
        if hint in _PREFIX:
            values[f.name] = _build(hint, settings)
        else:
            values[f.name] = _as_core(getattr(settings, _PREFIX[config] + f.name), hint)
    return config(**values)


def _shown(default: Any) -> str:
    value = _as_setting(default)
    return "`unset`" if value is None else f"`{json.dumps(value)}`"


# What most deployments set (the reference opens with these): where it listens, its tokens, the
# fleet's store and identity, and which classes exist or are offline.
COMMON_SETTINGS = ("grpc_port", "http_port", "policy_token_file", "engine_secret", "state_store",
                   "sidecar_id", "fleet_model", "offline_classes", "declared_classes", "max_k",
                   "half_life_seconds")


def _anchor(name: str) -> str:
    """The link target of a setting's row in the reference."""
    return name.replace("_", "-")


def _first_sentence(doc: str) -> str:
    """The first sentence of a setting's meaning (the full text stays in its row)."""
    head = re.split(r"(?<=[a-z0-9)\]`]\.)\s+(?=[A-Z])", doc, maxsplit=1)[0]
    return head if head.endswith(".") else head + "."


def settings_reference() -> str:
    """Markdown reference of every setting, one table per concern: name, environment variable,
    default, meaning with unit. docs/configuration.md is this text; a test keeps them equal."""
    rows = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `specpilot settings --markdown`; do not edit.",
        "Each setting is documented once, under its field in the dataclass of its concern; the",
        "setting's name is the field's (with the concern's prefix, if any).",
        "Sources, later ones win: defaults < YAML file (`--config`) < environment "
        "(`SPECPILOT_<NAME>`) < command-line flags. In the environment, lists are JSON: "
        "`SPECPILOT_OFFLINE_CLASSES='[\"batch\"]'`.",
    ]
    common = [(f"[`{name}`](#{_anchor(name)})", f"`{env_name(name)}`",
               _shown(SETTINGS[name].default), _first_sentence(SETTINGS[name].doc))
              for name in COMMON_SETTINGS]
    rows += ["", "## The settings people change", "",
             "Most deployments set only these; every other setting has a default that suits "
             "them. Each links to its full entry below.", "",
             *markdown_table(("setting", "environment", "default", "what"), common)]
    for concern in CONCERNS:
        cls = concern.config
        summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        prefix = f" Setting names: `{concern.prefix}` + field name." if concern.prefix else ""
        table = [(f'<a id="{_anchor(s.name)}"></a>`{s.name}`', f"`{env_name(s.name)}`",
                  _shown(s.default), s.doc)
                 for s in SETTINGS.values() if s.concern is cls]
        rows += ["", f"## `{cls.__name__}` (`{cls.__module__}`)", "", summary + prefix, "",
                 *markdown_table(("setting", "environment", "default", "meaning"), table)]
    return "\n".join(rows) + "\n"
