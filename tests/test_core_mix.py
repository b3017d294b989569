"""Batch-aware scoring: the class mix, the expected rest of a batch, and the mixed arm table."""

from __future__ import annotations

import numpy as np
import pytest

from specpilot.contract.records import DraftKind, DraftSpec
from specpilot.controller.core import mix as mix_module
from specpilot.controller.core.cost_model import CostPrior, StepCostModel
from specpilot.controller.core.mix import (
    JOINT_ARM_BUDGET,
    JOINT_MAX_FREE,
    BatchOthers,
    ClassMix,
    FloatArray,
    JointClass,
    MixedSecondsFn,
    OtherClass,
    ServedSpeedup,
    joint_arms,
)
from specpilot.controller.core.policy import BucketState, ClassContext, arm_table
from specpilot.controller.core.prices import price_steps

DRAFTS = (DraftSpec("small", DraftKind.MODEL, 6), DraftSpec("ngram", DraftKind.NGRAM, 6))


def test_mix_shares_follow_request_steps_and_forget() -> None:
    mix = ClassMix(half_life_seconds=10.0)
    assert mix.shares() == {}
    mix.observe("a", 300, now=0.0)
    mix.observe("b", 100, now=0.0)
    assert mix.shares() == {"a": 0.75, "b": 0.25}
    mix.observe("b", 150, now=10.0)  # a halves to 150, b to 50 + 150
    assert abs(mix.shares()["a"] - 150 / 350) < 1e-12


def test_expected_passes_is_the_mean_of_the_largest_k() -> None:
    # Batch of 3: two other sequences; class x (share 0.5) runs K=4, class y (share 0.5) K=2.
    o = BatchOthers.build(3, 0.0, [OtherClass(0.5, "small", True, 4, 2.5),
                                   OtherClass(0.5, "small", True, 2, 1.8)])
    p4 = 1 - 0.5**2  # some other sequence is x
    p2 = 0.5**2 * (1 - 0.5**2)  # none is x, some is y
    got = o.expected_passes("small", np.array([0.0, 3.0, 5.0]))
    want = [p4 * 4 + p2 * 2, p4 * 4 + (1 - p4) * 3, 5.0]
    assert np.allclose(got, want)
    assert o.tokens == 2 * 0.5 * 2.5 + 2 * 0.5 * 1.8
    assert np.allclose(o.expected_passes("other", np.array([2.0])), [2.0])


def _ctx(others: dict[int, BatchOthers], model: StepCostModel) -> ClassContext:
    rates = {"small": np.full(6, 0.8), "ngram": np.full(6, 0.3)}
    prices = price_steps(model.predict_curve, model.predict_mixed, DRAFTS, 6, [8], others)
    return ClassContext(
        traffic_class="c", now=0.0, drafts=DRAFTS, sampled_rates=rates, mean_rates=rates,
        change_detected=False, recovering=False, offline=False, override=None,
        buckets=(BucketState(0, 8, None, None),), prices=prices, others=others,
        evidence=frozenset({"small", "ngram"}))


def _model() -> StepCostModel:
    model = StepCostModel((32, 64, 128), CostPrior(draft_seconds_per_pass=4e-3), 60.0,
                          [1, 8, 64], 6)
    model.ensure_drafts(["small"])
    return model


def test_mixed_table_without_other_classes_is_the_homogeneous_one() -> None:
    model = _model()
    alone = BatchOthers.build(8, 1.0, [])
    ctx = _ctx({}, model)
    curves = ctx.sampled_curves
    homogeneous = arm_table(ctx, 8, curves, 6)
    mixed = arm_table(_ctx({8: alone}, model), 8, curves, 6)
    assert mixed.keys == homogeneous.keys
    assert np.allclose(mixed.step_seconds, homogeneous.step_seconds)
    assert np.allclose(mixed.goodput, homogeneous.goodput)
    assert np.allclose(mixed.speedup, homogeneous.speedup)


def test_passes_another_class_pays_for_make_longer_drafts_cheap() -> None:
    model = _model()
    ctx = _ctx({}, model)
    curves = ctx.sampled_curves
    # The other half of the batch already drafts 6 passes of the same model.
    busy = BatchOthers.build(8, 0.5, [OtherClass(0.5, "small", True, 6, 3.0)])
    quiet = BatchOthers.build(8, 0.5, [OtherClass(0.5, "", False, 0, 1.0)])
    t_busy = arm_table(_ctx({8: busy}, model), 8, curves, 6)
    t_quiet = arm_table(_ctx({8: quiet}, model), 8, curves, 6)
    k_busy = t_busy.keys[t_busy.best()]
    k_quiet = t_quiet.keys[t_quiet.best()]
    assert k_busy == ("small", 6)
    assert k_quiet[0] == "small" and k_quiet[1] < 6


