"""Policy invariants: K within bounds, overrides win, no flapping inside the dwell time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.contract.records import Decision, DraftKind, DraftSpec, Override, Reason
from specpilot.controller.core.goodput import expected_tokens_curve
from specpilot.controller.core.policy import (
    PROBE_SHARE_MAX,
    BucketState,
    ClassContext,
    PolicyConfig,
    break_even_rate,
    decide_bucket,
)
from specpilot.controller.core.prices import StepPrices, StepSecondsFn, price_steps

NOW = 1000.0
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 256)


def _step_seconds(base: float, per_token: float, per_pass: float) -> StepSecondsFn:
    def f(batch: int, draft: str, is_model: bool, max_k: int) -> np.ndarray:
        k = np.arange(max_k + 1)
        return base + per_token * batch * (1 + k) + (per_pass * k if is_model else 0.0)

    return f


def _prices(seconds: StepSecondsFn, drafts: tuple[DraftSpec, ...], max_k: int) -> StepPrices:
    """Every batch size the tests score at, and every arm a probe may be priced against, by
    ``seconds``."""
    arms = [(b, d.name, k) for b in BATCH_SIZES for d in drafts
            for k in range(1, min(max_k, d.max_k) + 1)]
    return price_steps(seconds, None, drafts, max_k, BATCH_SIZES, arms=arms)


@st.composite
def contexts(draw: st.DrawFn) -> tuple[ClassContext, PolicyConfig, BucketState]:
    max_k = draw(st.integers(1, 8))
    n_drafts = draw(st.integers(1, 2))
    drafts = tuple(
        DraftSpec(f"d{i}", draw(st.sampled_from(list(DraftKind))), draw(st.integers(1, 10)))
        for i in range(n_drafts)
    )
    rates = {d.name: np.array(draw(st.lists(st.floats(0, 1), min_size=max(10, max_k),
                                            max_size=max(10, max_k)))) for d in drafts}
    means = {d.name: np.array(draw(st.lists(st.floats(0, 1), min_size=max(10, max_k),
                                            max_size=max(10, max_k)))) for d in drafts}
    override = draw(st.one_of(
        st.none(),
        st.builds(Override, traffic_class=st.just("c"), force_off=st.just(True)),
        st.builds(Override, traffic_class=st.just("c"), pin_k=st.integers(0, 12)),
        st.builds(Override, traffic_class=st.just("c"),
                  force_draft=st.sampled_from([d.name for d in drafts] + ["missing"])),
    ))
    current_k = draw(st.integers(0, min(max_k, drafts[0].max_k)))
    current = draw(st.one_of(st.none(), st.just(Decision(
        "c", 0, drafts[0].name if current_k else "", current_k, draw(st.sampled_from(
            list(Reason)))))))
    changed_at = NOW - draw(st.floats(0, 100))
    batch = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    state = BucketState(0, batch, current, changed_at if current else None,
                        fresh=draw(st.booleans()))
    cfg = PolicyConfig(max_k=max_k, warmup_k=min(2, max_k), dwell_seconds=10.0,
                       hysteresis_ratio=draw(st.floats(0, 0.2)), probe_k=1)
    seconds = _step_seconds(draw(st.floats(1e-3, 0.05)), draw(st.floats(0, 1e-3)),
                            draw(st.floats(0, 0.01)))
    ctx = ClassContext(
        traffic_class="c", now=NOW, drafts=drafts, sampled_rates=rates, mean_rates=means,
        evidence=frozenset(d.name for d in drafts) if draw(st.booleans()) else frozenset(),
        change_detected=draw(st.booleans()),
        recovering=draw(st.booleans()), offline=draw(st.booleans()), override=override,
        buckets=(state,), prices=_prices(seconds, drafts, max_k),
    )
    return ctx, cfg, state


@settings(max_examples=400, deadline=None)
@given(contexts())
def test_k_within_bounds_and_draft_offered(case: tuple[ClassContext, PolicyConfig, BucketState]
                                           ) -> None:
    ctx, cfg, state = case
    d = decide_bucket(ctx, cfg, state)
    assert 0 <= d.k <= cfg.max_k
    if d.k > 0:
        spec = next(s for s in ctx.drafts if s.name == d.draft)
        assert d.k <= spec.max_k
    else:
        assert 0.0 <= d.probe_rate <= 1.0
        if d.probe_rate > 0:
            assert d.probe_draft in {s.name for s in ctx.drafts}
            assert 1 <= d.probe_k <= cfg.max_k


@settings(max_examples=400, deadline=None)
@given(contexts())
def test_overrides_win(case: tuple[ClassContext, PolicyConfig, BucketState]) -> None:
    ctx, cfg, state = case
    ov = ctx.override
    if ov is None:
        return
    d = decide_bucket(ctx, cfg, state)
    assert d.reason is Reason.OVERRIDE
    if ov.force_off or ov.pin_k == 0 or ov.force_draft == "missing":
        assert d.k == 0 and d.probe_rate == 0
    elif ov.pin_k is not None:
        spec = next(s for s in ctx.drafts if s.name == d.draft)
        assert d.k == min(ov.pin_k, cfg.max_k, spec.max_k)
    else:
        assert d.draft == ov.force_draft and d.k >= 1


@settings(max_examples=400, deadline=None)
@given(contexts(), st.floats(0, 9.99))
def test_no_flapping_inside_the_dwell_time(
    case: tuple[ClassContext, PolicyConfig, BucketState], age: float
) -> None:
    ctx, cfg, state = case
    if (state.current is None or ctx.override is not None or ctx.change_detected
            or not ctx.has_data or (ctx.offline and cfg.offline_mode == "pin_off")
            or state.current.reason in (Reason.WARMUP, Reason.OVERRIDE)):
        return
    young = BucketState(state.bucket, state.batch_size, state.current, NOW - age)
    d = decide_bucket(ctx, cfg, young)
    assert d.same_choice(state.current)


STEP_SECONDS = _step_seconds(0.02, 2e-5, 0.004)


def _ctx(rates: dict[str, list[float]], current: Decision | None, changed_at: float | None,
         step_seconds: StepSecondsFn = STEP_SECONDS, has_data: bool = True,
         **kw: object) -> tuple[ClassContext, BucketState]:
    """A context of class "c" at batch 1 on ``rates`` (sampled and mean), priced by
    ``step_seconds``; ``kw`` replaces any other field."""
    drafts = kw.get("drafts") or tuple(DraftSpec(n, DraftKind.MODEL, len(r))
                                       for n, r in rates.items())
    assert isinstance(drafts, tuple)
    arr = {n: np.array(r) for n, r in rates.items()}
    state = BucketState(0, 1, current, changed_at)
    args: dict[str, object] = {
        "traffic_class": "c", "now": NOW, "drafts": drafts, "sampled_rates": arr,
        "mean_rates": arr, "change_detected": False, "recovering": False,
        "offline": False, "override": None, "buckets": (state,),
        "prices": _prices(step_seconds, drafts, 6),
        "evidence": frozenset(d.name for d in drafts) if has_data else frozenset(),
    }
    args.update(kw)
    return ClassContext(**args), state  # type: ignore[arg-type]


CFG = PolicyConfig(max_k=6, dwell_seconds=10.0, hysteresis_ratio=0.05)


def test_picks_the_goodput_argmax() -> None:
    ctx, state = _ctx({"d": [0.9] * 6}, None, None)
    d = decide_bucket(ctx, CFG, state)
    assert (d.k, d.reason) == (6, Reason.GOODPUT) and d.expected_speedup > 2
    ctx, state = _ctx({"d": [0.05] * 6}, None, None)
    assert decide_bucket(ctx, CFG, state).k == 0


def test_hysteresis_holds_a_nearly_as_good_arm_and_yields_to_a_clearly_better_one() -> None:
    old = Decision("c", 0, "d", 5, Reason.GOODPUT)
    ctx, state = _ctx({"d": [0.9] * 6}, old, NOW - 100)  # K=6 is < 5% better than K=5
    assert decide_bucket(ctx, CFG, state).k == 5
    ctx, state = _ctx({"d": [0.9] * 6}, old, NOW - 100, recovering=True)  # margin waived
    assert decide_bucket(ctx, CFG, state).k == 6
    old = Decision("c", 0, "d", 1, Reason.GOODPUT)
    ctx, state = _ctx({"d": [0.9] * 6}, old, NOW - 100)
    assert decide_bucket(ctx, CFG, state).k == 6


def test_dwell_yields_to_a_detected_change() -> None:
    old = Decision("c", 0, "d", 6, Reason.GOODPUT)
    ctx, state = _ctx({"d": [0.05] * 6}, old, NOW - 1)
    assert decide_bucket(ctx, CFG, state).k == 6
    ctx, state = _ctx({"d": [0.05] * 6}, old, NOW - 1, change_detected=True)
    d = decide_bucket(ctx, CFG, state)
    assert (d.k, d.reason) == (0, Reason.CHANGE_DETECTED)


PROBE_CFG = PolicyConfig(max_k=6, probe_cost_max=0.02, probe_cost_floor=0.002, probe_k=2)
UNSURE = {"d": (1.0, 1.0)}  # the prior: speculation may well pay
HOPELESS = {"d": (100.0, 1900.0)}  # 0.05 over 2,000 tries: it cannot


def _probe_cost(ctx: ClassContext, d: Decision, batch: int) -> float:
    """What one probed request-step costs the class, by the same cost model and posterior means
    and independently of the policy's code: its tokens per second on the probe against off."""
    t = STEP_SECONDS(batch, "d", True, d.probe_k)
    e_probe = expected_tokens_curve(ctx.mean_rates["d"])[d.probe_k]
    return float(1.0 - e_probe / t[d.probe_k] * t[0])


