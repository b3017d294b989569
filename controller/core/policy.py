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

A bucket is decided in two small stages, ``choose`` (the arm) then ``with_probe`` (the probe).
Neither prices anything: the context carries the step seconds they read, computed before each
stage by the decider (``specpilot.controller.core.prices``; ``unpriced_decision`` and
``probe_curves`` say what a stage will read).
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
from specpilot.controller.core.mix import BatchOthers, priced_arm_rates
from specpilot.controller.core.prices import StepPrices
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
    if others is not None:
        return _mixed_arm_table(ctx, others, prices.mixed_arms(batch_size, ctx.drafts), curves,
                                max_k)
    keys: list[tuple[str, int]] = [("", 0)]
    expected: list[FloatArray] = [np.ones(1)]
    steps: list[FloatArray] = [prices.off(batch_size)]
    for spec in ctx.drafts:
        k_max = min(max_k, spec.max_k)
        keys.extend((spec.name, k) for k in range(1, k_max + 1))
        expected.append(curves[spec.name][1 : k_max + 1])
        steps.append(prices.curve(batch_size, spec.name, k_max)[1:])
    e, t = np.concatenate(expected), np.concatenate(steps)
    return ArmTable(keys, e, t, goodput(e, batch_size, t), speedup(e, t, t[0]))


def _mixed_arm_table(ctx: ClassContext, o: BatchOthers, seconds: FloatArray,
                     curves: Mapping[str, FloatArray], max_k: int) -> ArmTable:
    """Arms scored by the whole batch's goodput, the other classes held at their arms (their
    step ``seconds`` priced in advance).

    The goodput column is attributed to this class: its own rate with speculation off plus
    what the arm adds to (or takes from) the batch, so that ``min_speedup`` and hysteresis keep
    their per-class meaning; with no other classes it equals the homogeneous table.
    """
    r = priced_arm_rates(o, ctx.drafts, curves, max_k, seconds)
    own_off = o.self_count / r.step_seconds[0]
    attributed = own_off + r.batch_rate - r.batch_rate[0]
    # An arm that takes more from the batch than the class's own rate scores below zero (the
    # ranking keeps that), but a speedup is a ratio of rates: it reads 0, never negative.
    return ArmTable(r.keys, r.expected_tokens, r.step_seconds, attributed,
                    np.maximum(attributed / own_off, 0.0))


def arm_values(ctx: ClassContext, batch_size: int, rates: Mapping[str, FloatArray],
               max_k: int) -> list[ArmValue]:
    """Every arm scored with the given per-position rates (for explanations and tests)."""
    curves = {name: expected_tokens_curve(r) for name, r in rates.items()}
    return arm_table(ctx, batch_size, curves, max_k).values()


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
    return float(ctx.prices.curve(batch_size, draft, k)[k])


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
        return Decision(name, state.bucket, spec.name, drawn.keys[i][1], Reason.OVERRIDE,
                        float(mean.speedup[i]))
    pin = min(ov.pin_k or 0, cfg.max_k)
    current = state.current.draft if state.current and state.current.k else ""
    candidates = [d for d in ctx.drafts if d.max_k >= pin] or list(ctx.drafts)
    chosen = next((d for d in candidates if d.name == current), None) or max(
        candidates, key=lambda d: float(ctx.mean_curves[d.name][min(pin, d.max_k)])
    )
    k = min(pin, chosen.max_k)
    table = arm_table(ctx, state.batch_size, ctx.mean_curves, cfg.max_k)
    row = table.index((chosen.name, k))
    return Decision(name, state.bucket, chosen.name, k, Reason.OVERRIDE,
                    float(table.speedup[row]) if row is not None else 1.0)


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
    expected = float(mean.speedup[best_i])  # same arm order in both tables
    if ctx.change_detected:
        reason = Reason.CHANGE_DETECTED
    elif best_i == mean_i:
        reason = Reason.GOODPUT
    else:
        reason = Reason.EXPLORE
    if ctx.offline:
        reason = Reason.OFFLINE
    candidate = Decision(name, state.bucket, best_draft, best_k, reason, expected)

    if current is None or current.reason in (Reason.WARMUP, Reason.OVERRIDE):
        return Choice(candidate, probed=True)
    if candidate.same_choice(current):
        # Same arm: refresh the estimate (and the probe share), keep the original reason.
        refreshed = Decision(name, state.bucket, current.draft, current.k, current.reason,
                             expected)
        return Choice(refreshed, probed=True)
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
    keep: the arms by posterior means and mean step costs, as ``decide_bucket`` compares them.
    An arm the engines no longer offer, or one a broken cost prices, has no estimate; one whose
    draft has no acceptance evidence yet is priced on the prior (its acceptance is None)."""
    batch = priced_batch(ctx, state)
    table = arm_table(ctx, batch, ctx.mean_curves, cfg.max_k)

    def figures(arm: tuple[str, int]) -> ArmFigures | None:
        i = table.index(arm)
        if i is None:
            return None
        draft, k = arm
        gain, ratio = float(table.goodput[i]), float(table.speedup[i])
        if not (math.isfinite(gain) and math.isfinite(ratio)):
            return None
        evidence = k > 0 and draft in ctx.evidence
        return ArmFigures(draft, k, float(table.expected_tokens[i]), gain, ratio,
                          position1_acceptance(ctx, draft) if evidence else None)

    best = table.keys[table.best(cfg.min_speedup)]
    if ctx.override is not None:
        pinned_by = ctx.override.action
    elif ctx.offline and cfg.offline_mode == "pin_off":
        pinned_by = OFFLINE_PIN
    else:
        pinned_by = ""
    return DecisionFigures(
        batch_size=batch,
        chosen=figures(decision.arm),
        previous=None if previous is None else figures(previous.arm),
        best=None if best == decision.arm else figures(best),
        pinned_by=pinned_by,
    )


def position1_acceptance(ctx: ClassContext, draft: str) -> tuple[float, float]:
    """(posterior mean, half-width of the credible interval) of ``draft``'s acceptance at
    position 1, from the posterior the decision was taken on."""
    alpha, beta = ctx.position1.get(draft, (1.0, 1.0))
    lower, upper = credible_bounds([alpha], [beta], CREDIBLE_LEVEL)
    return alpha / (alpha + beta), float(upper[0] - lower[0]) / 2

