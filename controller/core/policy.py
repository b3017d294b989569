"""The decision rule: a pure function of a context object (no clock, no RNG state, no I/O).

For one class and one batch bucket, every arm (draft, K in 1..max) and "off" is scored by goodput,
accepted tokens per second = E(K) x batch / step seconds, with E(K) from ONE Thompson draw of the
class's per-position acceptance rates per draft (per-arm statistics: each (class, draft) has its own
posteriors, so exploration fades as they tighten) and the step seconds from ONE draw of the
step-cost model's weights per decide round (so an arm priced by extrapolation is sometimes priced
cheap enough to be tried; the spread fades where steps were observed). Posterior means give the
expected speedup, the "losing by means" test and explanations. On top of the argmax:
  - a speculative arm must beat no speculation by ``min_speedup``: gains inside the cost
    model's error are not worth drafting for;
  - hysteresis: a new arm must beat the current one's sampled goodput by ``hysteresis_ratio``,
    except while a detected acceptance change is being absorbed (the old margin is stale) and
    when switching off speculation that loses by posterior means;
  - dwell: a choice younger than ``dwell_seconds`` stays, unless a change was just detected;
  - probing: while no model draft runs (off, or deterministic drafts), a share of requests (in
    batch-wide engines: of steps, all of the class's requests in each) runs it at a low K, sized
    by what a probe costs against the arm in force and the chance that the model draft beats
    that arm (from the position-1 posterior): up to ``probe_cost_max`` of the class's throughput
    while it may well win, ``probe_cost_floor`` where the posterior says it cannot, which still
    notices a recovery (``probe_plan``);
  - overrides: operator pins win over everything; offline classes are pinned off (or scored at
    the largest bucket in "goodput" mode).

A bucket is decided in two small stages, ``choose`` (the arm) then ``with_probe`` (the probe);
between them the class's buckets being decided are kept within their neighbours of more evidence
(``follow_neighbours``: the best K falls as the batch grows). Neither prices anything: the
context carries the step seconds they read, computed before each stage by the decider
(``specpilot.controller.core.prices``; ``unpriced_decision``, ``needs_neighbours`` and
``probe_curves`` say what a stage will read). Every figure shown of an arm (a decision's
expected speedup, the decision log's, an explanation's) comes from ``shown_arms``: bounded by
what a step can deliver, and flagged where the posteriors cannot rank the arms compared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

import numpy as np
import numpy.typing as npt

from specpilot.contract.records import (
    OFFLINE_PIN,
    ArmFigures,
    Decision,
    DecisionFigures,
    DraftKind,
    DraftSpec,
    Override,
    Reason,
    arm_key,
)
from specpilot.controller.core.acceptance import CREDIBLE_LEVEL
from specpilot.controller.core.beta import credible_bounds
from specpilot.controller.core.goodput import expected_tokens_curve, goodput, speedup
from specpilot.controller.core.mix import BatchOthers, arm_keys
from specpilot.controller.core.prices import StepPrices, verified_curve
from specpilot.controller.core.ranking import rank_threshold, rank_z, tokens_covariance
from specpilot.controller.core.tunable import tunable

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class PolicyConfig:
    """Policy: the decision rule's margins, dwell and probing."""

    max_k: int = tunable(8, ge=1, le=32)
    """Largest K the controller considers, tokens."""
    warmup_k: int = tunable(2, ge=0, at_most="max_k")
    """K used for a class before any data, tokens."""
    dwell_seconds: float = tunable(5.0, ge=0)
    """Minimum time a (class, bucket) choice stays, seconds."""
    joint_interval_seconds: float = tunable(5.0, gt=0)
    """Age after which a bucket's joint (whole-batch) arm search is rerun, seconds (two buckets
    per decide round; all after a detected change)."""
    hysteresis_ratio: float = tunable(0.03, ge=0)
    """Relative sampled-goodput gain a new arm needs to replace the current one (0.03 = 3%)."""
    min_speedup: float = tunable(1.02, ge=1.0)
    """Smallest expected speedup over no speculation (ratio) that justifies drafting; smaller
    gains are inside the cost model's error."""
    explore_max_step: int = tunable(2, ge=1)
    """Largest change of K an exploring move may make from the K in force, tokens: a Thompson
    draw may favour an arm priced by extrapolation (a long K at a large batch, never tried);
    exploring step by step learns the same costs without a dwell time at the far end. Moves
    that the posterior means favour are not limited."""
    explore_max_loss: float = tunable(0.2, ge=0, le=1)
    """Largest loss of mean goodput, against the arm the means favour, an exploring move may
    risk (0.2 = 20%): a draw can price an arm the means call ruinous as the best one."""
    probe_cost_max: float = tunable(0.02, ge=0, le=1)
    """Share of a class's throughput probing the model draft may cost while the class runs none
    and the posterior gives it every chance to beat the arm in force (0.02 = 2%); scaled by that
    chance."""
    probe_cost_floor: float = tunable(0.002, ge=0, le=1, at_most="probe_cost_max")
    """Share of a class's throughput probing costs however unlikely a recovery (0.002 = 0.2%):
    what keeps a recovery of the model draft's acceptance noticed. Whole-step probes (batch-wide
    engines) learn as many tries per probed step as the class has requests in it: at 0.2% the
    simulator's recovery (0.06 -> 0.7 at batch 8) is flagged within seconds."""
    probe_k: int = tunable(2, ge=1, at_most="max_k")
    """K of probed requests where the drafter runs anyway (per-request engines), tokens;
    batch-wide engines probe at K=1, the cheapest (every probe there costs the whole batch's
    drafter passes)."""
    rank_probability: float = tunable(0.8, gt=0.5, le=0.999)
    """Smallest posterior probability (0.8 = 80%) with which one arm's goodput must be above
    another's for the figures shown to rank them: a ratio of two arms' goodputs in the
    decision log, an arm's expected speedup over no speculation in the policy, the decision
    log and the explanations. Where neither order is that likely (a class after a few
    requests, a shape no step was timed at), or an arm's price was bounded by the step costs
    measured, they say "too little evidence" instead (``specpilot.controller.core.ranking``).
    Decisions do not read it."""
    composition_margin: float = tunable(0.01, ge=0, le=1)
    """Relative gain in a step's tokens per second an engine's per-step re-pick of the settled
    classes' arms (for the classes and counts in that step) needs over the decisions
    (0.01 = 1%; ``specpilot.contract.pricing``). Engines that cannot re-pick apply the
    decisions."""
    offline_mode: Literal["pin_off", "goodput"] = tunable("pin_off")
    """pin_off: offline classes never speculate. goodput: decided by the same goodput math at the
    largest batch bucket (offline work runs at full load)."""
    token_cut: bool = tunable(True)
    """Engines cut each request's drafts at the first token whose chance of surviving
    verification, by the draft's confidence calibrated per class, does not pay for verifying it
    at the step's batch size, and stop their model drafter after the pass where no request's
    tokens pay for another (only shortening what the class's decision allows, never for tokens
    as likely as the class's; only for drafts whose confidences engines count). Off: every
    request verifies the K its class's decision sets."""


