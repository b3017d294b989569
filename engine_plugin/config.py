"""The engine plugin's configuration, from the environment of the vLLM process.

Every setting is an environment variable ``SPECPILOT_PLUGIN_<NAME>`` (``<NAME>`` is the field name
in upper case, e.g. ``SPECPILOT_PLUGIN_CONTROLLER=127.0.0.1:50051``). An unset or empty variable
means the default. A bad value raises ValueError naming the variable. A variable with the prefix
that names no setting is logged as a warning (a typo would otherwise pass silently).

Each setting is documented once, with its unit, by the docstring under its field of
``PluginConfig``; the table in docs/engine-plugin.md is generated from them (``settings_table``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal, cast

from specpilot.contract.fielddocs import field_docs, markdown_table
from specpilot.contract.validation import MAX_HARDWARE_CHARS

log = logging.getLogger(__name__)

ENV_PREFIX = "SPECPILOT_PLUGIN_"
KMode = Literal["per_request", "batch_max", "batch_wide"]
K_MODES: tuple[KMode, ...] = ("per_request", "batch_max", "batch_wide")


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


# Field metadata: how the reference shows a default computed per process.
SHOWN_DEFAULT = "specpilot.shown_default"


@dataclass(frozen=True)
class PluginConfig:
    """Plugin settings, each documented under its field; defaults are the field values."""

    controller: str = ""
    """The controller's gRPC address, ``host:port`` (``[::1]:50051`` for IPv6). Empty: no
    controller; the engine keeps its static configuration."""
    token: str = field(default="", repr=False)
    """Bearer token for the controller's engine stream: this engine's own (``specpilot
    engine-token --id ENGINE_ID`` with the controller's ``engine_secret``), or the controller's
    shared ``engine_token``; empty: none (a controller listening on loopback only needs none).
    Set it from a Secret, not on a command line."""
    token_file: str = ""
    """File holding the token instead (what ``specpilot engine-token --id ID --output FILE``
    writes, e.g. in a volume the engine shares with an init container that holds the secret);
    read at every connect, so a re-issued token is picked up. Not with ``token``."""
    tls_ca_file: str = ""
    """PEM CA bundle that signed the controller's certificate: set, the stream uses TLS and
    verifies the controller against it; empty: plaintext. Read at every connect (a TLS failure
    is logged once per outage, and the engine keeps serving on its last policy, then its
    static configuration)."""
    tls_cert_file: str = ""
    """PEM client certificate for a controller that requires one (its tls_client_ca_file:
    mTLS); with tls_key_file, and needs tls_ca_file."""
    tls_key_file: str = ""
    """PEM private key (unencrypted) of tls_cert_file."""
    tls_server_name: str = ""
    """Name the controller's certificate is checked for instead of the host of ``controller``
    (e.g. the Service's DNS name while connecting to 127.0.0.1); needs tls_ca_file."""
    engine_id: str = field(default_factory=default_engine_id,
                           metadata={SHOWN_DEFAULT: "<hostname>-<pid>"})
    """This engine's id on the controller; a reconnecting engine must keep its id."""
    class_rules: str = ""
    """Path of the YAML file of traffic-class rules (format in ``specpilot.engine_plugin.classify``,
    an example in docs/engine-plugin.md); empty: no rules."""
    max_classes: int = 16
    """Distinct class names the engine ever reports, count >= 2, ``default`` and ``other``
    included; later names fold into ``other``."""
    report_interval_seconds: float = 1.0
    """How often the engine reports, seconds > 0, until the controller's hello ack sets it."""
    fail_static_timeout_seconds: float = 30.0
    """Silence after which the engine reverts to its static configuration, seconds > 0 (the
    controller's policy updates carry their own value)."""
    queue_size: int = 64
    """Reports waiting for the sender thread, count >= 1; when full the oldest is dropped and
    counted."""
    reconnect_initial_seconds: float = 0.5
    """First reconnect backoff ceiling, seconds > 0; it doubles per failure, with full jitter."""
    reconnect_max_seconds: float = 10.0
    """Largest reconnect backoff ceiling, seconds, at least ``reconnect_initial_seconds``."""
    k_mode: KMode = "per_request"
    """``per_request``: the drafter drafts the configured K and each request's drafts are cut to
    its class's K (saves verification only). ``batch_max``: the drafter drafts the largest K any
    request of the step wants, then each request is cut to its own (saves draft passes too; the
    best mode on CPUs, used by the demo and the CPU benchmark). ``batch_wide``: one K for the
    whole step, the median the requests want, and the drafter drafts only that many (keeps
    uniform-decode CUDA graphs on GPUs)."""
    ngram_drafts: bool = True
    """Offer n-gram (prompt-lookup) drafts to the controller (substituted where the engine mode
    allows) and score them counterfactually: ``true`` or ``false``."""
    suffix_drafts: bool = False
    """Offer suffix drafts (Suffix Decoding, from the ``arctic-inference`` package; skipped with
    one log line where it is not installed) the same way: ``true`` or ``false``. Off by default:
    scoring them counterfactually costs about 60 us per scored request-step in the scheduler
    (n-gram: about 15; docs/benchmarks.md); turn them on for repetitive or agentic traffic."""
    suffix_cached_responses: int = 1000
    """Responses the plugin's own suffix cache keeps for later requests, count >= 0 (0: none;
    oldest evicted first). About 220 bytes per token: 1,000 responses of 512 tokens are about
    110 MiB of the scheduler process. (vLLM's own ``method: "suffix"`` keeps its
    ``suffix_decoding_max_cached_requests``.)"""
    counterfactual_per_step: float = 2.0
    """Requests whose deterministic drafts (n-gram, suffix) are scored counterfactually per step,
    on average, >= 0 (0: none), plus the first of each class that has none of those. A request
    is scored while its fixed random point (a hash of its id) is below this number over the
    running batch size: a small batch is scored whole, and the cost per step stays bounded as
    the batch grows (an n-gram proposal costs 1-5 us: the matcher on the request's own buffer
    of its last 2,048 tokens). A subset drawn by hash keeps the estimate unbiased. Each class
    present also scores its running request of the lowest point, so its evidence starts at
    once (one request per class, at most 8 classes a step, in turn)."""

    step_composition: bool = True
    """In ``batch_max`` mode, re-pick per step the arms of classes whose decision is a settled
    goodput choice, for the classes and counts in that step, from the pricing the controller
    sends with its policy (``engine_plugin/policy/compose.py``): ``true`` or ``false`` (the
    decisions apply as they are). Costs about 300 us for a step whose counts were not seen
    under the policy in force, 7 us for one that was (five classes, on 2 CPU cores)."""

    skip_idle_drafter: bool = True
    """In the batch modes, skip the drafter's pass in a decode step whose batch K is 0 (every
    request off or on n-gram or suffix drafts); a step that prefills always runs it. Saves the
    drafter's first forward (10-20% of a step on CPUs); the skipped positions are holes in the
    drafter's KV cache that cost some later acceptance, never correctness. vLLM's n-gram and
    suffix proposers, which keep no KV, are skipped in every K mode and in any step where every
    scheduled request is off; the suffix proposer still learns that step's tokens (its cache
    of responses drafts for later requests), it only drafts nothing. A model drafter is skipped
    in any step, prefill included, whose requests were all admitted off (their class off, and
    probing nothing, at their first scheduled step): such a request stays off for its
    lifetime, since the drafter never saw its prompt: ``true`` or ``false``."""

    hardware: str = ""
    """What the engine runs on, as the controller's fleet groups engines (with the model and
    its drafts) to share step costs; empty: described from the device, its parallelism and
    dtype (e.g. ``NVIDIA H100 80GB HBM3 tp1 pp1 bfloat16``). Name it where devices of one name
    cost differently (power limits, shared hosts), at most 200 printable characters."""

    step_profile: bool = True
    """Time a few dummy target steps (decode steps, and one that prefills a prompt chunk beside
    them) and drafter passes after the warm-up of an engine on specpilot's scheduler (about
    1-2 s; each shape the fastest of five) and send them in the
    hello, so the controller's cost model starts from this hardware (its prior centred on
    them, ``cost_prior_profile_center_steps``, and each a light observation,
    ``cost_prior_profile_weight_steps``): ``true`` or ``false``."""

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> PluginConfig:
        """Settings from ``SPECPILOT_PLUGIN_*`` variables; unset or empty ones take defaults.

        Raises ValueError naming the variable when a value does not parse or is out of range.
        """
        known = {f.name: f for f in fields(cls)}
        for key in environ:
            if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() not in known:
                log.warning("%s: unknown specpilot plugin setting, ignored (known: %s)", key,
                            ", ".join(env_name(n) for n in known))
        values: dict[str, Any] = {}
        for name, f in known.items():
            raw = environ.get(env_name(name), "").strip()
            if not raw:
                continue
            parse = _PARSERS.get(cast(str, f.type), str)
            try:
                values[name] = parse(raw)
            except ValueError as exc:
                raise ValueError(f"{env_name(name)}: {exc}") from None
        return cls(**values)


def _parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"expected an integer, got {raw!r}") from None


def _parse_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"expected a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


# Field annotations are strings (``from __future__ import annotations``).
def _parse_bool(raw: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": _parse_int, "float": _parse_float, "bool": _parse_bool}


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or host == "[]":
        raise ValueError(f"expected host:port, got {address!r}")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"unbalanced brackets in {address!r}")
    if ":" in host and not host.startswith("["):
        raise ValueError(f"an IPv6 host needs brackets, e.g. [::1]:50051, got {address!r}")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"port {port!r} is not an integer") from None
    if not 1 <= number <= 65535:
        raise ValueError(f"port {number} outside 1..65535")
    return host, number


