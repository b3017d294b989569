"""The one converter between the core's records and what a state store holds (JSON): evidence
exports, step-cost exports, engine options, recommendations, fleet overrides and decision
events."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from specpilot.contract.records import (
    ArmFigures,
    Decision,
    DecisionEvent,
    DecisionFigures,
    Override,
    OverrideScope,
    Reason,
)
from specpilot.controller.core.cost_model import CostEvidence
from specpilot.controller.core.fleet import CostExport, EvidenceEntry, EvidenceExport
from specpilot.controller.core.recommend import (
    PLAIN,
    SPECULATIVE,
    DraftCurve,
    EngineOptions,
    Option,
    Recommendation,
)

# Bumped when the stored shape changes; a record of another version is skipped, not misread.
FORMAT = 1
# Step-cost records: 3 since the cost model's speculating-sequence and prefill columns. Records
# of earlier formats are skipped, not migrated: their speculative steps' cost per sequence is
# spread over the other columns, which no empty column can undo (the engine's next minutes of
# steps price them again).
COSTS_FORMAT = 3
T = TypeVar("T")


class StoredRecordError(ValueError):
    """A stored record could not be read; the message says why (the record is skipped)."""


def _dump(fields: dict[str, Any], fmt: int = FORMAT) -> str:
    """One record: its fields and the format, compact; ValueError for a number not finite."""
    return json.dumps({"format": fmt, **fields}, separators=(",", ":"), allow_nan=False)


def _parse(text: str | bytes, what: str, build: Callable[[dict[str, Any]], T],
           formats: tuple[int, ...] = (FORMAT,)) -> T:
    """``build`` on the fields of a stored ``what`` record of one of ``formats``;
    StoredRecordError for anything else (a missing field, a wrong type or a failed check inside
    ``build``)."""
    try:
        raw: Any = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") not in formats:
            raise StoredRecordError(
                f"not a {what} record of format {' or '.join(map(str, formats))}")
        return build(raw)
    except StoredRecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:  # the records' own checks are ValueErrors
        raise StoredRecordError(f"malformed {what} record: {exc}") from exc


def _finite(value: Any, what: str) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise StoredRecordError(f"{what} is not finite")
    return number


def export_to_json(export: EvidenceExport) -> str:
    return _dump({
        "sidecar": export.sidecar, "at": export.at,
        "entries": [[e.traffic_class, e.draft, list(e.accepts), list(e.rejects)]
                    for e in export.entries],
    })


def export_from_json(text: str | bytes) -> EvidenceExport:
    """StoredRecordError for anything that is not a well-formed export of this format."""
    def build(raw: dict[str, Any]) -> EvidenceExport:
        at = _finite(raw["at"], "at")
        entries = tuple(EvidenceEntry(str(c), str(d), tuple(float(x) for x in a),
                                      tuple(float(x) for x in r))
                        for c, d, a, r in raw["entries"])
        return EvidenceExport(str(raw["sidecar"]), at, entries)
    return _parse(text, "evidence", build)


def costs_to_json(export: CostExport) -> str:
    """ValueError when a number in it is not finite."""
    ev = export.evidence
    return _dump({
        "sidecar": export.sidecar, "at": export.at, "hardware": export.hardware,
        "drafts": list(ev.drafts), "knots": list(ev.knots),
        # Symmetric: its upper triangle, row by row, is all there is (half the bytes).
        "information_upper": ev.information[np.triu_indices(ev.weighted_times.size)].tolist(),
        "weighted_times": ev.weighted_times.tolist(),
        "squared_times": ev.squared_times, "reports": ev.reports, "steps": ev.steps,
    }, COSTS_FORMAT)


def costs_from_json(text: str | bytes) -> CostExport:
    """StoredRecordError for anything but a well-formed step-cost export of ``COSTS_FORMAT``
    (finite numbers, an information matrix of the size its knots and drafts give)."""
    def build(raw: dict[str, Any]) -> CostExport:
        times = np.asarray(raw["weighted_times"], dtype=np.float64)
        upper = np.asarray(raw["information_upper"], dtype=np.float64)
        n = times.size
        if times.ndim != 1 or upper.shape != (n * (n + 1) // 2,):
            raise StoredRecordError(f"information_upper: expected {n * (n + 1) // 2} values "
                                    f"for {n} weighted times")
        information = np.zeros((n, n))
        information[np.triu_indices(n)] = upper
        information = information + np.triu(information, 1).T
        evidence = CostEvidence(
            tuple(str(d) for d in raw["drafts"]), tuple(int(k) for k in raw["knots"]),
            information, times,
            _finite(raw["squared_times"], "squared_times"), _finite(raw["reports"], "reports"),
            _finite(raw["steps"], "steps"))
        return CostExport(str(raw["sidecar"]), _finite(raw["at"], "at"), str(raw["hardware"]),
                          evidence)
    return _parse(text, "step-cost", build, (COSTS_FORMAT,))


def override_to_json(ov: Override) -> str:
    return _dump({
        "traffic_class": ov.traffic_class, "pin_k": ov.pin_k,
        "force_draft": ov.force_draft, "force_off": ov.force_off, "note": ov.note,
        "set_at": ov.set_at, "set_by": ov.set_by,
    })


def override_from_json(text: str | bytes) -> Override:
    """A fleet override; StoredRecordError for anything else (a bad action included)."""
    def build(raw: dict[str, Any]) -> Override:
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
    return _parse(text, "override", build)


def event_to_json(e: DecisionEvent) -> str:
    """ValueError when a number in it is not finite (the event is not worth a corrupt log)."""
    def decision(d: Decision) -> dict[str, Any]:
        return {"traffic_class": d.traffic_class, "bucket": d.bucket, "draft": d.draft,
                "k": d.k, "reason": d.reason.value, "expected_speedup": d.expected_speedup,
                "probe_rate": d.probe_rate, "probe_k": d.probe_k, "probe_draft": d.probe_draft,
                "probe_steps": d.probe_steps, "too_little_evidence": d.too_little_evidence}
    return _dump({
        "policy_version": e.policy_version, "at": e.at,
        "decision": decision(e.decision),
        "previous": None if e.previous is None else decision(e.previous),
        "figures": None if e.figures is None else _figures_json(e.figures),
    })


def _figures_json(f: DecisionFigures) -> dict[str, Any]:
    def arm(a: ArmFigures | None) -> list[Any] | None:
        return None if a is None else [a.draft, a.k, a.expected_tokens, a.goodput, a.speedup,
                                       None if a.acceptance is None else list(a.acceptance),
                                       a.too_little_evidence]
    return {"batch_size": f.batch_size, "chosen": arm(f.chosen), "previous": arm(f.previous),
            "best": arm(f.best), "pinned_by": f.pinned_by}


def _figures_from_json(raw: dict[str, Any]) -> DecisionFigures:
    def arm(a: list[Any] | None) -> ArmFigures | None:
        if a is None:
            return None
        # Records from before the flag was kept have six entries.
        draft, k, tokens, gain, ratio, acceptance, *flag = a
        return ArmFigures(str(draft), int(k), _finite(tokens, "expected_tokens"),
                          _finite(gain, "goodput"), _finite(ratio, "speedup"),
                          None if acceptance is None else (_finite(acceptance[0], "acceptance"),
                                                           _finite(acceptance[1], "acceptance")),
                          bool(flag[0]) if flag else False)
    return DecisionFigures(int(raw["batch_size"]), arm(raw["chosen"]), arm(raw["previous"]),
                           arm(raw["best"]), str(raw["pinned_by"]))


def event_from_json(text: str | bytes) -> DecisionEvent:
    """Records from before decisions kept their figures read with ``figures`` None."""
    def build(raw: dict[str, Any]) -> DecisionEvent:

        def decision(d: dict[str, Any]) -> Decision:
            return Decision(str(d["traffic_class"]), int(d["bucket"]), str(d["draft"]),
                            int(d["k"]), Reason(d["reason"]),
                            _finite(d["expected_speedup"], "expected_speedup"),
                            _finite(d["probe_rate"], "probe_rate"), int(d["probe_k"]),
                            str(d["probe_draft"]), bool(d.get("probe_steps", False)),
                            bool(d.get("too_little_evidence", False)))
        previous = raw["previous"]
        figures = raw.get("figures")
        return DecisionEvent(int(raw["policy_version"]), _finite(raw["at"], "at"),
                             decision(raw["decision"]),
                             None if previous is None else decision(previous),
                             None if figures is None else _figures_from_json(figures))
    return _parse(text, "decision", build)


def options_to_json(o: EngineOptions) -> str:
    return _dump({
        "sidecar": o.sidecar, "at": o.at, "pool": o.pool, "load": o.load,
        "batch_sizes": list(o.batch_sizes), "off": list(o.off), "cost_steps": o.cost_steps,
        "curves": [[c.traffic_class, c.draft, list(c.ks), list(c.goodput), c.tries]
                   for c in o.curves],
    })


def options_from_json(text: str | bytes) -> EngineOptions:
    """StoredRecordError for anything but well-formed options with finite, non-negative
    numbers and one value per bucket."""
    def build(raw: dict[str, Any]) -> EngineOptions:
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
    return _parse(text, "engine-options", build)


def recommendation_to_json(r: Recommendation, at: float) -> str:
    """ValueError when a number in it is not finite."""
    return _dump({
        "at": at, "traffic_class": r.traffic_class,
        "batch_bucket": r.batch_bucket, "batch_size": r.batch_size, "draft": r.draft,
        "pool": r.pool,
        "options": [[o.pool, o.draft, o.k, o.goodput, o.tries, o.sidecars, o.cost_steps]
                    for o in r.options],
    })


def recommendation_from_json(text: str | bytes) -> tuple[float, Recommendation]:
    """(when it was made, the recommendation); StoredRecordError for anything else."""
    def build(raw: dict[str, Any]) -> tuple[float, Recommendation]:
        options = tuple(Option(str(p), str(d), int(k), _finite(g, "goodput"),
                               _finite(t, "tries"), int(n), _finite(c, "cost_steps"))
                        for p, d, k, g, t, n, c in raw["options"])
        return _finite(raw["at"], "at"), Recommendation(
            str(raw["traffic_class"]), int(raw["batch_bucket"]), int(raw["batch_size"]),
            str(raw["draft"]), str(raw["pool"]), options)
    return _parse(text, "recommendation", build)
