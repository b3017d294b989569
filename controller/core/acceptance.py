"""Acceptance posteriors per (class, draft, position), with forgetting and change detection.

Sufficient statistic: per (class, draft, K) the histogram h[a] of verification steps by the number a
of accepted drafts. Position i (1-based) was tried in every step with a >= i-1 and accepted in every
step with a >= i. Positions after the first rejection were never tried; they are censored, not
rejected, so they add nothing to that position's evidence.

Each position's conditional acceptance rate has a Beta posterior: prior (alpha0, beta0) plus the
evidence, which decays by 2^(-dt / half_life) before new counts are added. A second,
fast-decaying copy of the evidence feeds the change detector: when the fast and slow means at
some position differ by more than ``change_z_threshold`` standard errors, the slow evidence
is replaced by the fast one, cut down to ``change_min_tries`` per position, and for
``RECOVERY_HALF_LIVES`` fast half-lives decays at the fast rate, so the remains of the old regime
wash out within seconds instead of over a half-life.

Each engine's share is bounded: the evidence is also kept per source (the engine that reported
it; ``DEPARTED`` holds what engines that left had counted, and what a restart restored). The
posterior's amount of evidence is the pooled one, its rate per position the weighted median of
the sources' rates (``robust_rates``), each source weighing its evidence capped at half of the
others' together (or of ``change_min_tries`` while they hold less): one source cannot outweigh
the rest, however much it counts, and a lone source's rate is its own. With two sources the
rate falls between theirs; with three or more, a single dissenting one moves it not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from specpilot.controller.core.beta import credible_bounds
from specpilot.controller.core.fleet import positions
from specpilot.controller.core.tunable import tunable

FloatArray = npt.NDArray[np.float64]
RECOVERY_HALF_LIVES = 4.0
# Width of the credible intervals every view reports, and decision records keep, per position.
CREDIBLE_LEVEL = 0.9


def position_counts(steps_by_accepted: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
    """(tries_i, accepts_i) for positions i = 1..K from the histogram h[0..K].

    tries_i = sum_{a >= i-1} h[a], accepts_i = sum_{a >= i} h[a].
    """
    h = np.asarray(steps_by_accepted, dtype=np.float64)
    at_least = np.cumsum(h[::-1])[::-1]  # at_least[a] = sum_{a' >= a} h[a']
    return at_least[:-1], at_least[1:]


# The source of evidence no connected engine counted (a departed engine's, a restored one).
DEPARTED = ""


def robust_rates(accepts: FloatArray, rejects: FloatArray, floor: float) -> FloatArray:
    """Per position (column), the weighted median of the sources' (rows') acceptance rates,
    each source weighing its tries capped at half of the other sources' (at least of ``floor``);
    at an exact tie, the mean of the two middle rates. NaN where no source tried."""
    n = accepts + rejects
    rest = n.sum(axis=0) - n
    weight = np.minimum(n, np.maximum(rest, floor) / 2.0)
    out = np.full(n.shape[1], np.nan)
    for i in range(n.shape[1]):
        tried = n[:, i] > 0
        if not tried.any():
            continue
        rates = accepts[tried, i] / n[tried, i]
        order = np.argsort(rates, kind="stable")
        rates, cum = rates[order], np.cumsum(weight[tried, i][order])
        half = cum[-1] / 2.0
        j = int(np.searchsorted(cum, half * (1 - 1e-12)))
        tie = j + 1 < rates.size and abs(cum[j] - half) <= 1e-9 * cum[-1]
        out[i] = (rates[j] + rates[j + 1]) / 2.0 if tie else rates[j]
    return out


def decay_factor(half_life: float, dt: float) -> float:
    """What evidence ``dt`` seconds old weighs with forgetting of ``half_life`` seconds."""
    return float(2.0 ** (-max(dt, 0.0) / half_life))


@dataclass
class _Evidence:
    """Decayed accepts and rejects per position, valid as of ``at``."""

    accepts: FloatArray
    rejects: FloatArray
    at: float

    @classmethod
    def empty(cls, positions: int, at: float) -> _Evidence:
        return cls(np.zeros(positions), np.zeros(positions), at)

    def decay_to(self, now: float, half_life: float) -> None:
        if now > self.at:
            f = decay_factor(half_life, now - self.at)
            self.accepts *= f
            self.rejects *= f
            self.at = now


@dataclass
class _BySource:
    """One key's slow evidence per source: row ``rows[source]`` of ``ev``'s (sources,
    positions) arrays, all decayed together."""

    rows: dict[str, int]
    ev: _Evidence

    @classmethod
    def empty(cls, positions: int, at: float) -> _BySource:
        return cls({}, _Evidence(np.zeros((0, positions)), np.zeros((0, positions)), at))

    def add(self, source: str, accepts: FloatArray, rejects: FloatArray, now: float,
            half_life: float) -> None:
        """Add to ``source``'s first ``len(accepts)`` positions, as of ``now``."""
        self.ev.decay_to(now, half_life)
        i = self.rows.get(source)
        if i is None:
            i = self.rows[source] = len(self.rows)
            row = np.zeros((1, self.ev.accepts.shape[1]))
            self.ev.accepts = np.vstack([self.ev.accepts, row])
            self.ev.rejects = np.vstack([self.ev.rejects, row])
        self.ev.accepts[i, :accepts.size] += accepts
        self.ev.rejects[i, :rejects.size] += rejects

    def pop(self, sources: set[str], now: float,
            half_life: float) -> tuple[FloatArray, FloatArray] | None:
        """Remove the rows of ``sources``; their summed (accepts, rejects) as of ``now``
        (None: none of them here)."""
        gone = [i for s, i in self.rows.items() if s in sources]
        if not gone:
            return None
        self.ev.decay_to(now, half_life)
        out = self.ev.accepts[gone].sum(axis=0), self.ev.rejects[gone].sum(axis=0)
        self.ev.accepts = np.delete(self.ev.accepts, gone, axis=0)
        self.ev.rejects = np.delete(self.ev.rejects, gone, axis=0)
        kept = sorted((i, s) for s, i in self.rows.items() if s not in sources)
        self.rows = {s: j for j, (_, s) in enumerate(kept)}
        return out