def test_probing_spends_a_budget_scaled_by_the_chance_of_paying() -> None:
    """From the floor where the posterior says speculation cannot pay, toward the maximum as the
    chance that position 1 beats the break-even grows (evidence forgotten, or a recovery): the
    share probed times what a probe costs is that budget."""
    off = Decision("c", 0, "", 0, Reason.GOODPUT)
    spent, shares = [], []
    # Chances about 0, 0.3 (mean 0.2, near the break-even), 0.8 (the prior), 0.97.
    for position1 in (HOPELESS, {"d": (10.0, 40.0)}, UNSURE, {"d": (5.0, 5.0)}):
        ctx, state = _ctx({"d": [0.05] * 6}, off, NOW - 1000, position1=position1)
        d = decide_bucket(ctx, PROBE_CFG, state)
        # A batch-wide engine (the drafter runs for the step once any request probes): the
        # cheapest probe, K=1, over whole steps.
        assert (d.k, d.probe_k, d.probe_draft, d.probe_steps) == (0, 1, "d", True)
        spent.append(d.probe_rate * _probe_cost(ctx, d, state.batch_size))
        shares.append(d.probe_rate)
    assert abs(spent[0] - 0.002) < 1e-4  # the floor
    assert spent[0] < spent[1] < spent[2] <= 0.02
    # A probe here costs the class about 13% of its tokens: the budget of a likely recovery
    # (0.02 / 0.13) would probe 16% of the steps, more than the share probes may ever take.
    assert shares[2] == shares[3] == PROBE_SHARE_MAX
    assert spent[3] < 0.02