def _check(c: PluginConfig) -> None:
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"{env_name(name)}: {why}")

    if c.controller:
        try:
            _split_host_port(c.controller)
        except ValueError as exc:
            raise bad("controller", str(exc)) from None
    if not c.engine_id.strip():
        raise bad("engine_id", "must not be empty")
    if c.token and c.token_file:
        raise bad("token_file", f"set it or {env_name('token')}, not both")
    if bool(c.tls_cert_file) != bool(c.tls_key_file):
        given, missing = (("tls_cert_file", "tls_key_file") if c.tls_cert_file
                          else ("tls_key_file", "tls_cert_file"))
        raise bad(given, f"needs {env_name(missing)} too (a client certificate and its key)")
    for name in ("tls_cert_file", "tls_server_name"):
        if getattr(c, name) and not c.tls_ca_file:
            raise bad(name, f"needs {env_name('tls_ca_file')} (TLS is on only with the CA "
                            "that verifies the controller)")
    if len(c.hardware) > MAX_HARDWARE_CHARS or not c.hardware.isprintable():
        raise bad("hardware", f"must be at most {MAX_HARDWARE_CHARS} printable characters")
    if type(c.max_classes) is not int or c.max_classes < 2:
        raise bad("max_classes", f"must be an integer >= 2 (room for 'default' and 'other'), "
                                 f"got {c.max_classes!r}")
    if type(c.queue_size) is not int or c.queue_size < 1:
        raise bad("queue_size", f"must be an integer >= 1, got {c.queue_size!r}")
    if type(c.suffix_cached_responses) is not int or c.suffix_cached_responses < 0:
        raise bad("suffix_cached_responses",
                  f"must be an integer >= 0, got {c.suffix_cached_responses!r}")
    for name in ("report_interval_seconds", "fail_static_timeout_seconds",
                 "reconnect_initial_seconds", "reconnect_max_seconds"):
        value = getattr(c, name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise bad(name, f"must be a finite number of seconds > 0, got {value!r}")
    if c.reconnect_max_seconds < c.reconnect_initial_seconds:
        raise bad("reconnect_max_seconds",
                  f"{c.reconnect_max_seconds} is below reconnect_initial_seconds "
                  f"{c.reconnect_initial_seconds}")
    per_step = c.counterfactual_per_step
    if not isinstance(per_step, int | float) or not 0.0 <= per_step < math.inf:
        raise bad("counterfactual_per_step",
                  f"must be a finite number >= 0, got {per_step!r}")
    if c.k_mode not in K_MODES:
        raise bad("k_mode", f"must be one of {', '.join(K_MODES)}, got {c.k_mode!r}")


def settings_table() -> str:
    """The Markdown table of every setting (variable, default, meaning) from ``PluginConfig``'s
    fields; docs/engine-plugin.md holds it and a test keeps the two equal."""
    docs = field_docs(PluginConfig)
    rows = [(f"`{env_name(f.name)}`", _shown_default(f), docs[f.name])
            for f in fields(PluginConfig)]
    return "\n".join(markdown_table(("variable", "default", "meaning"), rows)) + "\n"


def _shown_default(f: Field[Any]) -> str:
    if SHOWN_DEFAULT in f.metadata:
        return f"`{f.metadata[SHOWN_DEFAULT]}`"
    if f.default == "":
        return "empty"
    return f"`{str(f.default).lower()}`" if isinstance(f.default, bool) else f"`{f.default}`"
