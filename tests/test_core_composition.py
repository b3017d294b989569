"""Per-step arms from the step's classes and counts (specpilot.contract.pricing)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.cost_model import CostPrior, StepCostModel, StepShape
from specpilot.contract.pricing import (
    OFF,
    Arm,
    Composition,
    DraftPricing,
    StepComposer,
    StepPricing,
    adjustable,
    moved,
    step_arms,
)
from specpilot.contract.records import Reason

# A 22 ms step, 0.1 ms a sequence, 0.02 ms a verified token (0.18 above 64), and a model draft
# of 3.9 ms a pass: the simulator's `collapse` engine.
PRICING = StepPricing(0.022, 1e-4, 2e-5, (64,), (1.6e-4,),
                      {"m": DraftPricing(0.0, 0.0039, 2e-5)})
CHAT_MODEL = (1.0, 1.75, 2.31, 2.75)  # acceptance ~0.75
CHAT_NGRAM = (1.0, 1.15, 1.17)
DOCS_NGRAM = (1.0, 1.05, 1.06)
COMP = Composition(PRICING, {("chat", "m"): CHAT_MODEL, ("chat", "ngram"): CHAT_NGRAM,
                             ("docs", "ngram"): DOCS_NGRAM, ("docs", "m"): (1.0, 1.06)}, 0.01)


def rate(comp: Composition, counts: dict[str, int], arms: dict[str, Arm], batch: int) -> float:
    """The step's tokens per second, written out independently of step_arms."""
    tokens = sum(n * comp.expected(c, arms[c]) for c, n in counts.items())
    verified = sum(n * (1 + arms[c][1]) for c, n in counts.items())
    passes: dict[str, float] = {}
    dtok: dict[str, float] = {}
    for c, n in counts.items():
        d, k = arms[c]
        if k and d in comp.pricing.drafts:
            passes[d] = max(passes.get(d, 0), k)
            dtok[d] = dtok.get(d, 0) + n * k
    seconds = comp.pricing.seconds(batch, np.array([float(verified)]),
                                   {d: np.array([float(p)]) for d, p in passes.items()},
                                   {d: np.array([float(x)]) for d, x in dtok.items()})
    return tokens / float(seconds[0])


def test_a_minority_class_leaves_the_drafter_it_would_pay_alone() -> None:
    """Chat decided on the model draft at K=2 (right for the mix the controller expects).
    With documents off, a step of two chat requests among eight pays the drafter's two passes
    for four extra tokens: n-gram drafts win there; a step of six chat requests keeps the
    model draft (at the K that pays for six)."""
    arms = {"chat": ("m", 2), "docs": OFF}
    few = step_arms(COMP, {"chat": 1, "docs": 7}, arms, {"chat", "docs"}, 8)
    assert few["chat"][0] == "ngram"
    many = step_arms(COMP, {"chat": 6, "docs": 2}, arms, {"chat", "docs"}, 8)
    assert many["chat"][0] == "m"
    assert rate(COMP, {"chat": 1, "docs": 7}, few, 8) > 1.01 * rate(
        COMP, {"chat": 1, "docs": 7}, arms, 8)


def test_a_pass_paid_by_another_class_is_taken_free() -> None:
    """Documents on n-gram K=1 while chat runs the model draft at K=3 in the step: a model
    draft of K=1 for documents costs only its verified tokens, as n-gram K=1 does; either may
    stand, but documents never take more passes than the step already runs."""
    got = step_arms(COMP, {"chat": 4, "docs": 4}, {"chat": ("m", 3), "docs": ("ngram", 1)},
                    {"docs"}, 8)
    assert got["chat"] == ("m", 3)  # not free: kept
    assert got["docs"][1] <= 3


def test_classes_not_free_and_gains_below_the_margin_keep_their_decisions() -> None:
    arms = {"chat": ("m", 2), "docs": OFF}
    counts = {"chat": 1, "docs": 7}
    assert step_arms(COMP, counts, arms, {"docs"}, 8)["chat"] == ("m", 2)
    gain = rate(COMP, counts, step_arms(COMP, counts, arms, {"chat"}, 8), 8) / rate(
        COMP, counts, arms, 8) - 1.0
    assert gain > 0.01
    strict = Composition(COMP.pricing, COMP.expected_tokens, gain + 0.01)
    assert step_arms(strict, counts, arms, {"chat"}, 8) == arms  # the control: margin binds
    # A decision on a draft the composition has no curve for cannot be priced: it stands.
    odd = {"chat": ("other", 2), "docs": OFF}
    assert step_arms(COMP, counts, odd, {"chat"}, 8) == odd