def test_a_class_on_a_deterministic_draft_probes_the_model_draft() -> None:
    """On n-gram drafts the model draft's acceptance is not measured: it is probed as while off
    (a recovery must show), less the better the n-gram drafts serve (a probe gives their tokens
    up); on the model draft itself nothing is probed."""
    drafts = (DraftSpec("d", DraftKind.MODEL, 6), DraftSpec("ngram", DraftKind.NGRAM, 6))
    probed = {}
    for ngram in (0.5, 0.9):
        rates = {"d": np.array([0.05] * 6), "ngram": np.array([ngram] * 6)}
        ctx, state = _ctx({"d": [0.05] * 6}, None, None, drafts=drafts, sampled_rates=rates,
                          mean_rates=rates, position1=HOPELESS)
        d = decide_bucket(ctx, PROBE_CFG, state)
        assert d.draft == "ngram" and d.k > 0
        assert (d.probe_draft, d.probe_k) == ("d", 1) and d.probe_rate > 0
        probed[ngram] = d.probe_rate
    assert probed[0.9] < probed[0.5]
    on_model = {"d": np.array([0.95] * 6), "ngram": np.array([0.1] * 6)}
    ctx, state = _ctx({"d": [0.95] * 6}, None, None, drafts=drafts, sampled_rates=on_model,
                      mean_rates=on_model, position1=UNSURE)
    d = decide_bucket(ctx, PROBE_CFG, state)
    assert d.draft == "d" and d.probe_rate == 0.0


def test_probing_is_sized_by_the_chance_of_paying_and_the_engine_mode() -> None:
    """Batch 32, one class: where the drafter runs only for the K asked (batch-wide engines)
    the plugin probes whole steps and the share is of steps; where the drafter runs anyway
    (per-request engines) requests probe at probe_k."""
    off = Decision("c", 0, "", 0, Reason.GOODPUT)
    batch = 32
    state = BucketState(0, batch, off, NOW - 1000)
    plans = {}
    for name, position1, sunk in (("unsure", UNSURE, False), ("hopeless", HOPELESS, False),
                                  ("unsure, per request", UNSURE, True)):
        ctx, _ = _ctx({"d": [0.05] * 6}, off, NOW - 1000, position1=position1,
                      drafter_sunk=sunk, buckets=(state,))
        plans[name] = decide_bucket(ctx, PROBE_CFG, state)
    unsure, hopeless = plans["unsure"], plans["hopeless"]
    assert unsure.probe_steps and hopeless.probe_steps
    assert unsure.probe_rate > 5 * hopeless.probe_rate  # nothing to find: the floor only
    per_request = plans["unsure, per request"]
    assert per_request.probe_k == 2 and hopeless.probe_k == 1 and not per_request.probe_steps


