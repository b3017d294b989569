"""Whether the posteriors can tell two arms apart: the spread of an arm's expected tokens and of
its step time, and the chance that one arm's goodput is above another's.

Why: a decision is taken on a Thompson draw and shown by posterior means. After a few requests
both posteriors are wide (the acceptance of a class, the price of a shape no step was timed at),
and a ratio of means, "K=1 expects 1.30x the goodput of K=2", then reads as a finding although
the opposite order is nearly as likely. Figures rank two arms only where the posterior says
which is ahead with at least ``PolicyConfig.rank_probability`` (the one threshold); otherwise
they say "too little evidence".

The chance is a normal approximation of the difference of the two goodputs (``rank_z``), with
the exact first two moments of E(K) under the per-position Beta posteriors (the same positions
enter both arms of a draft, so K=1 and K=2 share their first position's uncertainty) and the
step-cost model's posterior covariance of the step times. Pure (numpy).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def tokens_covariance(alpha: npt.ArrayLike, beta: npt.ArrayLike, k_max: int) -> FloatArray:
    """The posterior covariance of E(K) for K = 0..``k_max`` ((k_max+1) x (k_max+1)), with
    independent Beta(alpha_i, beta_i) conditional acceptance at positions 1..k_max.

    E(K) = 1 + sum_{k<=K} P_k with P_k = b_1 ... b_k, and for j <= k
    E[P_j P_k] = prod_{i<=j} E[b_i^2] prod_{j<i<=k} E[b_i]."""
    a = np.asarray(alpha, dtype=np.float64)[:k_max]
    b = np.asarray(beta, dtype=np.float64)[:k_max]
    n = a + b
    m1 = a / n
    m2 = a * (a + 1.0) / (n * (n + 1.0))
    # E[P_j P_k] for j <= k: prod of second moments up to j, then of means from j+1 to k.
    k = a.size
    second = np.cumprod(m2)
    first = np.cumprod(m1)
    cross = np.zeros((k, k))
    for j in range(k):
        tail = np.cumprod(m1[j + 1:])
        cross[j, j] = second[j]
        cross[j, j + 1:] = second[j] * tail
        cross[j + 1:, j] = cross[j, j + 1:]
    products = cross - np.outer(first, first)  # Cov(P_j, P_k), j, k = 1..k_max
    cov = np.zeros((k_max + 1, k_max + 1))
    # E(K) sums P_1..P_K: its covariances are the cumulative sums of the products' over both.
    cov[1:k + 1, 1:k + 1] = np.cumsum(np.cumsum(products, axis=0), axis=1)
    return cov


def rank_threshold(probability: float) -> float:
    """The z-score a difference must reach for its sign to hold with ``probability``."""
    return float(NormalDist().inv_cdf(probability))


def rank_z(tokens: tuple[float, float], seconds: tuple[float, float],
           tokens_cov: tuple[float, float, float], seconds_cov: tuple[float, float, float],
           sequences: float, others_tokens: float) -> float:
    """The posterior z-score of goodput(a) - goodput(b), two arms of one class at one batch
    size: the difference over its standard deviation (+inf where the posterior has no spread).

    A class's goodput in a batch is its rate without speculation plus what its arm adds to the
    batch's, so the difference of two arms' is that of the batch's tokens per second,
    (n E_a + o) / t_a - (n E_b + o) / t_b, with n the class's sequences in the batch, o the
    other sequences' tokens per step (0 where the batch is all the class), E the arms' expected
    tokens per step and t their step seconds. ``tokens_cov`` and ``seconds_cov``:
    (Var a, Var b, Cov a b) of E and of t, independent of each other (acceptance and step
    costs are learnt apart); first order in both."""
    (e_a, e_b), (t_a, t_b) = tokens, seconds
    rate_a = (sequences * e_a + others_tokens) / t_a
    rate_b = (sequences * e_b + others_tokens) / t_b
    # d diff / d E_a, d E_b, d t_a, d t_b
    ge_a, ge_b = sequences / t_a, -sequences / t_b
    gt_a, gt_b = -rate_a / t_a, rate_b / t_b
    var = (ge_a**2 * tokens_cov[0] + ge_b**2 * tokens_cov[1] + 2 * ge_a * ge_b * tokens_cov[2]
           + gt_a**2 * seconds_cov[0] + gt_b**2 * seconds_cov[1]
           + 2 * gt_a * gt_b * seconds_cov[2])
    diff = rate_a - rate_b
    if not (math.isfinite(var) and math.isfinite(diff)):
        return 0.0
    if var <= 0.0:
        return math.copysign(math.inf, diff) if diff else 0.0
    return diff / math.sqrt(var)