@st.composite
def cases(draw: st.DrawFn) -> tuple[Composition, dict[str, int], dict[str, Arm], set[str], int]:
    classes = ["a", "b", "c"][: draw(st.integers(1, 3))]
    curves: dict[tuple[str, str], tuple[float, ...]] = {}
    for c in classes:
        for d in ("m", "ngram"):
            rates = draw(st.lists(st.floats(0.0, 0.95), min_size=1, max_size=4))
            curve = [1.0]
            for r in rates:
                curve.append(curve[-1] + (curve[-1] - (curve[-2] if len(curve) > 1 else 0.0))
                             * r if len(curve) > 1 else 1.0 + r)
            curves[(c, d)] = tuple(curve)
    pricing = StepPricing(draw(st.floats(1e-3, 0.05)), draw(st.floats(0, 1e-3)),
                          draw(st.floats(0, 1e-3)), (64,), (draw(st.floats(0, 1e-3)),),
                          {"m": DraftPricing(draw(st.floats(0, 0.01)), draw(st.floats(0, 0.01)),
                                             draw(st.floats(0, 1e-4)))})
    comp = Composition(pricing, curves, draw(st.sampled_from([0.0, 0.01, 0.05])))
    counts = {c: draw(st.integers(0, 20)) for c in classes}
    arms = {}
    for c in classes:
        options = [OFF] + [(d, k) for d in ("m", "ngram") for k in range(1, len(curves[(c, d)]))]
        arms[c] = draw(st.sampled_from(options))
    free = {c for c in classes if draw(st.booleans())}
    return comp, counts, arms, free, max(1, sum(counts.values()))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_a_repick_beats_the_decisions_by_the_margin_or_keeps_them(
        case: tuple[Composition, dict[str, int], dict[str, Arm], set[str], int]) -> None:
    comp, counts, arms, free, batch = case
    got = step_arms(comp, counts, arms, free, batch)
    assert got.keys() == arms.keys()
    assert all(got[c] == arms[c] for c in arms if c not in free or not counts[c])
    live = {c: n for c, n in counts.items() if n}
    if got != arms:
        assert rate(comp, live, got, batch) >= (1 + comp.margin) * rate(comp, live, arms,
                                                                          batch) * (1 - 1e-9)
        # Coordinate ascent's end: no free class gains alone.
        for c in free & live.keys():
            for arm in [OFF] + [(d, k) for d in ("m", "ngram")
                                for k in range(1, len(comp.expected_tokens[(c, d)]))]:
                other = {**got, c: arm}
                assert rate(comp, live, other, batch) <= rate(comp, live, got, batch) * (
                    1 + 1e-6)


def test_two_free_classes_reach_the_best_joint_arms_on_the_collapse_engine() -> None:
    """Against exhaustive search over both classes' arms, for every count split of eight."""
    options = {c: [OFF] + [(d, k) for d in ("m", "ngram")
                           for k in range(1, len(COMP.expected_tokens.get((c, d), (1.0,))))
                           if (c, d) in COMP.expected_tokens] for c in ("chat", "docs")}
    arms = {"chat": ("m", 2), "docs": ("ngram", 1)}
    for n_chat in range(1, 8):
        counts = {"chat": n_chat, "docs": 8 - n_chat}
        best = max(rate(COMP, counts, dict(zip(("chat", "docs"), pair, strict=True)), 8)
                   for pair in itertools.product(options["chat"], options["docs"]))
        got = step_arms(COMP, counts, arms, {"chat", "docs"}, 8)
        assert rate(COMP, counts, got, 8) >= 0.995 * best