@dataclass(frozen=True)
class BucketState:
    """What is in force for one batch bucket of the class."""

    bucket: int
    batch_size: int
    current: Decision | None
    changed_at: float | None
    # New evidence since ``current`` was decided (acceptance for the class, steps in the
    # bucket). Without it the decision holds: a fresh Thompson draw is no reason to change.
    fresh: bool = True


@dataclass(frozen=True)
class ClassContext:
    """Everything the policy decides one class on, flat and priced in advance."""

    traffic_class: str
    now: float
    drafts: tuple[DraftSpec, ...]
    # Per draft: one Thompson sample and the posterior mean of the per-position rates.
    sampled_rates: Mapping[str, FloatArray]
    mean_rates: Mapping[str, FloatArray]
    # A change was detected since the last decision / its evidence is still being absorbed.
    change_detected: bool
    recovering: bool
    offline: bool
    override: Override | None
    buckets: tuple[BucketState, ...]
    # Step seconds by the cost model's mean weights, where the policy prices a step: the
    # buckets whose decision ``choose`` prices, and what ``with_probe`` reads.
    prices: StepPrices
    # The same by the decide round's draw of the weights, where a fresh bucket scores its
    # Thompson draw (None: the means).
    drawn_prices: StepPrices | None = None
    # The expected rest of the batch per batch size, when the traffic mix is known; batch sizes
    # not in it are scored as if the whole batch were this class.
    others: Mapping[int, BatchOthers] = field(default_factory=dict)
    # Per draft: the position-1 posterior's Beta(alpha, beta) (probing's chance of paying).
    position1: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # The engine's model drafter runs whatever K is chosen (per-request engines): a probe then
    # costs only its verified tokens, not the whole batch's drafter passes.
    drafter_sunk: bool = False
    # The drafts with acceptance evidence for the class (the others' rates are the prior).
    evidence: frozenset[str] = frozenset()
    # Per draft: the Beta(alpha, beta) of its per-position acceptance (what the figures shown
    # say of their spread, ``shown_arms``); a draft missing here counts as known exactly.
    posteriors: Mapping[str, tuple[FloatArray, FloatArray]] = field(default_factory=dict)
    # The largest ratio of a speculative step's time to a plain one's the cost model measured
    # (``StepCostModel.measured_ratio_range``); a figure shown prices no arm beyond it. None:
    # none measured yet.
    ratio_cap: float | None = None
    # Per deterministic draft whose proposals the engines counted: the drafts a step verifies
    # at K = 0..max K asked (absent: K). An arm is priced at what it verifies.
    verified_drafts: Mapping[str, FloatArray] = field(default_factory=dict)

    @property
    def has_data(self) -> bool:
        """Whether any draft has acceptance evidence for the class."""
        return bool(self.evidence)

    @cached_property
    def sampled_curves(self) -> dict[str, FloatArray]:
        """E(K) for K = 0..len(rates) per draft, from the Thompson sample."""
        return {name: expected_tokens_curve(r) for name, r in self.sampled_rates.items()}

    @cached_property
    def mean_curves(self) -> dict[str, FloatArray]:
        return {name: expected_tokens_curve(r) for name, r in self.mean_rates.items()}


@dataclass(frozen=True)
class ArmValue:
    draft: str
    k: int
    expected_tokens: float
    step_seconds: float
    goodput: float
    speedup: float
    # The posteriors cannot tell whether the arm gains over no speculation, or its price was
    # bounded by the step costs measured (``ShownArms``): its speedup ranks nothing.
    too_little_evidence: bool = False

    @property
    def arm(self) -> tuple[str, int]:
        return arm_key(self.draft, self.k)


