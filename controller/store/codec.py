"""The one converter between the core's records and what a state store holds (JSON): evidence
exports, engine options, recommendations, fleet overrides and decision events."""

from __future__ import annotations

import json
import math
from typing import Any

from controller.core.fleet import EvidenceEntry, EvidenceExport
from controller.core.recommend import (
    PLAIN,
    SPECULATIVE,
    DraftCurve,
    EngineOptions,
    Option,
    Recommendation,
)
from controller.core.types import Decision, DecisionEvent, Override, OverrideScope, Reason

# Bumped when the stored shape changes; a record of another version is skipped, not misread.
FORMAT = 1


class StoredRecordError(ValueError):
    """A stored record could not be read; the message says why (the record is skipped)."""


def export_to_json(export: EvidenceExport) -> str:
    return json.dumps({
        "format": FORMAT, "sidecar": export.sidecar, "at": export.at,
        "entries": [[e.traffic_class, e.draft, list(e.accepts), list(e.rejects)]
                    for e in export.entries],
    }, separators=(",", ":"), allow_nan=False)


def export_from_json(text: str | bytes) -> EvidenceExport:
    """StoredRecordError for anything that is not a well-formed export of this format."""
    try:
        raw: Any = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise StoredRecordError(f"not an evidence record of format {FORMAT}")
        at = float(raw["at"])
        if not math.isfinite(at):
            raise StoredRecordError("its time is not finite")
        entries = tuple(EvidenceEntry(str(c), str(d), tuple(float(x) for x in a),
                                      tuple(float(x) for x in r))
                        for c, d, a, r in raw["entries"])
        return EvidenceExport(str(raw["sidecar"]), at, entries)
    except StoredRecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise StoredRecordError(f"malformed evidence record: {exc}") from exc


def _finite(value: Any, what: str) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise StoredRecordError(f"{what} is not finite")
    return number


def override_to_json(ov: Override) -> str:
    return json.dumps({
        "format": FORMAT, "traffic_class": ov.traffic_class, "pin_k": ov.pin_k,
        "force_draft": ov.force_draft, "force_off": ov.force_off, "note": ov.note,
        "set_at": ov.set_at, "set_by": ov.set_by,
    }, separators=(",", ":"), allow_nan=False)


def override_from_json(text: str | bytes) -> Override:
    """A fleet override; StoredRecordError for anything else (a bad action included)."""
    try:
        raw: Any = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise StoredRecordError(f"not an override record of format {FORMAT}")
        pin_k = raw["pin_k"]
        if pin_k is not None and (not isinstance(pin_k, int) or isinstance(pin_k, bool)):
            raise StoredRecordError(f"pin_k {pin_k!r} is not an integer")
        force_draft = raw["force_draft"]
        return Override(
            traffic_class=str(raw["traffic_class"]), pin_k=pin_k,
            force_draft=None if force_draft is None else str(force_draft),
            force_off=bool(raw["force_off"]), note=str(raw["note"]),
            set_at=_finite(raw["set_at"], "set_at"), scope=OverrideScope.FLEET,
            set_by=str(raw["set_by"]))
    except StoredRecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:  # Override's own checks are ValueErrors
        raise StoredRecordError(f"malformed override record: {exc}") from exc


def event_to_json(e: DecisionEvent) -> str:
    """ValueError when a number in it is not finite (the event is not worth a corrupt log)."""
    def decision(d: Decision) -> dict[str, Any]:
        return {"traffic_class": d.traffic_class, "bucket": d.bucket, "draft": d.draft,
                "k": d.k, "reason": d.reason.value, "expected_speedup": d.expected_speedup,
                "probe_rate": d.probe_rate, "probe_k": d.probe_k, "probe_draft": d.probe_draft}
    return json.dumps({
        "format": FORMAT, "policy_version": e.policy_version, "at": e.at,
        "decision": decision(e.decision),
        "previous": None if e.previous is None else decision(e.previous),
    }, separators=(",", ":"), allow_nan=False)