@dataclass(frozen=True)
class Posterior:
    """Beta(alpha_i, beta_i) per position 1..max_k, for one (class, draft) at one instant."""

    alpha: FloatArray
    beta: FloatArray
    prior_alpha: float
    prior_beta: float

    @property
    def mean(self) -> FloatArray:
        return self.alpha / (self.alpha + self.beta)

    @property
    def effective_tries(self) -> FloatArray:
        return self.alpha + self.beta - self.prior_alpha - self.prior_beta

    def sample(self, rng: np.random.Generator) -> FloatArray:
        """One Thompson draw of the per-position rates."""
        return rng.beta(self.alpha, self.beta)

    def credible_interval(self, level: float = 0.9) -> tuple[FloatArray, FloatArray]:
        """Equal-tailed credible interval per position (``specpilot.controller.core.beta``)."""
        return credible_bounds(self.alpha, self.beta, level)


@dataclass(frozen=True)
class EstimatorConfig:
    """Acceptance estimator: forgetting, the Beta prior and the change detector."""

    max_k: int
    """Positions tracked per posterior, tokens: the setting ``max_k`` of the policy."""
    half_life_seconds: float = tunable(300.0, gt=0)
    """Half-life of acceptance evidence, seconds."""
    prior_alpha: float = tunable(1.0, gt=0)
    """Beta prior pseudo-accepts per position."""
    prior_beta: float = tunable(1.0, gt=0)
    """Beta prior pseudo-rejects per position."""
    change_fast_half_life_seconds: float = tunable(20.0, gt=0)
    """Half-life of the change detector's fast estimate, seconds."""
    change_z_threshold: float = tunable(5.0, gt=0)
    """|z| between fast and slow acceptance that flags a change."""
    change_drift_z_threshold: float = tunable(3.0, gt=0, at_most="change_z_threshold")
    """|z| that flags a change when it lasts ``change_drift_seconds``: a slow drift, whose
    every step is too small for ``change_z_threshold``."""
    change_drift_seconds: float = tunable(30.0, gt=0)
    """How long |z| must stay above ``change_drift_z_threshold`` to flag a drift, seconds
    (longer than the fast estimate's noise lasts)."""
    change_min_tries: float = tunable(30.0, gt=0)
    """Effective tries the fast estimate needs before it can flag (the z test already weighs
    the sample size; this only keeps a handful of tries from flagging), and the evidence per
    position a flagged change keeps of the fast estimate. Low enough that a draft seen only
    through probes, a few tries a second, can still flag a recovery."""
    calibration_prior_tries: float = tunable(4.0, gt=0)
    """Weight of a confidence-calibration cell's prior (the class's acceptance at the cell's
    position), in tries: how many counted tokens of one confidence bucket move the cell halfway
    to what they show."""