@dataclass(frozen=True)
class ArmTable:
    """Every arm of a class at one batch size: row 0 is "off", then each draft's K = 1..max.
    Arrays, not objects: the policy scores a few hundred tables per decide round."""

    keys: list[tuple[str, int]]
    expected_tokens: FloatArray
    step_seconds: FloatArray
    goodput: FloatArray
    speedup: FloatArray

    def __post_init__(self) -> None:
        # A number that is not finite (a broken cost or rate) never wins and never leaves the
        # core: such an arm scores -inf (argmax then falls to the finite ones, or to off), its
        # speedup reads 0, and off's is 1 by definition.
        if not (np.isfinite(self.goodput).all() and np.isfinite(self.speedup).all()):
            speedup = np.where(np.isfinite(self.speedup), self.speedup, 0.0)
            speedup[0] = 1.0 if not np.isfinite(self.speedup[0]) else speedup[0]
            object.__setattr__(self, "goodput",
                               np.where(np.isfinite(self.goodput), self.goodput, -np.inf))
            object.__setattr__(self, "speedup", speedup)

    def scores(self, min_speedup: float = 1.0) -> FloatArray:
        """Goodput with speculative arms discounted by ``min_speedup``: drafting must beat no
        speculation by that ratio to win, in the argmax and in hysteresis comparisons alike."""
        discount = np.where([k > 0 for _, k in self.keys], min_speedup, 1.0)
        return np.asarray(self.goodput / discount, dtype=np.float64)

    def best(self, min_speedup: float = 1.0) -> int:
        """Row of the best arm by ``scores``; argmax takes the first maximum, so ties go to off,
        then to the smaller K."""
        return int(np.argmax(self.scores(min_speedup)))

    def index(self, arm: tuple[str, int]) -> int | None:
        return self.keys.index(arm) if arm in self.keys else None

    def values(self) -> list[ArmValue]:
        return [
            ArmValue(d, k, float(e), float(t), float(g), float(x))
            for (d, k), e, t, g, x in zip(self.keys, self.expected_tokens, self.step_seconds,
                                          self.goodput, self.speedup, strict=True)
        ]


def arm_table(ctx: ClassContext, batch_size: int, curves: Mapping[str, FloatArray],
              max_k: int, drawn_costs: bool = False) -> ArmTable:
    """Score "off" and every (draft, K) at ``batch_size`` from E(K) curves (one per draft), step
    seconds by the cost model's means, or by the decide round's draw with ``drawn_costs``."""
    prices = ctx.prices
    if drawn_costs and ctx.drawn_prices is not None:
        prices = ctx.drawn_prices
    others = ctx.others.get(batch_size)
    keys = arm_keys(ctx.drafts, max_k)
    expected: list[FloatArray] = [np.ones(1)]
    for spec in ctx.drafts:
        expected.append(np.asarray(curves[spec.name][1 : min(max_k, spec.max_k) + 1],
                                   dtype=np.float64))
    e = np.concatenate(expected)
    if others is not None:
        t = prices.mixed_arms(batch_size, ctx.drafts)
    else:
        t = np.concatenate([prices.off(batch_size)] + [
            verified_curve(prices.curve(batch_size, spec.name, min(max_k, spec.max_k)),
                           ctx.verified_drafts.get(spec.name), spec)[1:]
            for spec in ctx.drafts])
    return _scored(keys, e, t, batch_size, others)


def _scored(keys: list[tuple[str, int]], e: FloatArray, t: FloatArray, batch_size: int,
            others: BatchOthers | None) -> ArmTable:
    """The table of arms ``keys`` (off first) of expected tokens ``e`` in steps of ``t``
    seconds. Where ``others`` holds the rest of the batch, arms are scored by the whole batch's
    goodput, the other classes held at their arms.

    The goodput column is then attributed to this class: its own rate with speculation off
    plus what the arm adds to (or takes from) the batch, so that ``min_speedup`` and
    hysteresis keep their per-class meaning; with no other classes it equals the homogeneous
    table."""
    if others is None:
        return ArmTable(keys, e, t, goodput(e, batch_size, t), speedup(e, t, t[0]))
    batch_rate = (others.self_count * e + others.tokens) / t
    own_off = others.self_count / t[0]
    attributed = own_off + batch_rate - batch_rate[0]
    # An arm that takes more from the batch than the class's own rate scores below zero (the
    # ranking keeps that), but a speedup is a ratio of rates: it reads 0, never negative.
    return ArmTable(keys, e, t, attributed, np.maximum(attributed / own_off, 0.0))


def arm_values(ctx: ClassContext, cfg: PolicyConfig, batch_size: int) -> list[ArmValue]:
    """Every arm scored by posterior means as figures show it (``shown_arms``), each flagged
    where its speedup ranks nothing (for explanations and tests)."""
    shown = shown_arms(ctx, cfg, batch_size)
    return [replace(v, too_little_evidence=not shown.ranked(i, 0))
            for i, v in enumerate(shown.table.values())]


@dataclass(frozen=True)
class ShownArms:
    """A class's arms at one batch size as figures show them (``shown_arms``): the table by
    posterior means, each arm's step time bounded by the ratios measured (``bounded`` where the
    bound took), and what says whether the posteriors rank two arms (``ranked``)."""

    table: ArmTable
    bounded: npt.NDArray[np.bool_]
    tokens_cov: FloatArray  # posterior covariance of the arms' expected tokens per step
    seconds_spread: FloatArray  # relative posterior covariance of their step seconds
    sequences: float  # the class's sequences in the batch
    others_tokens: float  # the other sequences' tokens per step
    threshold: float  # the z-score a ranking needs (``ranking.rank_threshold``)

    def ranked(self, i: int, j: int) -> bool:
        """Whether the posteriors rank arm ``i``'s goodput against arm ``j``'s with the
        configured probability (either way), and neither price was bounded."""
        if i == j:
            return True
        if self.bounded[i] or self.bounded[j]:
            return False
        t, c, v = self.table.step_seconds, self.tokens_cov, self.seconds_spread
        z = rank_z((float(self.table.expected_tokens[i]), float(self.table.expected_tokens[j])),
                   (float(t[i]), float(t[j])),
                   (float(c[i, i]), float(c[j, j]), float(c[i, j])),
                   (float(v[i, i] * t[i] ** 2), float(v[j, j] * t[j] ** 2),
                    float(v[i, j] * t[i] * t[j])),
                   self.sequences, self.others_tokens)
        return abs(z) >= self.threshold


