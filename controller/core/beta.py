"""Quantiles and credible intervals of Beta distributions: pure numpy, vectorised.

Both methods work in logit space, y = log(x / (1 - x)): there a Beta(a, b) variable has the density
exp(a y - (a + b) log(1 + e^y)) / B(a, b), smooth and log-concave for every a, b > 0 (no
singularity at the ends, as x's density has for a or b < 1), with cumulants
kappa_n = psi^(n-1)(a) + (-1)^n psi^(n-1)(b).
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
# Smallest of (a, b) from which the Cornish-Fisher expansion is used: at 20, within 2e-5 of the
# exact quantile over a, b in [20, 1e5] (tests/test_core_beta.py sweeps them).
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
