"""Per-step arms from the step's classes and counts (specpilot.engine_plugin.policy.compose), on the
pricing of the simulator's `collapse` engine (tests.test_core_composition)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.contract.pricing import Arm, Composition, DraftPricing, StepPricing
from specpilot.contract.records import Reason
from specpilot.engine_plugin.policy.compose import OFF, StepComposer, adjustable, step_arms
from tests.test_core_composition import COMP


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
    import specpilot.engine_plugin.policy.compose as compose

    calls: list[dict[str, int]] = []

    def counted(comp: Composition, counts: dict[str, int], *rest: object) -> dict[str, Arm]:
        calls.append(dict(counts))
        return step_arms(comp, counts, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(compose, "step_arms", counted)
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


def test_only_settled_goodput_choices_are_repicked() -> None:
    assert adjustable(Reason.GOODPUT, probing=False)
    assert not adjustable(Reason.GOODPUT, probing=True)
    for reason in (Reason.EXPLORE, Reason.WARMUP, Reason.CHANGE_DETECTED, Reason.OVERRIDE,
                   Reason.OFFLINE, None):
        assert not adjustable(reason, probing=False)




def test_a_step_over_long_contexts_is_priced_at_its_own_context() -> None:
    """The same step under a pricing whose context term is large (0.5 us per context token a
    verified token attends to): at 50 tokens a sequence chat keeps the model draft's verified
    tokens at K=3; at 4,000 each verified token costs 2 ms more and chat leaves K=3 for
    fewer verified tokens. The composer prices on the step's context alike."""
    p = COMP.pricing
    comp = Composition(StepPricing(p.base_seconds, p.seconds_per_sequence, p.seconds_per_token,
                                   p.knot_tokens, p.seconds_per_token_above, p.drafts, 5e-7),
                       COMP.expected_tokens, COMP.margin)
    arms = {"chat": ("m", 3), "docs": OFF}
    counts = {"chat": 8}
    short = step_arms(comp, counts, arms, {"chat"}, 8, context_tokens=50.0)
    long = step_arms(comp, counts, arms, {"chat"}, 8, context_tokens=4000.0)
    assert short["chat"] == ("m", 3)  # the control
    assert long["chat"][1] < 3
    composer = StepComposer(comp)
    step = [("chat", ("m", 3), True, 8)]
    assert composer.repick(step, 8, 50.0) == {}
    assert composer.repick(step, 8, 4000.0) == {"chat": long["chat"]}