def shown_arms(ctx: ClassContext, cfg: PolicyConfig, batch_size: int,
               mean: ArmTable | None = None) -> ShownArms:
    """The arms at ``batch_size`` as every figure shows them (the policy's expected speedups,
    the decision log's, the explanations'): by posterior means (``mean``, the table if already
    scored), with no arm's expected tokens above K + 1 and no arm's step time further above the
    plain step's than the largest ratio the cost model measured (``ClassContext.ratio_cap``):
    a price beyond that is an extrapolation, shown at the bound and ranking nothing. Decisions
    read the tables unbounded."""
    table = mean if mean is not None else arm_table(ctx, batch_size, ctx.mean_curves, cfg.max_k)
    ks = np.array([k for _, k in table.keys], dtype=np.float64)
    e = np.minimum(table.expected_tokens, ks + 1.0)
    t = table.step_seconds
    bounded = e < table.expected_tokens
    if ctx.ratio_cap is not None and t.size > 1:
        cap = t[0] * max(ctx.ratio_cap, 1.0)
        over = np.concatenate(([False], t[1:] > cap * (1.0 + 1e-9)))
        bounded |= over
        t = np.where(over, cap, t)
    others = ctx.others.get(batch_size)
    if bounded.any():
        table = _scored(table.keys, e, t, batch_size, others)
    n = len(table.keys)
    tokens_cov = np.zeros((n, n))
    row = 1
    for spec in ctx.drafts:
        k_max = min(cfg.max_k, spec.max_k)
        posterior = ctx.posteriors.get(spec.name)
        if posterior is not None:
            cov = tokens_covariance(posterior[0], posterior[1], k_max)
            tokens_cov[row:row + k_max, row:row + k_max] = cov[1:, 1:]
        row += k_max
    spread = ctx.prices.arm_spread(batch_size, ctx.drafts)
    if spread is None or spread.shape != (n, n):
        spread = np.zeros((n, n))
    sequences, others_tokens = ((others.self_count, others.tokens) if others is not None
                                else (float(batch_size), 0.0))
    return ShownArms(table, bounded, tokens_cov, spread, sequences, others_tokens,
                     rank_threshold(cfg.rank_probability))


def chance_above(alpha: float, beta: float, threshold: float) -> float:
    """P(rate > threshold) for rate ~ Beta(alpha, beta), by the normal approximation (a weight
    for probing, not a test: its tails need no more precision)."""
    n = alpha + beta
    mean = alpha / n
    sd = math.sqrt(max(mean * (1.0 - mean) / (n + 1.0), 1e-12))
    return 0.5 * math.erfc((threshold - mean) / (sd * math.sqrt(2.0)))


# Largest share of a class's requests (or steps) that probe: probes measure, they do not serve.
PROBE_SHARE_MAX = 0.1
# Uniform acceptance rates on which the break-even of probing is searched (probe_plan).
_BREAK_EVEN_GRID = np.linspace(0.0, 0.995, 200)


@dataclass(frozen=True)
class ProbePlan:
    """What probing the model draft costs and may find, for one class at one batch size."""

    share: float
    """Share of the class's request-steps (or of steps, with ``whole_steps``) that probe."""
    k: int
    draft: str
    whole_steps: bool
    cost: float
    """Share of the class's throughput one probed request-step (or step) gives up."""
    chance: float
    """Posterior chance that the model draft beats the arm in force."""


def _seconds_of(ctx: ClassContext, batch_size: int, draft: str, k: int) -> float:
    """Mean step seconds of a batch of ``batch_size`` all on (draft, K) (``probe_curves``)."""
    if k == 0:
        return float(ctx.prices.off(batch_size)[0])
    curve = ctx.prices.curve(batch_size, draft, k)
    spec = next((d for d in ctx.drafts if d.name == draft), None)
    if spec is not None:
        curve = verified_curve(curve, ctx.verified_drafts.get(draft), spec)
    return float(curve[k])


def break_even_rate(seconds: FloatArray, need: float) -> float:
    """The smallest uniform per-position acceptance at which the best K >= 1 emits ``need``
    tokens per second per sequence, with ``seconds[K]`` the step time at K (1.0: none does)."""
    a = _BREAK_EVEN_GRID[:, None]
    ks = np.arange(1, seconds.size)[None, :]
    tokens = (1.0 - a ** (ks + 1)) / (1.0 - a)  # E(K) at a uniform rate a
    best = (tokens / seconds[None, 1:]).max(axis=1)
    above = np.flatnonzero(best >= need)
    return float(_BREAK_EVEN_GRID[above[0]]) if above.size else 1.0