class AcceptanceEstimator:
    """Posteriors for every (class, draft) seen. Time is passed in; nothing here reads a clock."""

    def __init__(self, config: EstimatorConfig) -> None:
        self.config = config
        self._slow: dict[tuple[str, str], _Evidence] = {}
        self._fast: dict[tuple[str, str], _Evidence] = {}
        self._changes: dict[tuple[str, str], int] = {}
        self._recover_until: dict[tuple[str, str], float] = {}
        # Since when |z| has stayed above the drift threshold, per key.
        self._drift_since: dict[tuple[str, str], float] = {}
        # The other sidecars' evidence (specpilot.controller.core.fleet), as of ``_fleet_at``: added
        # to the posterior, never to the change detector (each sidecar detects its own changes).
        self._fleet: dict[tuple[str, str], tuple[FloatArray, FloatArray]] = {}
        self._fleet_at = 0.0
        # The slow evidence per source, by key (only for observations naming their source).
        self._sources: dict[tuple[str, str], _BySource] = {}

    def keys(self) -> list[tuple[str, str]]:
        return sorted(set(self._slow) | set(self._fleet))

    def drafts(self) -> set[str]:
        """Drafts with evidence, own or the fleet's."""
        return {d for _, d in self._slow} | {d for _, d in self._fleet}

    def has_data(self, traffic_class: str, draft: str) -> bool:
        key = (traffic_class, draft)
        return key in self._slow or key in self._fleet

    def export(self, now: float) -> dict[tuple[str, str], tuple[FloatArray, FloatArray]]:
        """This estimator's own evidence per key, decayed to ``now``, at its sources' robust
        rates (what a sidecar publishes)."""
        return {key: self._own(key, ev, now) for key, ev in self._slow.items()}

    def _own(self, key: tuple[str, str], ev: _Evidence,
             now: float) -> tuple[FloatArray, FloatArray]:
        """(accepts, rejects) per position as of ``now``: the pooled amount at the rates of
        ``robust_rates`` where sources tried."""
        half_life = self._slow_half_life(key, now)
        f = decay_factor(half_life, now - ev.at)
        accepts, rejects = ev.accepts * f, ev.rejects * f
        by = self._sources.get(key)
        if by is not None and len(by.rows) > 1:
            by.ev.decay_to(now, half_life)
            rates = robust_rates(by.ev.accepts, by.ev.rejects, self.config.change_min_tries)
            use = ~np.isnan(rates)
            n = accepts + rejects
            accepts = np.where(use, np.nan_to_num(rates) * n, accepts)
            rejects = np.where(use, n - accepts, rejects)
        return accepts, rejects

    def sources(self, traffic_class: str, draft: str) -> tuple[str, ...]:
        """The sources of the key's evidence (engine ids, ``DEPARTED``), sorted."""
        by = self._sources.get((traffic_class, draft))
        return tuple(sorted(by.rows)) if by is not None else ()

    def all_sources(self) -> set[str]:
        return {s for by in self._sources.values() for s in by.rows}

    def forget_sources(self, sources: set[str], now: float) -> None:
        """``sources`` left: their evidence joins ``DEPARTED``'s (one voice for all that
        left)."""
        for key, by in self._sources.items():
            half_life = self._slow_half_life(key, now)
            gone = by.pop(sources, now, half_life)
            if gone is not None:
                by.add(DEPARTED, *gone, now, half_life)

    def restore(self, evidence: Mapping[tuple[str, str], tuple[FloatArray, FloatArray]],
                at: float, now: float) -> None:
        """Take ``evidence`` (as of ``at``) as this estimator's own, decayed to ``now``: a
        restart resuming from its last flush. Keys it already holds are kept (newer)."""
        f = decay_factor(self.config.half_life_seconds, now - at)
        for key, (accepts, rejects) in evidence.items():
            if key not in self._slow:
                self._slow[key] = _Evidence(positions(accepts, self.config.max_k) * f,
                                            positions(rejects, self.config.max_k) * f, now)
                self._sources[key] = by = _BySource.empty(self.config.max_k, now)
                by.add(DEPARTED, self._slow[key].accepts, self._slow[key].rejects, now,
                       self.config.half_life_seconds)

    def set_fleet(self, evidence: Mapping[tuple[str, str], tuple[FloatArray, FloatArray]],
                  now: float) -> None:
        """Replace the other sidecars' evidence with ``evidence`` (as of ``now``)."""
        k = self.config.max_k
        self._fleet = {key: (positions(a, k), positions(r, k))
                       for key, (a, r) in evidence.items()}
        self._fleet_at = now

    def changes_detected(self, traffic_class: str, draft: str) -> int:
        return self._changes.get((traffic_class, draft), 0)

    def observe(
        self, traffic_class: str, draft: str, steps_by_accepted: npt.ArrayLike, now: float,
        source: str | None = None,
    ) -> bool:
        """Add one histogram h[0..K] counted by ``source`` (an engine id; None: not kept
        per source); return True when this observation flagged a change.

        The caller validates (K <= max_k, non-negative counts) before calling.
        """
        tries, accepts = position_counts(steps_by_accepted)
        return self.observe_tries(traffic_class, draft, tries, accepts, now, source)

    def observe_tries(self, traffic_class: str, draft: str, tries: FloatArray,
                      accepts: FloatArray, now: float, source: str | None = None) -> bool:
        """Add ``tries`` and ``accepts`` of the first ``len(tries)`` positions (or cells: the
        confidence calibration keeps one per position and confidence bucket); return True when
        this observation flagged a change."""
        cfg = self.config
        k = tries.size
        key = (traffic_class, draft)
        slow = self._slow.setdefault(key, _Evidence.empty(cfg.max_k, now))
        fast = self._fast.setdefault(key, _Evidence.empty(cfg.max_k, now))
        slow_half_life = self._slow_half_life(key, now)
        if now - slow.at > cfg.change_drift_seconds:
            self._drift_since.pop(key, None)  # a quiet spell: the drift must hold anew
        if source is not None:
            self._sources.setdefault(key, _BySource.empty(cfg.max_k, now)).add(
                source, accepts, tries - accepts, now, slow_half_life)
        for ev, half_life in ((slow, slow_half_life), (fast, cfg.change_fast_half_life_seconds)):
            ev.decay_to(now, half_life)
            ev.accepts[:k] += accepts
            ev.rejects[:k] += tries - accepts
        if self._shifted(key, slow, fast, now):
            # The fast estimate still holds about a fast half-life of the old regime: keep it only
            # as ``change_min_tries`` of evidence per position, so the new regime's data outweighs
            # it within a report or two instead of a fast half-life.
            n_fast = fast.accepts + fast.rejects
            keep = np.minimum(1.0, cfg.change_min_tries / np.maximum(n_fast, 1e-12))
            # Each source keeps its rates at the evidence the slow estimate keeps.
            kept = (fast.accepts + fast.rejects) * keep / np.maximum(
                slow.accepts + slow.rejects, 1e-12)
            by = self._sources.get(key)
            if by is not None:
                by.ev.decay_to(now, slow_half_life)
                by.ev.accepts *= kept
                by.ev.rejects *= kept
            slow.accepts = fast.accepts * keep
            slow.rejects = fast.rejects * keep
            self._changes[key] = self._changes.get(key, 0) + 1
            self._recover_until[key] = now + RECOVERY_HALF_LIVES * cfg.change_fast_half_life_seconds
            return True
        return False

    def recovering(self, traffic_class: str, draft: str, now: float) -> bool:
        """True while the evidence of a detected change is still washing out the old regime."""
        return now < self._recover_until.get((traffic_class, draft), float("-inf"))

    def _slow_half_life(self, key: tuple[str, str], now: float) -> float:
        cfg = self.config
        if self.recovering(*key, now):
            return cfg.change_fast_half_life_seconds
        return cfg.half_life_seconds

    def _shifted(self, key: tuple[str, str], slow: _Evidence, fast: _Evidence,
                 now: float) -> bool:
        """Two-timescale test per position: |mean_fast - mean_slow| / se above
        ``change_z_threshold``, or above ``change_drift_z_threshold`` for
        ``change_drift_seconds`` on end (a slow drift)."""
        cfg = self.config
        z = self._z(slow, fast)
        if z > cfg.change_drift_z_threshold:
            since = self._drift_since.setdefault(key, now)
        else:
            self._drift_since.pop(key, None)
            return False
        if z > cfg.change_z_threshold or now - since >= cfg.change_drift_seconds:
            del self._drift_since[key]
            return True
        return False

    def _z(self, slow: _Evidence, fast: _Evidence) -> float:
        """The largest |mean_fast - mean_slow| / se over the positions both can test (0 when
        none can)."""
        cfg = self.config
        n_fast = fast.accepts + fast.rejects
        n_slow = slow.accepts + slow.rejects
        # The slow estimate must hold more (older) evidence than the fast one. Right after a reset
        # they are equal; as the fast one keeps moving the detector fires again, purging the old
        # regime from the slow evidence step by step.
        usable = (n_fast >= cfg.change_min_tries) & (n_slow > n_fast * 1.01)
        if not usable.any():
            return 0.0
        p_fast = fast.accepts[usable] / n_fast[usable]
        p_slow = slow.accepts[usable] / n_slow[usable]
        # Binomial standard error of the difference, floored so p near 0 or 1 cannot explode z.
        pooled = np.clip(p_slow, 0.02, 0.98)
        se = np.sqrt(pooled * (1.0 - pooled) * (1.0 / n_fast[usable] + 1.0 / n_slow[usable]))
        return float(np.max(np.abs(p_fast - p_slow) / se))

    def posterior(self, traffic_class: str, draft: str, now: float) -> Posterior:
        """Posterior as of ``now`` (the prior alone for an unseen key)."""
        cfg = self.config
        key = (traffic_class, draft)
        ev = self._slow.get(key)
        a0, b0 = cfg.prior_alpha, cfg.prior_beta
        alpha, beta = np.full(cfg.max_k, a0), np.full(cfg.max_k, b0)
        if ev is not None:
            accepts, rejects = self._own(key, ev, now)
            alpha, beta = alpha + accepts, beta + rejects
        fleet = self._fleet.get(key)
        if fleet is not None:
            f = decay_factor(cfg.half_life_seconds, now - self._fleet_at)
            alpha, beta = alpha + fleet[0] * f, beta + fleet[1] * f
        return Posterior(alpha, beta, a0, b0)

    def forget_class(self, traffic_class: str) -> None:
        self._forget(lambda key: key[0] == traffic_class)

    def forget_draft(self, draft: str) -> None:
        self._forget(lambda key: key[1] == draft)

    def _forget(self, matches: Callable[[tuple[str, str]], bool]) -> None:
        for store in (self._slow, self._fast, self._changes, self._recover_until,
                      self._drift_since, self._fleet, self._sources):
            for key in [k for k in store if matches(k)]:
                del store[key]
