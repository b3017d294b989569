"""Fit a scenario's per-token confidence (``ConfidenceSpec``: concentration, bias, noise) to what a
real drafter did: per confidence bucket, how many of its tokens fell there and how many of those
the target accepted, as ``benchmarks/reliability.py`` measures them on a real vLLM engine.

    python -m benchmarks.sim.fit_confidence benchmarks/results/reliability.json

The simulator draws each token's acceptance probability p ~ Beta(r c, (1 - r) c) around the
position's rate r and the draft's confidence logit(q) = logit(p) + bias + noise x N(0, 1)
(``benchmarks.sim.confidence.ConfidenceModel``, used here as it is). The fit searches a grid of
(c, bias, noise) for the draws whose bucket shares and per-bucket acceptance come closest to the
measured ones (squared differences, each bucket's acceptance weighted by its measured share: a
bucket holding a handful of tokens says little), at r = the measured mean acceptance. Prints
each temperature's fit, its table beside the measurement, and the scenario line to paste.
Deterministic (fixed seed). Pure apart from ``main``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.sim.confidence import ConfidenceModel
from benchmarks.sim.scenario import ConfidenceSpec
from benchmarks.sim.step import FloatArray
from specpilot.contract.confidence import CONFIDENCE_EDGES, N_CONFIDENCE_BUCKETS, confidence_buckets

CONCENTRATIONS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 16.0)
BIASES = tuple(float(b) for b in np.linspace(-3.0, 3.0, 25))
NOISES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
DRAWS = 20_000
SEED = 7


@dataclass(frozen=True)
class BucketFigures:
    """Per confidence bucket: the share of the tokens in it and their acceptance (NaN where
    none fell in it)."""

    share: FloatArray
    accept: FloatArray

    @classmethod
    def measured(cls, tokens: Sequence[float], observed: Sequence[float | None]
                 ) -> BucketFigures:
        """From a reliability run's per-bucket ``tokens`` and ``observed`` acceptance.
        ValueError without tokens."""
        n = np.asarray(tokens, dtype=np.float64)
        if n.size != N_CONFIDENCE_BUCKETS or not np.isfinite(n).all() or (n < 0).any():
            raise ValueError(f"tokens: {N_CONFIDENCE_BUCKETS} counts >= 0 expected, got "
                             f"{list(tokens)}")
        if n.sum() <= 0:
            raise ValueError("no tokens were counted: nothing to fit")
        accept = np.array([np.nan if o is None else float(o) for o in observed])
        return cls(n / n.sum(), np.where(n > 0, accept, np.nan))

    @property
    def mean_accept(self) -> float:
        seen = np.isfinite(self.accept)
        return float(np.sum(self.share[seen] * self.accept[seen]) / np.sum(self.share[seen]))


def simulated(spec: ConfidenceSpec, rate: float, draws: int = DRAWS, seed: int = SEED
              ) -> BucketFigures:
    """The bucket figures of ``draws`` tokens at acceptance rate ``rate`` under ``spec``, their
    acceptance the expected one (each token's p)."""
    gen = np.random.default_rng(seed)
    slots = ConfidenceModel([spec]).draw(gen, 0, np.zeros(draws, dtype=np.int64),
                                         np.full((draws, 1), rate))
    bucket = confidence_buckets(slots.confidence[:, 0])
    counts = np.bincount(bucket, minlength=N_CONFIDENCE_BUCKETS).astype(np.float64)
    accepted = np.bincount(bucket, weights=slots.acceptance[:, 0],
                           minlength=N_CONFIDENCE_BUCKETS)
    accept = np.divide(accepted, counts, out=np.full_like(counts, np.nan), where=counts > 0)
    return BucketFigures(counts / counts.sum(), accept)


def distance(model: BucketFigures, measured: BucketFigures) -> float:
    """Squared differences of the shares, plus of the acceptances weighted by the measured
    share (a bucket the model leaves empty counts its measured acceptance in full)."""
    seen = np.isfinite(measured.accept)
    gap = np.where(np.isfinite(model.accept), model.accept, 0.0) - measured.accept
    return float(np.sum((model.share - measured.share) ** 2)
                 + np.sum(measured.share[seen] * gap[seen] ** 2))


def fit(measured: BucketFigures, rate: float | None = None, draws: int = DRAWS
        ) -> tuple[ConfidenceSpec, float]:
    """The grid's spec closest to ``measured`` (at ``rate``, default its mean acceptance; each
    spec judged on ``draws`` tokens), and its distance."""
    r = measured.mean_accept if rate is None else rate
    best: tuple[float, ConfidenceSpec] | None = None
    for c, b, s in itertools.product(CONCENTRATIONS, BIASES, NOISES):
        spec = ConfidenceSpec(concentration=c, bias=b, noise=s)
        d = distance(simulated(spec, r, draws), measured)
        if best is None or d < best[0]:
            best = (d, spec)
    assert best is not None
    return best[1], best[0]


def table(model: BucketFigures, measured: BucketFigures) -> str:
    lines = ["| confidence | share, real | share, fit | P(accept), real | P(accept), fit |",
             "|---|---|---|---|---|"]
    for b in range(N_CONFIDENCE_BUCKETS):
        lines.append(f"| [{CONFIDENCE_EDGES[b]:g}, {CONFIDENCE_EDGES[b + 1]:g}) | "
                     f"{measured.share[b]:.3f} | {model.share[b]:.3f} | "
                     f"{measured.accept[b]:.3f} | {model.accept[b]:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reliability", type=Path, help="reliability.json of benchmarks/reliability.py")
    args = ap.parse_args(argv)
    try:
        results = json.loads(args.reliability.read_text())
        runs = results["temperatures"]
    except (OSError, ValueError, KeyError) as exc:
        ap.error(f"{args.reliability}: not a reliability.json ({exc}); write one with "
                 "`.venv/bin/python benchmarks/reliability.py`")
    for temperature, run in runs.items():
        measured = BucketFigures.measured(run["tokens"], run["observed"])
        print(f"==> T={temperature}: fitting {len(CONCENTRATIONS) * len(BIASES) * len(NOISES)} "
              f"specs at acceptance {measured.mean_accept:.3f}", flush=True)
        spec, d = fit(measured)
        print(table(simulated(spec, measured.mean_accept), measured))
        print(f"distance {d:.4f}; scenario: confidence: {{concentration: {spec.concentration:g}, "
              f"bias: {spec.bias:g}, noise: {spec.noise:g}}}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