def test_a_probe_priced_free_stays_a_minority() -> None:
    """Where the means price the probe as no loss (K=1 pays a little, below min_speedup), the
    probe is still a probe: at most PROBE_SHARE_MAX of the class's requests."""
    flat = _step_seconds(0.02, 1e-7, 1e-7)
    off = Decision("c", 0, "", 0, Reason.GOODPUT)
    ctx, state = _ctx({"d": [0.01] * 6}, off, NOW - 1000, step_seconds=flat, position1=UNSURE)
    d = decide_bucket(ctx, PolicyConfig(max_k=6, min_speedup=1.05, probe_cost_max=1.0), state)
    assert d.k == 0 and 0 < d.probe_rate <= PROBE_SHARE_MAX


def test_the_break_even_rate_is_where_some_k_first_pays() -> None:
    seconds = np.array([1.0, 1.2, 1.4, 1.6])
    a = break_even_rate(seconds, need=1.0)
    # At K=1 the break-even of a tokens-per-second rate of 1 is 1 + a = 1.2.
    assert abs(a - 0.2) < 0.01
    assert break_even_rate(seconds, need=0.5) == 0.0
    assert break_even_rate(seconds, need=10.0) == 1.0


def test_offline_classes_are_pinned_off_or_scored_at_full_load() -> None:
    ctx, state = _ctx({"d": [0.9] * 6}, None, None, offline=True)
    d = decide_bucket(ctx, CFG, state)
    assert (d.k, d.reason, d.probe_rate) == (0, Reason.OFFLINE, 0.0)
    # In goodput mode the decision uses the largest bucket's batch even for bucket 0.
    big = BucketState(1, 256, None, None)
    compute_bound = _step_seconds(0.02, 1e-3, 0.004)
    ctx, state = _ctx({"d": [0.6] * 6}, None, None, offline=True, step_seconds=compute_bound)
    ctx = replace(ctx, buckets=(state, big))
    d = decide_bucket(ctx, PolicyConfig(max_k=6, offline_mode="goodput"), state)
    assert (d.k, d.reason) == (0, Reason.OFFLINE)
    online, _ = _ctx({"d": [0.6] * 6}, None, None, step_seconds=compute_bound)
    assert decide_bucket(online, CFG, state).k > 0


def test_warmup_before_any_data() -> None:
    ctx, state = _ctx({"d": [0.5] * 6}, None, None, has_data=False)
    d = decide_bucket(ctx, PolicyConfig(max_k=6, warmup_k=3), state)
    assert (d.draft, d.k, d.reason) == ("d", 3, Reason.WARMUP)


def test_losing_speculation_is_switched_off_without_a_margin() -> None:
    # Acceptance ~0 and verification nearly free: K=1 loses only a hair to off, less than the
    # hysteresis margin, yet it must go off.
    flat = _step_seconds(0.02, 1e-7, 0.0)
    old = Decision("c", 0, "d", 1, Reason.GOODPUT)
    ctx, state = _ctx({"d": [0.0] * 6}, old, NOW - 100, step_seconds=flat)
    assert decide_bucket(ctx, CFG, state).k == 0


def test_exploring_moves_stay_near_the_current_k_and_within_the_loss_budget() -> None:
    """The draw says K=6 (acceptance sampled 0.95), the means say K=1 (0.3): an exploring move
    from K=1 goes at most explore_max_step further and never where the means expect more than
    explore_max_loss below their best. Control: without those limits the draw's K=6 is taken."""
    current = Decision("c", 0, "d", 1, Reason.GOODPUT)
    ctx, state = _ctx({"d": [0.3] * 6}, current, NOW - 100,
                      sampled_rates={"d": np.array([0.95] * 6)})
    free = PolicyConfig(max_k=6, explore_max_step=8, explore_max_loss=1.0,
                        hysteresis_ratio=0.0)
    assert decide_bucket(ctx, free, state).k == 6  # the draw alone
    limited = PolicyConfig(max_k=6, explore_max_step=2, explore_max_loss=1.0,
                           hysteresis_ratio=0.0)
    d = decide_bucket(ctx, limited, state)
    assert (d.k, d.reason) == (3, Reason.EXPLORE)
    # The means' loss budget: none of K=2, 3 is within 0.1% of the means' best (K=1).
    tight = PolicyConfig(max_k=6, explore_max_step=2, explore_max_loss=0.001,
                         hysteresis_ratio=0.0)
    assert decide_bucket(ctx, tight, state).k == 1