def test_joint_search_escapes_where_class_by_class_moves_stall() -> None:
    """Two halves of a batch share a costly draft: alone, neither gains from a longer draft (it
    pays the extra pass by itself); together both do. The search must find the joint move."""
    model = _model()
    curve = np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(np.full(6, 0.8)))))
    curves = {"small": curve, "ngram": np.ones(7)}
    stuck = [JointClass("a", 0.5, curves, ("small", 1)), JointClass("b", 0.5, curves,
                                                                   ("small", 1))]

    def batch_rate(arms: dict[str, tuple[str, int]]) -> float:
        o = BatchOthers.build(16, 0.5, [OtherClass(0.5, arms["b"][0], True, arms["b"][1],
                                                   float(curve[arms["b"][1]]))])
        k = arms["a"][1]
        own = np.array([float(k)])
        t = model.predict_mixed(16, np.array([o.verified_tokens + o.self_count * (1 + k)]),
                                {"small": o.drafting_probability("small", own)},
                                {"small": o.expected_passes("small", own)},
                                {"small": np.array([o.draft_tokens.get("small", 0.0)
                                                    + o.self_count * k])})
        return float((o.self_count * curve[k] + o.tokens) / t[0])

    found = joint_arms(16, stuck, DRAFTS, 6, model.predict_mixed)
    assert batch_rate(found) >= max(batch_rate({"a": ("small", i), "b": ("small", j)})
                                    for i in range(1, 7) for j in range(1, 7)) * (1 - 1e-9)
    # Held classes stay where they are.
    held = [JointClass("a", 0.5, curves, ("small", 1)),
            JointClass("b", 0.5, curves, ("small", 1), free=False)]
    assert joint_arms(16, held, DRAFTS, 6, model.predict_mixed)["b"] == ("small", 1)


def _counting(model: StepCostModel, priced: list[int]) -> MixedSecondsFn:
    def seconds(batch: float, verified: FloatArray, *rest: dict[str, FloatArray]) -> FloatArray:
        priced.append(len(verified))
        return model.predict_mixed(batch, verified, *rest)
    return seconds


def test_the_joint_search_is_bounded_whatever_the_classes_and_drafts() -> None:
    # 256 classes x 16 drafts took 20-27 s a bucket on the loop that answers health checks.
    model = _model()
    drafts = (DraftSpec("small", DraftKind.MODEL, 8),
              *(DraftSpec(f"ngram-{i}", DraftKind.NGRAM, 8) for i in range(15)))
    rng = np.random.default_rng(0)
    classes = []
    for i in range(64):
        rates = rng.uniform(0.2, 0.9, size=8)
        curve = np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(rates))))
        classes.append(JointClass(f"c{i}", float(rng.uniform(0.5, 1.5)), {
            d.name: curve for d in drafts}, ("small", 2), free=i != 3))
    total = sum(c.share for c in classes)
    classes = [JointClass(c.name, c.share / total, c.curves, c.arm, c.free) for c in classes]
    priced: list[int] = []
    found = joint_arms(16, classes, drafts, 8, _counting(model, priced))
    assert set(found) == {c.name for c in classes}
    # The class priced last may pass it, and the start's batch rate is priced after.
    assert JOINT_ARM_BUDGET <= sum(priced) <= JOINT_ARM_BUDGET + 2 * (1 + 16 * 8)
    largest = [c.name for c in sorted(classes, key=lambda c: -c.share) if c.free]
    moved = {c.name for c in classes if found[c.name] != c.arm}
    assert moved and moved <= set(largest[:JOINT_MAX_FREE])  # only the largest shares move
    assert found["c3"] == ("small", 2)  # held


def test_the_bounds_do_not_bind_at_a_handful_of_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: five classes and two drafts search exactly as an unbounded search does."""
    model = _model()
    rng = np.random.default_rng(1)
    classes = []
    for i in range(5):
        curve = np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(rng.uniform(0.3, 0.9, 6)))))
        classes.append(JointClass(f"c{i}", 0.2, {"small": curve, "ngram": curve[::-1].copy()},
                                  ("", 0)))
    priced: list[int] = []
    bounded = joint_arms(16, classes, DRAFTS, 6, _counting(model, priced))
    monkeypatch.setattr(mix_module, "JOINT_ARM_BUDGET", 10**9)
    monkeypatch.setattr(mix_module, "JOINT_MAX_FREE", 10**9)
    assert joint_arms(16, classes, DRAFTS, 6, model.predict_mixed) == bounded
    assert sum(priced) < JOINT_ARM_BUDGET


def test_served_speedup_is_tokens_per_step_over_the_relative_step_time() -> None:
    served = ServedSpeedup(half_life_seconds=60.0)
    assert served.speedup("code") is None and served.tokens_per_step("code") is None
    # 100 steps, 2.5 tokens each, each step 1.25 plain steps long: 2.0x.
    served.observe("code", 100, 250, 125, now=0.0)
    assert served.tokens_per_step("code") == pytest.approx(2.5)
    assert served.speedup("code") == pytest.approx(2.0)
    # A minute later the old steps weigh half: 50 old at 2.0x, 100 new at 1.0x.
    served.observe("code", 100, 100, 100, now=60.0)
    assert served.speedup("code") == pytest.approx((125 + 100) / (62.5 + 100))
    assert served.speedup("chat") is None