def test_the_composer_sums_classes_by_decision_and_searches_each_step_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two classes on one decision (folded, or on the default) count as that decision's; the
    answer is what step_arms re-picks, nothing where the decisions stand or none is free; a
    step seen before is answered from memory until the memory is full."""
    import specpilot.contract.pricing as composition

    calls: list[dict[str, int]] = []

    def counted(comp: Composition, counts: dict[str, int], *rest: object) -> dict[str, Arm]:
        calls.append(dict(counts))
        return step_arms(comp, counts, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(composition, "step_arms", counted)
    composer = StepComposer(COMP, cache_size=2)
    arms = {"chat": ("m", 2), "docs": OFF}
    lone = [("chat", arms["chat"], True, 1), ("docs", OFF, True, 3), ("docs", OFF, True, 4)]
    want = step_arms(COMP, {"chat": 1, "docs": 7}, arms, {"chat", "docs"}, 8)
    got = composer.repick(lone, 8)
    assert got == {c: a for c, a in want.items() if a != arms[c]} and got["chat"][0] == "ngram"
    assert calls == [{"chat": 1, "docs": 7}]
    assert composer.repick(lone, 8) == got and len(calls) == 1  # from memory
    crowd = [("chat", arms["chat"], True, 6), ("docs", OFF, True, 2)]
    assert composer.repick(crowd, 8).get("chat", arms["chat"])[0] == "m"  # six share passes
    assert composer.repick([("chat", arms["chat"], False, 1), ("docs", OFF, False, 7)], 8) == {}
    assert len(calls) == 2  # nothing free: no search
    composer.repick([("chat", arms["chat"], True, 2), ("docs", OFF, True, 6)], 8)
    assert composer.repick(lone, 8) == got and len(calls) == 4  # memory full: forgotten


def test_step_pricing_is_the_cost_models_mean() -> None:
    """``PricedCosts.pricing`` against ``predict_mixed`` of the same weights, after some
    observed steps (every column moved off its prior)."""
    model = StepCostModel((16, 64, 256), CostPrior(ridge_tokens=64), 600.0, [1, 8, 32], 4)
    model.ensure_drafts(["m", "m2"])
    rng = np.random.default_rng(1)
    for _ in range(50):
        b, k = int(rng.integers(1, 33)), int(rng.integers(0, 5))
        shape = StepShape(b, b * (1 + k), "m" if k else "", k, b * k)
        model.observe(shape, 0.02 + 1e-4 * b * (1 + k) + 0.003 * k + rng.normal(0, 1e-4), 3, 0.0)
    mean = model.mean
    pricing = mean.pricing()
    verified = np.array([4.0, 40.0, 100.0, 400.0])
    passes = {"m": np.array([0.0, 1.0, 3.0, 4.0]), "m2": np.array([2.0, 0.0, 0.0, 1.0])}
    tokens = {"m": np.array([0.0, 8.0, 48.0, 128.0]), "m2": np.array([8.0, 0.0, 0.0, 32.0])}
    drafting = {d: (p > 0).astype(float) for d, p in passes.items()}
    want = mean.predict_mixed(12.0, verified, drafting, passes, tokens)
    assert np.allclose(pricing.seconds(12.0, verified, passes, tokens), want, rtol=1e-12)


def test_moved_sees_curves_and_prices_not_noise() -> None:
    assert moved(None, COMP, [8], 4, 0.01) and not moved(None, None, [8], 4, 0.01)
    assert not moved(COMP, COMP, [8], 4, 0.01)
    nudged = Composition(COMP.pricing, {**COMP.expected_tokens,
                                        ("chat", "m"): (1.0, 1.751, 2.31, 2.75)}, 0.01)
    assert not moved(COMP, nudged, [8], 4, 0.01)
    shifted = Composition(COMP.pricing, {**COMP.expected_tokens,
                                         ("chat", "m"): (1.0, 1.80, 2.31, 2.75)}, 0.01)
    assert moved(COMP, shifted, [8], 4, 0.01)
    dearer = Composition(StepPricing(0.022, 1e-4, 2e-5, (64,), (1.6e-4,),
                                     {"m": DraftPricing(0.0, 0.0049, 2e-5)}),
                         COMP.expected_tokens, 0.01)
    assert moved(COMP, dearer, [8], 4, 0.01)
    fewer = Composition(COMP.pricing, {k: v for k, v in COMP.expected_tokens.items()
                                       if k[0] == "chat"}, 0.01)
    assert moved(COMP, fewer, [8], 4, 0.01)


def test_only_settled_goodput_choices_are_repicked() -> None:
    assert adjustable(Reason.GOODPUT, probing=False)
    assert not adjustable(Reason.GOODPUT, probing=True)
    for reason in (Reason.EXPLORE, Reason.WARMUP, Reason.CHANGE_DETECTED, Reason.OVERRIDE,
                   Reason.OFFLINE, None):
        assert not adjustable(reason, probing=False)


def test_bad_numbers_are_refused_naming_what() -> None:
    with pytest.raises(ValueError, match="finite"):
        StepPricing(float("nan"), 0.0, 0.0, (), ())
    with pytest.raises(ValueError, match="one slope per knot"):
        StepPricing(0.02, 0.0, 0.0, (64,), ())
    with pytest.raises(ValueError, match=r"E\(K\) of \('a', 'm'\)"):
        Composition(PRICING, {("a", "m"): (1.0, float("inf"))}, 0.01)
    with pytest.raises(ValueError, match="margin"):
        Composition(PRICING, {}, -0.5)
