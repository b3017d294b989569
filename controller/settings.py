"""The controller's settings, derived from the config dataclasses of each concern.

Each tunable lives in the dataclass of its concern (``CONCERNS``): the server's below, the core's
in their core modules. There, once, are its default, its constraints (``controller.core.tunable``)
and its documentation with the unit (the docstring under the field). ``Settings`` is generated
from them with flat names: the field's name with the concern's prefix (``cost_prior_`` for
``CostPrior``, none for the others), e.g. ``half_life_seconds`` or ``cost_prior_base_seconds``.

Sources, later ones win: defaults < YAML file (``--config`` or ``SPECPILOT_CONFIG``) <
environment (``SPECPILOT_<NAME>``, e.g. ``SPECPILOT_HALF_LIFE_SECONDS=120``) < command-line flags.
Lists in the environment are JSON (``SPECPILOT_OFFLINE_CLASSES='["batch"]'``).
A bad value stops start-up with one line naming the setting (see ``load_settings``).
"""

from __future__ import annotations

import json
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
from pydantic_settings import BaseSettings, SettingsConfigDict

from controller.core.acceptance import EstimatorConfig
from controller.core.controller import CoreConfig
from controller.core.cost_model import CostPrior
from controller.core.policy import PolicyConfig
from controller.core.tunable import CONSTRAINTS, Constraints, tunable
from controller.fielddocs import field_docs, markdown_table

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class SettingsError(ValueError):
    """A setting has a bad value; the message names it."""


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
    engine_token: SecretStr | None = None
    """Bearer token engines must present to open EngineService.Connect (gRPC metadata
    ``authorization``; the plugin's SPECPILOT_PLUGIN_TOKEN). Unset: engine streams need none,
    which the server allows only when grpc_host is a loopback address (the sidecar's own pod)
    or allow_unauthenticated_engines is set."""
    allow_unauthenticated_engines: bool = False
    """Accept engine streams without a token although grpc_host is not loopback: only on a
    network where every client is trusted (anyone who reaches the port could steer policy)."""
    tls_cert_file: str = ""
    """PEM certificate (chain) of both listeners: with tls_key_file set, gRPC serves TLS and
    HTTP serves HTTPS; both or neither. Read at start-up (a rotated certificate takes a
    restart)."""
    tls_key_file: str = ""
    """PEM private key (unencrypted) of tls_cert_file; it must match the certificate."""
    tls_client_ca_file: str = ""
    """PEM CA bundle that engine client certificates must be signed by (mTLS; needs
    tls_cert_file): an engine stream without a verified client certificate is refused
    (UNAUTHENTICATED), and engine streams then need no engine_token to listen beyond loopback.
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
    so one engine's certificate cannot take over another engine's id."""
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
    """The base of ``Settings``: sources, strictness and the checks between settings."""

    model_config = SettingsConfigDict(env_prefix="SPECPILOT_", extra="forbid", frozen=True)

    if TYPE_CHECKING:
        # The fields are generated from CONCERNS, so the type checker cannot see them.
        def __getattr__(self, name: str) -> Any: ...

    @model_validator(mode="after")
    def _check_relations(self) -> _SettingsModel:
        for s in SETTINGS.values():
            value = getattr(self, s.name)
            if (other := s.constraints.at_most) and value > getattr(self, other):
                raise ValueError(f"{s.name}: must not exceed {other}")
            if (other := s.constraints.one_of) and value not in getattr(self, other):
                raise ValueError(f"{s.name}: must be one of {other}")
        return self


if TYPE_CHECKING:
    Settings = _SettingsModel
else:
    Settings = create_model(
        "Settings", __base__=_SettingsModel, __module__=__name__,
        __doc__="Controller configuration: one field per setting of CONCERNS, flat names.",
        **{s.name: _pydantic_field(s) for s in SETTINGS.values()})


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from file < environment < ``overrides`` (None values are ignored).

    Raises SettingsError with one line naming the first bad setting.
    """
    file_values: dict[str, Any] = {}
    if config_file is not None:
        try:
            loaded = yaml.safe_load(Path(config_file).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"config file {config_file}: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(f"config file {config_file}: expected a mapping of settings")
        file_values = loaded or {}
    explicit = {k: v for k, v in overrides.items() if v is not None}
    try:
        env_only = Settings()
        # File values apply only where the environment did not set the field.
        merged = {k: v for k, v in file_values.items() if k not in env_only.model_fields_set}
        return Settings(**{**merged, **explicit})
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        name = ".".join(str(p) for p in err["loc"])
        # Cross-field checks name their setting at the start of the message.
        raise SettingsError(f"bad setting {name}: {msg}" if name else f"bad setting {msg}") from exc


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
        "(`SPECPILOT_<NAME>`) < command-line flags.",
    ]
    for concern in CONCERNS:
        cls = concern.config
        summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        prefix = f" Setting names: `{concern.prefix}` + field name." if concern.prefix else ""
        table = [(f"`{s.name}`", f"`SPECPILOT_{s.name.upper()}`", _shown(s.default), s.doc)
                 for s in SETTINGS.values() if s.concern is cls]
        rows += ["", f"## `{cls.__name__}` (`{cls.__module__}`)", "", summary + prefix, "",
                 *markdown_table(("setting", "environment", "default", "meaning"), table)]
    return "\n".join(rows) + "\n"
