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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from controller.core.fleet import positions
from controller.core.tunable import tunable

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
        """Equal-tailed credible interval per position (``credible_bounds``)."""
        return credible_bounds(self.alpha, self.beta, level)


# --- Beta quantiles ------------------------------------------------------------------------------
# Both work in logit space, y = log(x / (1 - x)): there a Beta(a, b) variable has the density
# exp(a y - (a + b) log(1 + e^y)) / B(a, b), smooth and log-concave for every a, b > 0 (no
# singularity at the ends, as x's density has for a or b < 1), with cumulants
# kappa_n = psi^(n-1)(a) + (-1)^n psi^(n-1)(b).
# Smallest of (a, b) from which the Cornish-Fisher expansion is used: at 20, within 2e-5 of the
# exact quantile over a, b in [20, 1e5] (tests/test_core_acceptance.py sweeps them).
CORNISH_FISHER_MIN = 20.0
# Points of the logit-space grid below that: within 3e-5 of the exact quantile over a, b in
# [1e-2, 20) x [1e-2, 1e5] (fourth order: 16x finer per doubling; 64 points, 8e-6).
GRID_POINTS = 48
# Log-density drop, from the mode, at which the grid ends: the tails past it hold < e^-30.
_GRID_TAIL = 30.0
# Widest spacing scale at the mode, logit units: where a and b are both small the density
# bends at y = 0 over about one unit, which the grid must resolve.
_GRID_SCALE_MAX = 2.0
_GRID_ROWS = 1024  # rows integrated at once: 384 KiB an intermediate array (cache-sized)
_GRID_T = np.linspace(0.0, 1.0, GRID_POINTS)
_POLYGAMMA_SHIFT = 8.0  # the asymptotic series are used from here on (error < 1e-13)