def probe_plan(ctx: ClassContext, cfg: PolicyConfig, batch_size: int,
               current: tuple[str, int]) -> ProbePlan | None:
    """How much to probe the model draft while the class runs ``current`` (off, or a
    deterministic draft), from the value of what a probe may find against what it costs.

    Value: the chance that the best model draft beats ``current`` (``min_speedup`` over off),
    from its position-1 posterior against the uniform rate at which some K would (as evidence
    is forgotten the chance grows back, so a recovery is looked for). Budget: a share of the
    class's throughput between ``probe_cost_floor`` and ``probe_cost_max`` by that chance.
    Cost: the class's tokens per second on the probe against ``current``, by posterior means
    and the cost model, the batch all of the class: the drafter's pass where it would not run
    otherwise, and the tokens of a better deterministic draft given up. Where the drafter runs
    only for the K asked (batch-wide engines) the probe runs for every request of the class in
    a share of steps: there the drafter's pass costs the step the same for one probed request
    as for all, so a probed step tells as many tries as the class has requests. None where
    there is no model draft (deterministic drafts are scored counterfactually)."""
    model_drafts = [d for d in ctx.drafts if d.kind is DraftKind.MODEL]
    if not model_drafts:
        return None
    best = max(model_drafts, key=lambda d: float(ctx.mean_rates[d.name][0]))
    k = min(cfg.probe_k, best.max_k) if ctx.drafter_sunk else 1
    k_max = min(cfg.max_k, best.max_k)
    seconds = ctx.prices.curve(batch_size, best.name, k_max)
    draft, k_now = current
    # Tokens per second per sequence (the batch size cancels in every ratio below).
    rate_now = float(ctx.mean_curves[draft][k_now]) if k_now else 1.0
    rate_now /= _seconds_of(ctx, batch_size, draft, k_now)
    rate_probe = float(ctx.mean_curves[best.name][k]) / float(seconds[k])
    # Never below the margin inside which the decision rule calls arms equal: a probe that the
    # means price as free would otherwise run for every request, the decision in all but name.
    cost = max(1.0 - rate_probe / rate_now, cfg.min_speedup - 1.0, 1e-3)
    plain = 1.0 / float(seconds[0])
    need = max(rate_now, cfg.min_speedup * plain)
    alpha, beta = ctx.position1.get(best.name, (1.0, 1.0))
    chance = chance_above(alpha, beta, break_even_rate(np.asarray(seconds), need))
    budget = cfg.probe_cost_floor + (cfg.probe_cost_max - cfg.probe_cost_floor) * chance
    share = min(budget / cost, PROBE_SHARE_MAX)
    return ProbePlan(share, k, best.name, not ctx.drafter_sunk, cost, chance)


def runs(drafts: Sequence[DraftSpec], draft: str, k: int) -> bool:
    """Whether the connected engines' ``drafts`` can run ``draft`` at ``k`` (k = 0: off)."""
    return k == 0 or any(d.name == draft and k <= d.max_k for d in drafts)


def offered(drafts: Sequence[DraftSpec], decision: Decision) -> bool:
    """Whether the connected engines' ``drafts`` can run ``decision`` (its arm and its probe):
    after an engine leaves, or reconnects with a smaller max K, a decision held from before may
    name a draft or a K no engine offers any more."""
    return (runs(drafts, decision.draft, decision.k)
            and runs(drafts, decision.probe_draft, decision.probe_k))


def uses_model_draft(ctx: ClassContext, decision: Decision) -> bool:
    """Whether ``decision`` runs a model draft (otherwise it is off or on a deterministic draft,
    and the model draft's acceptance is learnt only by probing)."""
    return decision.k > 0 and any(d.name == decision.draft and d.kind is DraftKind.MODEL
                                  for d in ctx.drafts)


@dataclass(frozen=True)
class Choice:
    """A bucket's decision before probing (``choose``), and whether it is one the model draft
    is probed against while it runs none (warm-up and goodput choices; not a decision held,
    an override or a pin)."""

    decision: Decision
    probed: bool = False


def _probes(ctx: ClassContext, choice: Choice) -> bool:
    """Whether ``with_probe`` plans a probe for the choice: one the model draft is probed
    against that runs none itself."""
    d = choice.decision
    return (choice.probed and not uses_model_draft(ctx, d)
            and d.reason not in (Reason.OVERRIDE, Reason.OFFLINE))


def probe_curves(ctx: ClassContext, cfg: PolicyConfig, state: BucketState,
                 choice: Choice) -> list[tuple[int, str, int]]:
    """The step curves ``with_probe`` reads besides no speculation, as (batch size, draft,
    K up to): each model draft's and the one of the arm in force. What the decider prices
    between the two stages."""
    if not _probes(ctx, choice):
        return []
    b = state.batch_size
    curves = [(b, d.name, min(cfg.max_k, d.max_k)) for d in ctx.drafts
              if d.kind is DraftKind.MODEL]
    draft, k = choice.decision.arm
    return [*curves, (b, draft, k)] if k else curves


def with_probe(ctx: ClassContext, cfg: PolicyConfig, state: BucketState,
               choice: Choice) -> Decision:
    """The second stage of ``decide_bucket``: the choice's decision with the probe of the model
    draft while the class does not run one (off, or on n-gram or suffix drafts, whose
    acceptance is scored counterfactually anyway); the decision itself where nothing is
    probed. Reads the prices of ``probe_curves``."""
    decision = choice.decision
    if not _probes(ctx, choice):
        return decision
    plan = probe_plan(ctx, cfg, state.batch_size, decision.arm)
    if plan is None or not math.isfinite(plan.share):  # a broken cost: probe nothing, not NaN
        return decision
    return replace(decision, probe_rate=plan.share, probe_k=plan.k, probe_draft=plan.draft,
                   probe_steps=plan.whole_steps)


def _override_unpriced(ctx: ClassContext, state: BucketState) -> Decision | None:
    """An override's decision where it needs no prices: speculation off (forced, pinned at 0,
    no drafts, or a forced draft the engines do not offer) or a forced draft's K held."""
    ov = ctx.override
    assert ov is not None
    off = Decision(ctx.traffic_class, state.bucket, "", 0, Reason.OVERRIDE)
    if ov.force_off or not ctx.drafts:
        return off
    if ov.force_draft is not None:
        spec = next((d for d in ctx.drafts if d.name == ov.force_draft), None)
        if spec is None:  # the forced draft is not offered by the engine: speculate not at all
            return off
        held = state.current
        if (not state.fresh and held is not None and held.reason is Reason.OVERRIDE
                and held.draft == spec.name and offered(ctx.drafts, held)):
            # K moves with new evidence only, as every other decision's: drawn every round, it
            # flapped (a new policy version each report interval) with no traffic at all.
            return held
        return None
    return off if ov.pin_k is None or ov.pin_k == 0 else None


