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


def _decay(half_life: float, dt: float) -> float:
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
            f = _decay(half_life, now - self.at)
            self.accepts *= f
            self.rejects *= f
            self.at = now


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

    def keys(self) -> list[tuple[str, str]]:
        return sorted(set(self._slow) | set(self._fleet))

    def has_data(self, traffic_class: str, draft: str) -> bool:
        key = (traffic_class, draft)
        return key in self._slow or key in self._fleet

    def export(self, now: float) -> dict[tuple[str, str], tuple[FloatArray, FloatArray]]:
        """This estimator's own evidence per key, decayed to ``now`` (what a sidecar publishes)."""
        out = {}
        for key, ev in self._slow.items():
            f = _decay(self._slow_half_life(key, now), now - ev.at)
            out[key] = (ev.accepts * f, ev.rejects * f)
        return out

    def restore(self, evidence: Mapping[tuple[str, str], tuple[FloatArray, FloatArray]],
                at: float, now: float) -> None:
        """Take ``evidence`` (as of ``at``) as this estimator's own, decayed to ``now``: a
        restart resuming from its last flush. Keys it already holds are kept (newer)."""
        f = _decay(self.config.half_life_seconds, now - at)
        for key, (accepts, rejects) in evidence.items():
            if key not in self._slow:
                self._slow[key] = _Evidence(positions(accepts, self.config.max_k) * f,
                                            positions(rejects, self.config.max_k) * f, now)

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
        self, traffic_class: str, draft: str, steps_by_accepted: npt.ArrayLike, now: float
    ) -> bool:
        """Add one histogram h[0..K]; return True when this observation flagged a change.

        The caller validates (K <= max_k, non-negative counts) before calling.
        """
        tries, accepts = position_counts(steps_by_accepted)
        return self.observe_tries(traffic_class, draft, tries, accepts, now)

    def observe_tries(self, traffic_class: str, draft: str, tries: FloatArray,
                      accepts: FloatArray, now: float) -> bool:
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
            f = _decay(self._slow_half_life(key, now), now - ev.at)
            alpha, beta = alpha + ev.accepts * f, beta + ev.rejects * f
        fleet = self._fleet.get(key)
        if fleet is not None:
            f = _decay(cfg.half_life_seconds, now - self._fleet_at)
            alpha, beta = alpha + fleet[0] * f, beta + fleet[1] * f
        return Posterior(alpha, beta, a0, b0)

    def forget_class(self, traffic_class: str) -> None:
        self._forget(lambda key: key[0] == traffic_class)

    def forget_draft(self, draft: str) -> None:
        self._forget(lambda key: key[1] == draft)

    def _forget(self, matches: Callable[[tuple[str, str]], bool]) -> None:
        for store in (self._slow, self._fast, self._changes, self._recover_until,
                      self._drift_since, self._fleet):
            for key in [k for k in store if matches(k)]:
                del store[key]
