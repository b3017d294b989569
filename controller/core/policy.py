"""The decision rule: a pure function of a context object (no clock, no RNG state, no I/O).

For one class and one batch bucket, every arm (draft, K in 1..max) and "off" is scored by goodput,
accepted tokens per second = E(K) x batch / step seconds, with E(K) from ONE Thompson draw of the
class's per-position acceptance rates per draft (per-arm statistics: each (class, draft) has its own
posteriors, so exploration fades as they tighten). On top of the argmax:
  - hysteresis: a new arm must beat the current one's sampled goodput by ``hysteresis_ratio``,
    except while a detected acceptance change is being absorbed (the old margin is stale);
  - dwell: a choice younger than ``dwell_seconds`` stays, unless a change was just detected;
  - probing: while off, a small share of requests, decaying with time off, runs ``probe_k``;
  - overrides: operator pins win over everything; offline classes are pinned off (or scored at
    the largest bucket in "goodput" mode).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from controller.core.goodput import expected_tokens_curve, goodput, speedup
from controller.core.types import Decision, DraftKind, DraftSpec, Override, Reason, arm_key

FloatArray = np.ndarray
# (batch_size, k, draft, draft_is_model) -> predicted step seconds
StepSecondsFn = Callable[[int, int, str, bool], float]


@dataclass(frozen=True)
class PolicyConfig:
    max_k: int
    warmup_k: int = 2
    dwell_seconds: float = 10.0
    hysteresis_ratio: float = 0.03
    probe_rate_initial: float = 0.05
    probe_rate_min: float = 0.005
    probe_half_life_seconds: float = 120.0
    probe_k: int = 2
    offline_mode: str = "pin_off"


@dataclass(frozen=True)
class BucketState:
    """What is in force for one batch bucket of the class."""

    bucket: int
    batch_size: int
    current: Decision | None
    changed_at: float | None
    off_since: float | None = None


@dataclass(frozen=True)
class ClassContext:
    traffic_class: str
    now: float
    drafts: tuple[DraftSpec, ...]
    # Per draft: one Thompson sample and the posterior mean of the per-position rates.
    sampled_rates: Mapping[str, FloatArray]
    mean_rates: Mapping[str, FloatArray]
    has_data: bool
    # A change was detected since the last decision / its evidence is still being absorbed.
    change_detected: bool
    recovering: bool
    offline: bool
    override: Override | None
    buckets: tuple[BucketState, ...]
    step_seconds: StepSecondsFn


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


def arm_values(
    ctx: ClassContext, batch_size: int, rates: Mapping[str, FloatArray], max_k: int
) -> list[ArmValue]:
    """Score "off" and every (draft, K) arm at ``batch_size`` with the given per-position rates."""
    plain = ctx.step_seconds(batch_size, 0, "", False)
    arms = [ArmValue("", 0, 1.0, plain, goodput(1.0, batch_size, plain), 1.0)]
    for spec in ctx.drafts:
        k_max = min(max_k, spec.max_k)
        curve = expected_tokens_curve(rates[spec.name][:k_max])
        is_model = spec.kind is DraftKind.MODEL
        for k in range(1, k_max + 1):
            e = float(curve[k])
            t = ctx.step_seconds(batch_size, k, spec.name, is_model)
            arms.append(
                ArmValue(spec.name, k, e, t, goodput(e, batch_size, t), speedup(e, t, plain))
            )
    return arms


def _best(arms: list[ArmValue]) -> ArmValue:
    # Ties go to the cheaper arm (off first, then smaller K): never speculate for nothing.
    return max(arms, key=lambda a: (a.goodput, -a.k))


def _probe(ctx: ClassContext, cfg: PolicyConfig, off_since: float) -> tuple[float, int, str]:
    """Probe share, K and draft while off; the share halves every probe_half_life_seconds."""
    model_drafts = [d for d in ctx.drafts if d.kind is DraftKind.MODEL]
    if not model_drafts:
        return 0.0, 0, ""  # deterministic drafts are scored counterfactually: no probing needed
    best = max(model_drafts, key=lambda d: float(ctx.mean_rates[d.name][0]))
    elapsed = max(ctx.now - off_since, 0.0)
    rate = cfg.probe_rate_initial * 2.0 ** (-elapsed / cfg.probe_half_life_seconds)
    return max(rate, cfg.probe_rate_min), min(cfg.probe_k, best.max_k), best.name


def _with_probe(
    ctx: ClassContext, cfg: PolicyConfig, state: BucketState, decision: Decision
) -> Decision:
    if decision.k != 0 or decision.reason in (Reason.OVERRIDE, Reason.OFFLINE):
        return decision
    off_since = state.off_since if state.off_since is not None else ctx.now
    rate, k, draft = _probe(ctx, cfg, off_since)
    return Decision(
        decision.traffic_class, decision.bucket, "", 0, decision.reason,
        decision.expected_speedup, rate, k, draft,
    )


def _override_decision(ctx: ClassContext, cfg: PolicyConfig, state: BucketState) -> Decision:
    ov = ctx.override
    assert ov is not None
    name = ctx.traffic_class
    if ov.force_off or not ctx.drafts:
        return Decision(name, state.bucket, "", 0, Reason.OVERRIDE)
    if ov.force_draft is not None:
        spec = next((d for d in ctx.drafts if d.name == ov.force_draft), None)
        if spec is None:  # the forced draft is not offered by the engine: speculate not at all
            return Decision(name, state.bucket, "", 0, Reason.OVERRIDE)
        restricted = replace(ctx, drafts=(spec,))
        arms = arm_values(restricted, state.batch_size, ctx.sampled_rates, cfg.max_k)
        best = max((a for a in arms if a.k > 0), key=lambda a: a.goodput)
        return Decision(name, state.bucket, best.draft, best.k, Reason.OVERRIDE, best.speedup)
    pin = min(ov.pin_k or 0, cfg.max_k)
    if pin == 0:
        return Decision(name, state.bucket, "", 0, Reason.OVERRIDE)
    # Pin K with the current draft if it allows it, else the draft with the best mean at that K.
    current = state.current.draft if state.current and state.current.k else ""
    candidates = [d for d in ctx.drafts if d.max_k >= pin] or list(ctx.drafts)
    chosen = next((d for d in candidates if d.name == current), None) or max(
        candidates, key=lambda d: float(expected_tokens_curve(ctx.mean_rates[d.name])[
            min(pin, d.max_k)])
    )
    k = min(pin, chosen.max_k)
    mean = {a.draft: a for a in arm_values(ctx, state.batch_size, ctx.mean_rates, cfg.max_k)
            if a.k == k}
    value = mean.get(chosen.name)
    return Decision(name, state.bucket, chosen.name, k, Reason.OVERRIDE,
                    value.speedup if value else 1.0)


def decide_bucket(ctx: ClassContext, cfg: PolicyConfig, state: BucketState) -> Decision:
    """The decision for one bucket of the class. Returns ``state.current`` unchanged to hold."""
    name = ctx.traffic_class
    if ctx.override is not None:
        return _override_decision(ctx, cfg, state)
    if not ctx.drafts:
        return Decision(name, state.bucket, "", 0, Reason.GOODPUT)
    if ctx.offline and cfg.offline_mode == "pin_off":
        return Decision(name, state.bucket, "", 0, Reason.OFFLINE)
    batch = max(b.batch_size for b in ctx.buckets) if ctx.offline else state.batch_size
    if not ctx.has_data:
        first = ctx.drafts[0]
        k = min(cfg.warmup_k, first.max_k)
        return _with_probe(ctx, cfg, state, Decision(
            name, state.bucket, first.name if k else "", k, Reason.WARMUP))

    sampled = arm_values(ctx, batch, ctx.sampled_rates, cfg.max_k)
    mean = arm_values(ctx, batch, ctx.mean_rates, cfg.max_k)
    best = _best(sampled)
    mean_best = _best(mean)
    expected = next(a.speedup for a in mean if a.arm == best.arm)
    if ctx.change_detected:
        reason = Reason.CHANGE_DETECTED
    elif best.arm == mean_best.arm:
        reason = Reason.GOODPUT
    else:
        reason = Reason.EXPLORE
    if ctx.offline:
        reason = Reason.OFFLINE
    candidate = Decision(name, state.bucket, best.draft, best.k, reason, expected)

    current = state.current
    if current is None or current.reason in (Reason.WARMUP, Reason.OVERRIDE):
        return _with_probe(ctx, cfg, state, candidate)
    if candidate.same_choice(current):
        # Same arm: refresh the estimate (and the probe share), keep the original reason.
        refreshed = Decision(name, state.bucket, current.draft, current.k, current.reason,
                             expected)
        return _with_probe(ctx, cfg, state, refreshed)
    if not ctx.change_detected:
        young = state.changed_at is not None and ctx.now - state.changed_at < cfg.dwell_seconds
        cur = next((a for a in sampled if a.arm == current.arm), None)
        margin = 0.0 if ctx.recovering else cfg.hysteresis_ratio
        within = cur is not None and best.goodput <= cur.goodput * (1.0 + margin)
        if young or within:
            return _with_probe(ctx, cfg, state, current)
    return _with_probe(ctx, cfg, state, candidate)


def decide_class(ctx: ClassContext, cfg: PolicyConfig) -> list[Decision]:
    """One decision per bucket of the class."""
    return [decide_bucket(ctx, cfg, state) for state in ctx.buckets]