def _override_decision(ctx: ClassContext, cfg: PolicyConfig, state: BucketState) -> Decision:
    """An override's decision that its prices decide (``_override_unpriced`` returned None):
    the forced draft's best K, or the pinned K on the current draft if it allows it, else on
    the draft with the best mean at that K."""
    ov = ctx.override
    assert ov is not None
    name = ctx.traffic_class
    if ov.force_draft is not None:
        spec = next(d for d in ctx.drafts if d.name == ov.force_draft)
        only = replace(ctx, drafts=(spec,))
        mean = arm_table(only, state.batch_size, ctx.mean_curves, cfg.max_k)
        drawn = (arm_table(only, state.batch_size, ctx.sampled_curves, cfg.max_k)
                 if state.fresh else mean)
        i = 1 + int(np.argmax(drawn.goodput[1:]))  # the best K >= 1 with that draft
        k = drawn.keys[i][1]
        return _shown_decision(ctx, cfg, state.batch_size,
                               Decision(name, state.bucket, spec.name, k, Reason.OVERRIDE))
    pin = min(ov.pin_k or 0, cfg.max_k)
    current = state.current.draft if state.current and state.current.k else ""
    candidates = [d for d in ctx.drafts if d.max_k >= pin] or list(ctx.drafts)
    chosen = next((d for d in candidates if d.name == current), None) or max(
        candidates, key=lambda d: float(ctx.mean_curves[d.name][min(pin, d.max_k)])
    )
    k = min(pin, chosen.max_k)
    return _shown_decision(ctx, cfg, state.batch_size,
                           Decision(name, state.bucket, chosen.name, k, Reason.OVERRIDE))


def _shown_decision(ctx: ClassContext, cfg: PolicyConfig, batch_size: int, decision: Decision,
                    mean: ArmTable | None = None) -> Decision:
    """``decision`` with its expected speedup as figures show it at ``batch_size``
    (``shown_arms``; ``mean``: the table by posterior means, if already scored), flagged where
    it ranks nothing."""
    shown = shown_arms(ctx, cfg, batch_size, mean)
    i = shown.table.index(decision.arm)
    if i is None:  # no longer offered: no estimate
        return replace(decision, expected_speedup=1.0, too_little_evidence=True)
    return replace(decision, expected_speedup=float(shown.table.speedup[i]),
                   too_little_evidence=not shown.ranked(i, 0))


def _warmup(ctx: ClassContext, cfg: PolicyConfig, state: BucketState) -> Decision:
    """Before any data: the warm-up K on the first draft."""
    first = ctx.drafts[0]
    k = min(cfg.warmup_k, first.max_k)
    return Decision(ctx.traffic_class, state.bucket, first.name if k else "", k, Reason.WARMUP)


def unpriced_decision(ctx: ClassContext, cfg: PolicyConfig, state: BucketState
                      ) -> Decision | None:
    """The decision ``choose`` takes without pricing a step (None where it prices some; the
    decider prices only those buckets). The decision in force held: a settled choice on an arm
    the engines offer, without new evidence for the bucket (also after a detected change: the
    bucket's next report with traffic re-decides it from the posterior the change reset, one
    report interval at the old decision). An override that turns speculation off or holds its
    K; no drafts; an offline pin; the warm-up K where no model draft is to be probed."""
    current = state.current
    if ctx.override is not None:
        return _override_unpriced(ctx, state)
    name = ctx.traffic_class
    if not ctx.drafts:
        return Decision(name, state.bucket, "", 0, Reason.GOODPUT)
    if ctx.offline and cfg.offline_mode == "pin_off":
        return Decision(name, state.bucket, "", 0, Reason.OFFLINE)
    if not ctx.has_data:
        warmup = _warmup(ctx, cfg, state)
        probes = (not uses_model_draft(ctx, warmup)
                  and any(d.kind is DraftKind.MODEL for d in ctx.drafts))
        return None if probes else warmup
    if (not state.fresh and current is not None
            and current.reason not in (Reason.WARMUP, Reason.OVERRIDE)
            and offered(ctx.drafts, current)):
        return current
    return None


def choose(ctx: ClassContext, cfg: PolicyConfig, state: BucketState) -> Choice:
    """The first stage of ``decide_bucket``: the bucket's arm (``state.current`` itself to
    hold), before probing."""
    decided = unpriced_decision(ctx, cfg, state)
    if decided is not None:
        return Choice(decided)
    if ctx.override is not None:
        return Choice(_override_decision(ctx, cfg, state))
    if not ctx.has_data:
        return Choice(_warmup(ctx, cfg, state), probed=True)
    name = ctx.traffic_class
    batch = priced_batch(ctx, state)
    current = state.current
    mean = arm_table(ctx, batch, ctx.mean_curves, cfg.max_k)
    # A bucket decided without evidence of its own (no traffic yet): by the posterior means,
    # not a Thompson draw, so that it does not take a random arm from one round's noise.
    sampled = (arm_table(ctx, batch, ctx.sampled_curves, cfg.max_k, drawn_costs=True)
               if state.fresh else mean)
    scores = sampled.scores(cfg.min_speedup)
    best_i = int(np.argmax(scores))
    mean_i = mean.best(cfg.min_speedup)
    if best_i != mean_i and not ctx.change_detected:
        # Exploring: only as far as explore_max_step from the K in force (before a class's
        # first decision: the warm-up K its requests run by default), and only where the means
        # expect at most explore_max_loss less than their own best (which is always in).
        in_force = current.k if current is not None else min(cfg.warmup_k, ctx.drafts[0].max_k)
        mean_scores = mean.scores(cfg.min_speedup)
        near = np.array([abs(k - in_force) <= cfg.explore_max_step
                         for _, k in sampled.keys])
        near &= mean_scores >= (1.0 - cfg.explore_max_loss) * mean_scores[mean_i]
        near[mean_i] = True
        best_i = int(np.argmax(np.where(near, scores, -np.inf)))
    best_draft, best_k = sampled.keys[best_i]
    if ctx.change_detected:
        reason = Reason.CHANGE_DETECTED
    elif best_i == mean_i:
        reason = Reason.GOODPUT
    else:
        reason = Reason.EXPLORE
    if ctx.offline:
        reason = Reason.OFFLINE
    candidate = _shown_decision(ctx, cfg, batch,
                                Decision(name, state.bucket, best_draft, best_k, reason), mean)

    if current is None or current.reason in (Reason.WARMUP, Reason.OVERRIDE):
        return Choice(candidate, probed=True)
    if candidate.same_choice(current):
        # Same arm: refresh the estimate (and the probe share), keep the original reason.
        return Choice(replace(candidate, reason=current.reason), probed=True)
    if not ctx.change_detected:
        young = state.changed_at is not None and ctx.now - state.changed_at < cfg.dwell_seconds
        cur = sampled.index(current.arm)
        # Speculation that does not pay by posterior means is switched off without waiting for
        # a margin: near-zero acceptance with cheap verification would otherwise hold forever.
        losing = (cur is not None and current.k > 0
                  and float(mean.speedup[cur]) < cfg.min_speedup)
        margin = 0.0 if ctx.recovering or (best_k == 0 and losing) else cfg.hysteresis_ratio
        within = cur is not None and scores[best_i] <= scores[cur] * (1.0 + margin)
        if (young and offered(ctx.drafts, current)) or within:
            return Choice(current, probed=True)
    return Choice(candidate, probed=True)


