"""The ceiling of the real-engine benchmark: the decode throughput an engine would reach that
served every class, in every phase, with the static configuration best for it (pure).

Model, from what the static runs measured. In phase p every configuration s keeps about B
sequences in flight; a decode step costs ``tau[p][s]`` seconds per sequence in the batch
(measured: mean decode-step time / mean batch), and a sequence of class c gains ``E[p][c][s]``
tokens per verification step (measured in that phase: 1 + accepted / verification steps; 1
without speculation; per phase, because a configuration may speculate in one phase and not in
another, as vLLM's batch-size table does). Class c generates ``tokens[p][c]`` tokens in phase
p, so it needs ``tokens[p][c] / E[p][c][s]`` sequence-steps of ``tau[p][s]`` seconds each; the
phase's decode time is their sum over classes, and its throughput is tokens / time:

    throughput_p(a) = sum_c tokens[p][c] / sum_c tokens[p][c] * tau[p][a_c] / E[p][c][a_c]

The time separates by class, so the best assignment gives each class its own
``argmin_s tau[p][s] / E[p][c][s]``. Mixing configurations in one batch is priced as the
sequence-weighted mix of their step costs, which is optimistic where a model drafter runs for
the whole batch: the ceiling is an upper bound on the room there is. For a single static
configuration the same formula reproduces its measured decode throughput (``modeled``), which
checks the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial


@dataclass(frozen=True)
class PhaseCeiling:
    phase: str
    # class -> the static configuration that serves it best in this phase
    best: dict[str, str]
    tokens_per_second: float
    # configuration -> the model's decode throughput if it served everything (cf. measured)
    modeled: dict[str, float]


@dataclass(frozen=True)
class Ceiling:
    phases: tuple[PhaseCeiling, ...]
    # Over the whole run: tokens over the sum of every phase's time at its ceiling.
    tokens_per_second: float


def phase_ceiling(phase: str, tokens: Mapping[str, float], tau: Mapping[str, float],
                  expected: Mapping[str, Mapping[str, float]]) -> PhaseCeiling:
    """``tokens``: class -> tokens generated in the phase; ``tau``: configuration -> decode
    seconds per sequence-step in the phase; ``expected``: class -> configuration -> tokens per
    verification step. Configurations with a non-finite ``tau`` are left out."""
    total = sum(tokens.values())
    configs = [s for s, t in tau.items() if math.isfinite(t) and t > 0] if total > 0 else []

    def cost(c: str, s: str) -> float:
        e = expected.get(c, {}).get(s, 1.0)
        return tau[s] / (e if math.isfinite(e) and e > 0 else 1.0)

    best: dict[str, str] = {}
    for c in tokens:
        if configs:
            best[c] = min(configs, key=partial(cost, c))
    ceiling_time = sum(n * cost(c, best[c]) for c, n in tokens.items() if c in best)
    modeled = {s: total / sum(n * cost(c, s) for c, n in tokens.items()) for s in configs}
    # (no tokens or no measured configuration: no ceiling for the phase)
    return PhaseCeiling(phase, best, total / ceiling_time if ceiling_time > 0 else math.nan,
                        modeled)


def ceiling(phases: Sequence[str], tokens: Sequence[Mapping[str, float]],
            tau: Sequence[Mapping[str, float]],
            expected: Sequence[Mapping[str, Mapping[str, float]]]) -> Ceiling:
    """Every phase's ceiling and the whole run's (time-additive over phases); every argument has
    one entry per phase."""
    per_phase = tuple(phase_ceiling(name, t, s, e)
                      for name, t, s, e in zip(phases, tokens, tau, expected, strict=True))
    measured = [(sum(t.values()), p.tokens_per_second) for t, p in zip(tokens, per_phase,
                                                                          strict=True)
                if math.isfinite(p.tokens_per_second) and p.tokens_per_second > 0]
    total = sum(n for n, _ in measured)
    seconds = sum(n / rate for n, rate in measured)
    return Ceiling(per_phase, total / seconds if seconds > 0 else math.nan)