def event_from_json(text: str | bytes) -> DecisionEvent:
    try:
        raw: Any = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise StoredRecordError(f"not a decision record of format {FORMAT}")

        def decision(d: dict[str, Any]) -> Decision:
            return Decision(str(d["traffic_class"]), int(d["bucket"]), str(d["draft"]),
                            int(d["k"]), Reason(d["reason"]),
                            _finite(d["expected_speedup"], "expected_speedup"),
                            _finite(d["probe_rate"], "probe_rate"), int(d["probe_k"]),
                            str(d["probe_draft"]))
        previous = raw["previous"]
        return DecisionEvent(int(raw["policy_version"]), _finite(raw["at"], "at"),
                             decision(raw["decision"]),
                             None if previous is None else decision(previous))
    except StoredRecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise StoredRecordError(f"malformed decision record: {exc}") from exc


def options_to_json(o: EngineOptions) -> str:
    return json.dumps({
        "format": FORMAT, "sidecar": o.sidecar, "at": o.at, "pool": o.pool, "load": o.load,
        "batch_sizes": list(o.batch_sizes), "off": list(o.off), "cost_steps": o.cost_steps,
        "curves": [[c.traffic_class, c.draft, list(c.ks), list(c.goodput), c.tries]
                   for c in o.curves],
    }, separators=(",", ":"), allow_nan=False)


def options_from_json(text: str | bytes) -> EngineOptions:
    """StoredRecordError for anything but well-formed options with finite, non-negative
    numbers and one value per bucket."""
    try:
        raw: Any = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise StoredRecordError(f"not an engine-options record of format {FORMAT}")
        if raw["pool"] not in (SPECULATIVE, PLAIN):
            raise StoredRecordError(f"pool {raw['pool']!r} is neither {SPECULATIVE} nor {PLAIN}")
        sizes = tuple(int(n) for n in raw["batch_sizes"])

        def per_bucket(values: Any, what: str) -> tuple[float, ...]:
            out = tuple(_finite(v, what) for v in values)
            if len(out) != len(sizes) or min(out, default=0.0) < 0:
                raise StoredRecordError(f"{what}: expected {len(sizes)} values >= 0")
            return out
        curves = tuple(
            DraftCurve(str(c), str(d), tuple(int(k) for k in ks), per_bucket(g, "goodput"),
                       _finite(t, "tries"))
            for c, d, ks, g, t in raw["curves"])
        if any(len(c.ks) != len(sizes) for c in curves):
            raise StoredRecordError("ks: expected one K per bucket")
        return EngineOptions(str(raw["sidecar"]), _finite(raw["at"], "at"), raw["pool"],
                             _finite(raw["load"], "load"), sizes, per_bucket(raw["off"], "off"),
                             _finite(raw["cost_steps"], "cost_steps"), curves)
    except StoredRecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise StoredRecordError(f"malformed engine-options record: {exc}") from exc


def recommendation_to_json(r: Recommendation, at: float) -> str:
    """ValueError when a number in it is not finite."""
    return json.dumps({
        "format": FORMAT, "at": at, "traffic_class": r.traffic_class,
        "batch_bucket": r.batch_bucket, "batch_size": r.batch_size, "draft": r.draft,
        "pool": r.pool,
        "options": [[o.pool, o.draft, o.k, o.goodput, o.tries, o.sidecars, o.cost_steps]
                    for o in r.options],
    }, separators=(",", ":"), allow_nan=False)


def recommendation_from_json(text: str | bytes) -> tuple[float, Recommendation]:
    """(when it was made, the recommendation); StoredRecordError for anything else."""
    try:
        raw: Any = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise StoredRecordError(f"not a recommendation record of format {FORMAT}")
        options = tuple(Option(str(p), str(d), int(k), _finite(g, "goodput"),
                               _finite(t, "tries"), int(n), _finite(c, "cost_steps"))
                        for p, d, k, g, t, n, c in raw["options"])
        return _finite(raw["at"], "at"), Recommendation(
            str(raw["traffic_class"]), int(raw["batch_bucket"]), int(raw["batch_size"]),
            str(raw["draft"]), str(raw["pool"]), options)
    except StoredRecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise StoredRecordError(f"malformed recommendation record: {exc}") from exc