# Reasons of the choices that neighbouring buckets may bound (``follow_neighbours``): goodput
# choices, not an operator's, an offline pin or the warm-up K.
_FOLLOWING = (Reason.GOODPUT, Reason.EXPLORE, Reason.CHANGE_DETECTED, Reason.NEIGHBOURS)


def _longer(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether arm ``a`` verifies more drafts than arm ``b``: it speculates and ``b`` does not,
    or both run one draft and ``a`` at the larger K (arms of two drafts do not compare)."""
    return a[1] > 0 and (b[1] == 0 or (a[0] == b[0] and a[1] > b[1]))


def _deciding(ctx: ClassContext, state: BucketState, choice: Choice) -> bool:
    """Whether the bucket's choice is being taken now by the goodput rule (new evidence of its
    own, or its first decision), so that its neighbours may bound it: a choice held without
    evidence stays put."""
    first = state.current is None or state.current.reason is Reason.WARMUP
    return ((state.fresh or first) and choice.decision.reason in _FOLLOWING
            and ctx.override is None and not ctx.offline)


def _monotone(ctx: ClassContext, cfg: PolicyConfig, longer: tuple[str, int],
              shorter: tuple[str, int], small: int, large: int) -> bool:
    """Whether the cost model is monotone between batch sizes ``small`` < ``large`` for two
    arms of the class: each arm's step costs at least as much at the larger batch, and where
    the ``longer`` arm runs a model drafter's passes (a cost per step that a larger batch
    shares), its step relative to the ``shorter`` one's is priced at least as dear there too.

    Physics: a class's acceptance, so its expected tokens per step, is the same at every batch
    size, while the price of verifying more tokens per sequence grows with the batch (the step
    turns from memory- to compute-bound): the best K falls as the batch grows, and a longer
    arm chosen at a larger batch than a shorter one is a draw's noise, not a finding. A model
    drafter's fixed and per-pass costs are the exception (they weigh less in a larger step), so
    there the model itself must price the longer arm relatively dearer at the larger batch."""
    def seconds(batch: int) -> tuple[float, float]:
        t = arm_table(ctx, batch, ctx.mean_curves, cfg.max_k)
        i, j = t.index(longer), t.index(shorter)
        return ((math.nan, math.nan) if i is None or j is None
                else (float(t.step_seconds[i]), float(t.step_seconds[j])))
    (long_small, short_small), (long_large, short_large) = seconds(small), seconds(large)
    if not (long_large >= long_small and short_large >= short_small):
        return False
    passes = any(d.name == longer[0] and d.pass_draft for d in ctx.drafts)
    return not passes or long_large / short_large >= (long_small / short_small) * (1 - 1e-9)


def needs_neighbours(ctx: ClassContext, choices: Sequence[Choice]) -> bool:
    """Whether ``follow_neighbours`` may change ``choices`` (one per bucket, batch order): a
    longer arm at a larger batch than a shorter one, one of them being decided now. What the
    decider prices every bucket's batch size for."""
    arms = [c.decision.arm for c in choices]
    deciding = [_deciding(ctx, b, c) for b, c in zip(ctx.buckets, choices, strict=True)]
    return any(_longer(arms[j], arms[i]) and (deciding[i] or deciding[j])
               for i in range(len(arms)) for j in range(i + 1, len(arms)))