def _polygammas(x: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """digamma and the polygammas of orders 1-3 at x > 0: the recurrence up to
    ``_POLYGAMMA_SHIFT``, then the asymptotic series."""
    p0, p1, p2, p3 = (np.zeros_like(x) for _ in range(4))
    z = x.copy()
    while (low := z < _POLYGAMMA_SHIFT).any():
        inv = np.where(low, 1.0 / z, 0.0)
        inv2 = inv * inv
        p0 -= inv
        p1 += inv2
        p2 -= 2.0 * inv2 * inv
        p3 += 6.0 * inv2 * inv2
        z = np.where(low, z + 1.0, z)
    r = 1.0 / z
    r2 = r * r
    p0 += np.log(z) - 0.5 * r - r2 * (1 / 12 - r2 * (1 / 120 - r2 * (1 / 252 - r2 * (
        1 / 240 - r2 / 132))))
    p1 += r + r2 * (0.5 + r * (1 / 6 - r2 * (1 / 30 - r2 * (1 / 42 - r2 / 30))))
    p2 -= r2 * (1.0 + r * (1.0 + r * (0.5 - r2 * (1 / 6 - r2 * (1 / 6 - r2 * 0.3)))))
    p3 += r2 * r * (2.0 + r * (3.0 + r * (2.0 - r2 * (1.0 - r2 * (4 / 3 - r2 * 3.0)))))
    return p0, p1, p2, p3


def _expit(y: FloatArray) -> FloatArray:
    """1 / (1 + e^-y) without overflow."""
    e = np.exp(-np.abs(y))
    return np.where(y >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


def _cornish_fisher(qs: tuple[float, ...], a: FloatArray, b: FloatArray) -> list[FloatArray]:
    """Logit-space Cornish-Fisher quantiles (skewness and kurtosis terms)."""
    psi_a, psi_b = _polygammas(a), _polygammas(b)
    k1, k2 = psi_a[0] - psi_b[0], psi_a[1] + psi_b[1]
    g1 = (psi_a[2] - psi_b[2]) / k2**1.5
    g2 = (psi_a[3] + psi_b[3]) / (k2 * k2)
    sd = np.sqrt(k2)
    out = []
    for q in qs:
        z = NormalDist().inv_cdf(q)
        w = (z + (z * z - 1.0) * g1 / 6.0 + (z**3 - 3.0 * z) * g2 / 24.0
             - (2.0 * z**3 - 5.0 * z) * g1 * g1 / 36.0)
        out.append(_expit(k1 + sd * w))
    return out


def _grid(qs: tuple[float, ...], a: FloatArray, b: FloatArray) -> list[FloatArray]:
    """Quantiles from the logit-space CDF integrated on ``GRID_POINTS`` points, spaced by
    y = mode + s sinh(u) with u uniform (dense at the mode, sparse in the exponential tails):
    the density in u and its derivative at every point, cells integrated by the corrected
    trapezoid rule and inverted on their cubic Hermite interpolant (both fourth order).
    Rows: ``a`` and ``b``."""
    a, b = a[:, None], b[:, None]
    # Mode, its scale (1 / sqrt of the curvature there, at most _GRID_SCALE_MAX) and the
    # log-density at it, g_max.
    mode = np.log(a) - np.log(b)
    scale = np.minimum(np.sqrt(1.0 / a + 1.0 / b), _GRID_SCALE_MAX)
    g_max = a * np.log(a) + b * np.log(b) - (a + b) * np.log(a + b)
    # The log-density less g_max is at most a y - g_max and at most -b y - g_max: below
    # -_GRID_TAIL left of (g_max - _GRID_TAIL) / a and right of (_GRID_TAIL - g_max) / b.
    u_lo = np.arcsinh(((g_max - _GRID_TAIL) / a - mode) / scale)
    u_hi = np.arcsinh(((_GRID_TAIL - g_max) / b - mode) / scale)
    h = (u_hi - u_lo) / (GRID_POINTS - 1)
    u = u_lo + (u_hi - u_lo) * _GRID_T
    sh = np.sinh(u)
    ch = np.sqrt(1.0 + sh * sh)
    y = mode + scale * sh
    e = np.exp(-np.abs(y))
    sigma = np.where(y >= 0.0, 1.0, e) / (1.0 + e)
    # Density in u, f(y(u)) dy/du, up to a constant, and its derivative.
    log_p = a * y - (a + b) * (np.maximum(y, 0.0) + np.log1p(e)) + 0.5 * np.log1p(sh * sh)
    p = np.exp(log_p - log_p.max(axis=1, keepdims=True))
    dp = p * ((a - (a + b) * sigma) * scale * ch + sh / ch)
    p0, p1, d0, d1 = p[:, :-1], p[:, 1:], dp[:, :-1] * h, dp[:, 1:] * h
    # Each cell's mass / h; the correction can only take mass away, so where a steep tail
    # makes it negative the cell (holding < e^-_GRID_TAIL) counts as empty.
    cells = np.maximum(0.5 * (p0 + p1) + (d0 - d1) / 12.0, 0.0)
    cdf = np.zeros_like(p)
    np.cumsum(cells, axis=1, out=cdf[:, 1:])
    rows = np.arange(p.shape[0])
    out = []
    for q in qs:
        target = q * cdf[:, -1]
        j = np.clip(np.sum(cdf < target[:, None], axis=1) - 1, 0, GRID_POINTS - 2)
        c0, c1 = p0[rows, j], p1[rows, j]
        g0, g1 = d0[rows, j], d1[rows, j]
        rest = np.clip(target - cdf[rows, j], 0.0, cells[rows, j])
        # The linear density's root as the start, then Newton on the Hermite CDF (in cells).
        slope = c1 - c0
        root = np.sqrt(np.maximum(c0 * c0 + 2.0 * slope * rest, 0.0))
        t = np.clip(2.0 * rest / np.maximum(c0 + root, 1e-300), 0.0, 1.0)
        for _ in range(2):
            t2, t3 = t * t, t * t * t
            cum = (c0 * (t3 * t / 2 - t3 + t) + g0 * (t3 * t / 4 - 2 * t3 / 3 + t2 / 2)
                   + c1 * (t3 - t3 * t / 2) + g1 * (t3 * t / 4 - t3 / 3))
            dens = (c0 * (2 * t3 - 3 * t2 + 1) + g0 * (t3 - 2 * t2 + t)
                    + c1 * (3 * t2 - 2 * t3) + g1 * (t3 - t2))
            t = np.clip(t - (cum - rest) / np.maximum(dens, 1e-300), 0.0, 1.0)
        out.append(_expit(mode[:, 0] + scale[:, 0] * np.sinh(u[rows, j] + t * h[:, 0])))
    return out


def beta_quantiles(qs: tuple[float, ...], a: npt.ArrayLike, b: npt.ArrayLike
                   ) -> list[FloatArray]:
    """The ``qs`` quantiles (each in (0, 1)) of Beta(a, b) per element of ``a``, ``b`` (> 0,
    one shape), within 3e-5 of the exact ones: Cornish-Fisher where both exceed
    ``CORNISH_FISHER_MIN``, the logit-space grid elsewhere. Pure numpy, vectorised; one entry
    per distinct (a, b), so a prior shared by many estimates costs one."""
    a_in, b_in = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    shape = np.broadcast_shapes(a_in.shape, b_in.shape)
    pairs = np.stack([np.broadcast_to(a_in, shape).ravel(), np.broadcast_to(b_in, shape).ravel()])
    if pairs.shape[1] == 0:
        return [np.zeros(shape) for _ in qs]
    unique, inverse = np.unique(pairs, axis=1, return_inverse=True)
    ua, ub = unique[0], unique[1]
    out = [np.empty(ua.size) for _ in qs]
    big = np.minimum(ua, ub) >= CORNISH_FISHER_MIN
    # Past any count a report can carry (a + b near the largest double) the expansions lose
    # their terms to overflow: there the posterior is a point, its mean (below).
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if big.any():
            for o, v in zip(out, _cornish_fisher(qs, ua[big], ub[big]), strict=True):
                o[big] = v
        small = np.flatnonzero(~big)
        for start in range(0, small.size, _GRID_ROWS):
            idx = small[start:start + _GRID_ROWS]
            for o, v in zip(out, _grid(qs, ua[idx], ub[idx]), strict=True):
                o[idx] = v
        point = 1.0 / (1.0 + ub / ua)
    return [np.clip(np.where(np.isfinite(o), o, point), 0.0, 1.0)[inverse.ravel()].reshape(shape)
            for o in out]


def beta_ppf(q: float, a: npt.ArrayLike, b: npt.ArrayLike) -> FloatArray:
    """The ``q`` quantile of Beta(a, b) per element (``beta_quantiles``)."""
    return beta_quantiles((q,), a, b)[0]


def credible_bounds(alpha: npt.ArrayLike, beta: npt.ArrayLike, level: float
                    ) -> tuple[FloatArray, FloatArray]:
    """Equal-tailed ``level`` credible interval of Beta(alpha, beta) per element, both ends from
    one pass. Widened to the mean where a posterior is so skewed that its mean lies outside
    (alpha or beta far below 1, so never under the default prior of 1, 1)."""
    a, b = np.asarray(alpha, dtype=np.float64), np.asarray(beta, dtype=np.float64)
    tail = (1.0 - level) / 2.0
    lower, upper = beta_quantiles((tail, 1.0 - tail), a, b)
    with np.errstate(over="ignore", under="ignore"):
        mean = a / (a + b)  # as Posterior.mean has it, to the last bit
    return np.minimum(lower, mean), np.maximum(upper, mean)



def credible_bounds_of(alphas: Sequence[Sequence[float]], betas: Sequence[Sequence[float]],
                       level: float) -> list[tuple[FloatArray, FloatArray]]:
    """``credible_bounds`` of many posteriors (each its own length) in one vectorised call: a
    read of every estimate costs one pass, not one per estimate."""
    sizes = [len(a) for a in alphas]
    if not sizes:
        return []
    if len(betas) != len(sizes) or any(len(b) != n for b, n in zip(betas, sizes, strict=True)):
        raise ValueError("alphas and betas differ in shape")
    flat_a = np.fromiter((x for a in alphas for x in a), np.float64, sum(sizes))
    flat_b = np.fromiter((x for b in betas for x in b), np.float64, sum(sizes))
    lower, upper = credible_bounds(flat_a, flat_b, level)
    cuts = np.cumsum(sizes)[:-1]
    return list(zip(np.split(lower, cuts), np.split(upper, cuts), strict=True))

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
        # The other sidecars' evidence (controller.core.fleet), as of ``_fleet_at``: added to
        # the posterior, never to the change detector (each sidecar detects its own changes).
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
        cfg = self.config
        tries, accepts = position_counts(steps_by_accepted)
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
