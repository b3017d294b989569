"""What sidecars of one model share: each one's acceptance evidence, and the fleet's sum of it.

Each sidecar publishes only its own evidence (its estimator's decayed accepts and rejects per
(class, draft, position)), stamped with the wall-clock time it was decayed to. A sidecar's view of
the fleet is the sum of the *other* sidecars' exports, each decayed from its stamp to now with the
same half-life as the sidecar's own evidence:

    fleet(k, now) = sum over sidecars s != me, age_s <= max_age of  e_s(k) * 2^(-(now - t_s) / h)

and its posterior for key k is prior + own(k, now) + fleet(k, now). Its own export is never read
back as someone else's (the sum skips its id), so nothing is counted twice; a sidecar that stops
publishing ages out after ``max_age`` (and its key expires in the store). Restart recovery is the
same record read back by its owner: its own evidence, decayed to the restart.

Pure: plain records and numpy, no clock (times are passed in) and no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

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
