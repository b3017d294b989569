"""The engine plugin's configuration, from the environment of the vLLM process.

Every setting is an environment variable ``SPECPILOT_PLUGIN_<NAME>`` (``<NAME>`` is the field name
in upper case, e.g. ``SPECPILOT_PLUGIN_CONTROLLER=127.0.0.1:50051``). An unset or empty variable
means the default. A bad value raises ValueError naming the variable. A variable with the prefix
that names no setting is logged as a warning (a typo would otherwise pass silently).

Fields, with unit and default:

- ``controller`` (``SPECPILOT_PLUGIN_CONTROLLER``, host:port, default empty): the controller's
  gRPC address. Empty: no controller; the engine runs its own static configuration.
- ``engine_id`` (``SPECPILOT_PLUGIN_ENGINE_ID``, default ``<hostname>-<pid>``): this engine's
  name on the controller. A reconnecting engine must keep its id.
- ``class_rules`` (``SPECPILOT_PLUGIN_CLASS_RULES``, file path, default empty = no rules): YAML
  file of traffic-class rules (format in ``engine_plugin.classify``).
- ``max_classes`` (``SPECPILOT_PLUGIN_MAX_CLASSES``, count >= 2, default 16): distinct class
  names the engine ever reports, ``default`` and ``other`` included; later names fold into
  ``other``.
- ``report_interval_seconds`` (``SPECPILOT_PLUGIN_REPORT_INTERVAL_SECONDS``, seconds > 0,
  default 1.0): how often the engine reports until the controller's HelloAck sets the interval.
- ``fail_static_timeout_seconds`` (``SPECPILOT_PLUGIN_FAIL_STATIC_TIMEOUT_SECONDS``, seconds > 0,
  default 30): after this long without hearing from the controller the engine reverts to its
  static configuration (a PolicyUpdate's value replaces it).
- ``queue_size`` (``SPECPILOT_PLUGIN_QUEUE_SIZE``, reports >= 1, default 64): reports waiting for
  the sender thread; when full the oldest is dropped and counted.
- ``reconnect_initial_seconds`` (``SPECPILOT_PLUGIN_RECONNECT_INITIAL_SECONDS``, seconds > 0,
  default 0.5) and ``reconnect_max_seconds`` (``SPECPILOT_PLUGIN_RECONNECT_MAX_SECONDS``,
  seconds >= initial, default 10): exponential reconnect backoff with full jitter.
- ``k_mode`` (``SPECPILOT_PLUGIN_K_MODE``, ``per_request``, ``batch_max`` or ``batch_wide``,
  default ``per_request``): ``per_request``: the drafter drafts the configured K and each
  request's drafts are cut to its class's K (saves verification only). ``batch_max``: the drafter
  drafts the largest K any request of the step wants, then each request is cut to its own K
  (saves draft passes too; the best mode on CPUs). ``batch_wide``: one K for the whole step, the
  median the requests want (keeps uniform-decode CUDA graphs on GPUs).
- ``ngram_drafts`` (``SPECPILOT_PLUGIN_NGRAM_DRAFTS``, ``true`` or ``false``, default ``true``):
  offer prompt-lookup drafts to the controller (substituted where the engine mode allows) and
  score them counterfactually on all traffic.
- ``ngram_counterfactual_share`` (``SPECPILOT_PLUGIN_NGRAM_COUNTERFACTUAL_SHARE``, 0..1, default
  0.25): the stable random share of requests whose n-gram drafts are scored counterfactually.
  A proposal costs ~10-70 us (context length); a random subset keeps the estimate unbiased.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, cast

log = logging.getLogger(__name__)

ENV_PREFIX = "SPECPILOT_PLUGIN_"
KMode = Literal["per_request", "batch_max", "batch_wide"]
K_MODES: tuple[KMode, ...] = ("per_request", "batch_max", "batch_wide")


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


@dataclass(frozen=True)
class PluginConfig:
    """Plugin settings; units and defaults in the module docstring and each field's comment."""

    # Controller gRPC address, host:port ("[::1]:50051" for IPv6). Empty: no controller.
    controller: str = ""
    # This engine's id on the controller. Default: <hostname>-<pid>.
    engine_id: str = field(default_factory=default_engine_id)
    # Path of the YAML class-rules file; empty: no rules.
    class_rules: str = ""
    # Distinct class names ever reported, "default" and "other" included (count, >= 2).
    max_classes: int = 16
    # Report interval until the controller's HelloAck sets it, seconds.
    report_interval_seconds: float = 1.0
    # Silence after which the engine reverts to its static configuration, seconds.
    fail_static_timeout_seconds: float = 30.0
    # Reports queued for the sender thread before the oldest is dropped (count).
    queue_size: int = 64
    # First reconnect backoff ceiling, seconds (doubles per failure, full jitter).
    reconnect_initial_seconds: float = 0.5
    # Largest reconnect backoff ceiling, seconds.
    reconnect_max_seconds: float = 10.0
    # "per_request": drafts cut per request; "batch_max": the drafter drafts the batch's largest
    # K, then cut per request; "batch_wide": one K (the median) for the whole step.
    k_mode: KMode = "per_request"
    # Offer n-gram drafts (substitution and counterfactual scoring).
    ngram_drafts: bool = True
    # Share of requests whose n-gram drafts are scored counterfactually (0..1).
    ngram_counterfactual_share: float = 0.25

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

    @property
    def has_controller(self) -> bool:
        return bool(self.controller)


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
    if type(c.max_classes) is not int or c.max_classes < 2:
        raise bad("max_classes", f"must be an integer >= 2 (room for 'default' and 'other'), "
                                 f"got {c.max_classes!r}")
    if type(c.queue_size) is not int or c.queue_size < 1:
        raise bad("queue_size", f"must be an integer >= 1, got {c.queue_size!r}")
    for name in ("report_interval_seconds", "fail_static_timeout_seconds",
                 "reconnect_initial_seconds", "reconnect_max_seconds"):
        value = getattr(c, name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise bad(name, f"must be a finite number of seconds > 0, got {value!r}")
    if c.reconnect_max_seconds < c.reconnect_initial_seconds:
        raise bad("reconnect_max_seconds",
                  f"{c.reconnect_max_seconds} is below reconnect_initial_seconds "
                  f"{c.reconnect_initial_seconds}")
    share = c.ngram_counterfactual_share
    if not isinstance(share, int | float) or not 0.0 <= share <= 1.0:
        raise bad("ngram_counterfactual_share", f"must be a number in 0..1, got {share!r}")
    if c.k_mode not in K_MODES:
        raise bad("k_mode", f"must be one of {', '.join(K_MODES)}, got {c.k_mode!r}")
