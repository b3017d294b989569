"""What sidecars of one model share: each one's acceptance evidence and step-cost evidence, and
the fleet's sums of them.

Each sidecar publishes only its own evidence (its estimator's decayed accepts and rejects per
(class, draft, position)), stamped with the wall-clock time it was decayed to. A sidecar's view of
the fleet is the sum of the *other* sidecars' exports, each decayed from its stamp to now with the
same half-life as the sidecar's own evidence:

    fleet(k, now) = sum over sidecars s != me, age_s <= max_age of  e_s(k) * 2^(-(now - t_s) / h)

and its posterior for key k is prior + own(k, now) + fleet(k, now). Its own export is never read
back as someone else's (the sum skips its id), so nothing is counted twice; a sidecar that stops
publishing ages out after ``max_age`` (and its key expires in the store). Restart recovery is the
same record read back by its owner: its own evidence, decayed to the restart.

Step costs are shared the same way within one engine type: the sidecars of a model whose engines
name the same hardware and the same model drafts (``CostExport``). The cost model is linear in
its weights, so its evidence (information matrix, time-weighted features, squared times) adds
like counts do:

    fleet_cost(now) = sum over s != me of my type, age_s <= max_age of  E_s * 2^(-(now - t_s) / h_c)

with ``h_c`` the cost model's half-life, and the posterior is prior + own + fleet_cost.

Pure: plain records and numpy, no clock (times are passed in) and no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from specpilot.controller.core.cost_model import CostEvidence

FloatArray = npt.NDArray[np.float64]
EvidenceKey = tuple[str, str]  # (traffic class, draft)


@dataclass(frozen=True)
class EvidenceEntry:
    """Decayed accepts and rejects per position 1..n of one (class, draft)."""

    traffic_class: str
    draft: str
    accepts: tuple[float, ...]
    rejects: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.accepts) != len(self.rejects):
            raise ValueError(f"evidence {self.traffic_class}/{self.draft}: accepts and rejects "
                             f"differ in length ({len(self.accepts)} vs {len(self.rejects)})")
        for v in (*self.accepts, *self.rejects):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"evidence {self.traffic_class}/{self.draft}: counts must be "
                                 f"finite and >= 0, got {v!r}")


@dataclass(frozen=True)
class EvidenceExport:
    """One sidecar's evidence, decayed to ``at`` (wall-clock seconds, shared by the fleet)."""

    sidecar: str
    at: float
    entries: tuple[EvidenceEntry, ...]


def fleet_evidence(exports: Iterable[EvidenceExport], me: str, now: float,
                   half_life_seconds: float, max_age_seconds: float
                   ) -> dict[EvidenceKey, tuple[FloatArray, FloatArray]]:
    """The other sidecars' evidence summed per (class, draft), each export decayed from its stamp
    to ``now``; exports from ``me`` and older than ``max_age_seconds`` are left out. An export
    stamped after ``now`` (clocks a little apart) counts undecayed."""
    out: dict[EvidenceKey, tuple[FloatArray, FloatArray]] = {}
    for ex in exports:
        age = now - ex.at
        if ex.sidecar == me or age > max_age_seconds:
            continue
        f = float(2.0 ** (-max(age, 0.0) / half_life_seconds))
        for e in ex.entries:
            add_evidence(out, (e.traffic_class, e.draft), e.accepts, e.rejects, f)
    return out


def add_evidence(into: dict[EvidenceKey, tuple[FloatArray, FloatArray]], key: EvidenceKey,
                 accepts: npt.ArrayLike, rejects: npt.ArrayLike, weight: float = 1.0) -> None:
    """Add ``weight`` x (accepts, rejects) to ``into[key]``, position by position (the shorter
    side zero-padded: sidecars may track different numbers of positions)."""
    a = np.asarray(accepts, dtype=np.float64) * weight
    r = np.asarray(rejects, dtype=np.float64) * weight
    held = into.get(key)
    if held is not None:
        n = max(held[0].size, a.size)
        a, r = positions(held[0], n) + positions(a, n), positions(held[1], n) + positions(r, n)
    into[key] = (a, r)


def positions(x: npt.ArrayLike, n: int) -> FloatArray:
    """``x`` cut or zero-padded to ``n`` positions, as floats."""
    a = np.asarray(x, dtype=np.float64)[:n]
    return a if a.size == n else np.concatenate([a, np.zeros(n - a.size)])


def entries_of(evidence: Mapping[EvidenceKey, tuple[FloatArray, FloatArray]]
               ) -> tuple[EvidenceEntry, ...]:
    """Records of evidence arrays, ordered by key."""
    return tuple(EvidenceEntry(c, d, tuple(float(x) for x in a), tuple(float(x) for x in r))
                 for (c, d), (a, r) in sorted(evidence.items()))


@dataclass(frozen=True)
class CostExport:
    """One sidecar's step-cost evidence, decayed to ``at``, for engines on ``hardware`` (what the
    engines' hellos name, e.g. "NVIDIA H100 80GB HBM3 tp1 pp1 bfloat16")."""

    sidecar: str
    at: float
    hardware: str
    evidence: CostEvidence


def fleet_costs(exports: Iterable[CostExport], me: str, hardware: str, drafts: tuple[str, ...],
                knots: tuple[int, ...], now: float,
                max_age_seconds: float) -> tuple[CostEvidence | None, int]:
    """The other sidecars' step-cost evidence of this engine type (``hardware`` and the set of
    model ``drafts``, with the same ``knots``), summed in this sidecar's column order, from the
    sidecars that exported within ``max_age_seconds`` of ``now`` (step costs are the hardware's:
    not discounted by age); with how many sidecars it came from. (None, 0) when none matches."""
    total: CostEvidence | None = None
    count = 0
    for ex in exports:
        age = now - ex.at
        if ex.sidecar == me or age > max_age_seconds or ex.hardware != hardware:
            continue
        ev = ex.evidence.aligned(drafts, knots)
        if ev is None:
            continue
        total = ev if total is None else total.plus(ev)
        count += 1
    return total, count