def follow_neighbours(ctx: ClassContext, cfg: PolicyConfig, choices: Sequence[Choice],
                      evidence: Sequence[float]) -> list[Choice]:
    """The class's choices (one per bucket, batch order) with each bucket being decided now
    kept within its neighbours of more evidence: no longer arm than the nearest such bucket of
    a smaller batch chose, and no shorter one than the nearest of a larger batch, where the
    cost model is monotone (``_monotone``: the best K falls as the batch grows).
    ``evidence``: the steps timed in each bucket (decayed).

    Why: each bucket is decided on its own, a measured one by the round's Thompson draw, one
    without steps of its own by posterior means on extrapolated prices, at the moment the class
    first has evidence; alone, one request's evidence can leave a table that reads off, K=1,
    off, K=4 across neighbouring batch ranges. Buckets are visited from the most evidence to
    the least (those without steps last, the nearest to a measured one first), each bounded by
    the nearest already visited on either side. A bound that binds takes the best arm by
    posterior means within it. Choices held without evidence of their own are never moved (a
    bucket's decision changes on evidence only)."""
    out = list(choices)
    n = len(out)
    measured = [i for i in range(n) if evidence[i] > 0]
    order = sorted(range(n), key=lambda i: (-evidence[i],
                                            min((abs(i - j) for j in measured), default=0), i))
    visited: list[int] = []
    for i in order:
        state = ctx.buckets[i]
        if _deciding(ctx, state, out[i]):
            lo = max((j for j in visited if j < i), default=None)
            hi = min((j for j in visited if j > i), default=None)
            out[i] = _within(ctx, cfg, state, out[i],
                             None if lo is None else (ctx.buckets[lo], out[lo].decision.arm),
                             None if hi is None else (ctx.buckets[hi], out[hi].decision.arm))
        visited.append(i)
    return out


def _within(ctx: ClassContext, cfg: PolicyConfig, state: BucketState, choice: Choice,
            lo: tuple[BucketState, tuple[str, int]] | None,
            hi: tuple[BucketState, tuple[str, int]] | None) -> Choice:
    """``choice`` for ``state``'s bucket, or, where it breaks the bound of its neighbour of a
    smaller batch (``lo``) or of a larger one (``hi``), the best arm by posterior means within
    both (``follow_neighbours``)."""
    arm, batch = choice.decision.arm, priced_batch(ctx, state)
    broken = ((lo is not None and _longer(arm, lo[1])
               and _monotone(ctx, cfg, arm, lo[1], priced_batch(ctx, lo[0]), batch))
              or (hi is not None and _longer(hi[1], arm)
                  and _monotone(ctx, cfg, hi[1], arm, batch, priced_batch(ctx, hi[0]))))
    if not broken:
        return choice
    mean = arm_table(ctx, batch, ctx.mean_curves, cfg.max_k)
    allowed = np.array([(lo is None or not _longer(a, lo[1])) and (hi is None
                        or not _longer(hi[1], a)) for a in mean.keys])
    if not allowed.any():
        return choice
    best = mean.keys[int(np.argmax(np.where(allowed, mean.scores(cfg.min_speedup), -np.inf)))]
    current = state.current
    if current is not None and current.arm == best and current.reason is not Reason.WARMUP:
        return Choice(current, probed=True)
    decision = Decision(ctx.traffic_class, state.bucket, best[0], best[1], Reason.NEIGHBOURS)
    return Choice(_shown_decision(ctx, cfg, batch, decision, mean), probed=True)


def decide_bucket(ctx: ClassContext, cfg: PolicyConfig, state: BucketState) -> Decision:
    """The decision for one bucket of the class: ``choose``, then ``with_probe``. Returns
    ``state.current`` unchanged to hold."""
    return with_probe(ctx, cfg, state, choose(ctx, cfg, state))


def priced_batch(ctx: ClassContext, state: BucketState) -> int:
    """The batch size a bucket's arms are priced at: offline work runs at full load."""
    return max(b.batch_size for b in ctx.buckets) if ctx.offline else state.batch_size


def decision_figures(ctx: ClassContext, cfg: PolicyConfig, state: BucketState,
                     decision: Decision, previous: Decision | None) -> DecisionFigures:
    """The figures ``decision`` (replacing ``previous``) was taken on, for the decision log to
    keep: the arms by posterior means and mean step costs, as ``decide_bucket`` compares them,
    and as figures show them (``shown_arms``: bounded, and flagged where the posteriors cannot
    rank an arm against the chosen one, or the chosen one against no speculation). An arm the
    engines no longer offer, or one a broken cost prices, has no estimate; one whose draft has
    no acceptance evidence yet is priced on the prior (its acceptance is None)."""
    batch = priced_batch(ctx, state)
    table = arm_table(ctx, batch, ctx.mean_curves, cfg.max_k)
    shown = shown_arms(ctx, cfg, batch, table)
    chosen_row = table.index(decision.arm)

    def figures(arm: tuple[str, int], against: int | None) -> ArmFigures | None:
        i = table.index(arm)
        if i is None:
            return None
        draft, k = arm
        gain, ratio = float(shown.table.goodput[i]), float(shown.table.speedup[i])
        if not (math.isfinite(gain) and math.isfinite(ratio)):
            return None
        evidence = k > 0 and draft in ctx.evidence
        unranked = against is None or not shown.ranked(i, against)
        return ArmFigures(draft, k, float(shown.table.expected_tokens[i]), gain, ratio,
                          position1_acceptance(ctx, draft) if evidence else None, unranked)

    best = table.keys[table.best(cfg.min_speedup)]
    if ctx.override is not None:
        pinned_by = ctx.override.action
    elif ctx.offline and cfg.offline_mode == "pin_off":
        pinned_by = OFFLINE_PIN
    else:
        pinned_by = ""
    return DecisionFigures(
        batch_size=batch,
        chosen=figures(decision.arm, 0),
        previous=None if previous is None else figures(previous.arm, chosen_row),
        best=None if best == decision.arm else figures(best, chosen_row),
        pinned_by=pinned_by,
    )


def position1_acceptance(ctx: ClassContext, draft: str) -> tuple[float, float]:
    """(posterior mean, half-width of the credible interval) of ``draft``'s acceptance at
    position 1, from the posterior the decision was taken on."""
    alpha, beta = ctx.position1.get(draft, (1.0, 1.0))
    lower, upper = credible_bounds([alpha], [beta], CREDIBLE_LEVEL)
    return alpha / (alpha + beta), float(upper[0] - lower[0]) / 2

