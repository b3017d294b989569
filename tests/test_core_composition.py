"""What a step is priced with (specpilot.contract.pricing): the cost model's mean, whether a
new composition moved, and the numbers it refuses. The per-step re-pick on it is tested in
tests/plugin/test_compose.py."""

from __future__ import annotations

import numpy as np
import pytest

from specpilot.contract.pricing import Composition, DraftPricing, StepPricing, moved
from specpilot.controller.core.cost_model import CostPrior, StepCostModel, StepShape

# A 22 ms step, 0.1 ms a sequence, 0.02 ms a verified token (0.18 above 64), and a model draft
# of 3.9 ms a pass: the simulator's `collapse` engine.
PRICING = StepPricing(0.022, 1e-4, 2e-5, (64,), (1.6e-4,),
                      {"m": DraftPricing(0.0, 0.0039, 2e-5)})
CHAT_MODEL = (1.0, 1.75, 2.31, 2.75)  # acceptance ~0.75
CHAT_NGRAM = (1.0, 1.15, 1.17)
DOCS_NGRAM = (1.0, 1.05, 1.06)
COMP = Composition(PRICING, {("chat", "m"): CHAT_MODEL, ("chat", "ngram"): CHAT_NGRAM,
                             ("docs", "ngram"): DOCS_NGRAM, ("docs", "m"): (1.0, 1.06)}, 0.01)


def test_the_one_formula_prices_the_cost_models_mean_everywhere() -> None:
    """The formula written out from the weights by name (``StepPricing``'s fields) against every
    use of them: an engine's ``StepPricing.seconds``, the controller's mixed steps
    (``predict_mixed``, within the shapes timed: beyond them it extends the edge, as
    ``test_core_cost_model`` checks) and its fitted rows (``features`` x weights), after some
    observed steps (every column moved off its prior)."""
    model = StepCostModel((16, 64, 256), CostPrior(ridge_tokens=64), 600.0, [1, 8, 32], 4)
    model.ensure_drafts(["m", "m2"])
    rng = np.random.default_rng(1)
    for _ in range(50):
        b, k = int(rng.integers(1, 33)), int(rng.integers(0, 5))
        context = float(rng.integers(10, 1000))
        prefill = float(rng.choice([0, 0, 256, 1024]))
        shape = StepShape(b, b * (1 + k), "m" if k else "", k, b * k, context, prefill)
        model.observe(shape, 0.02 + 1e-4 * b * (1 + k) + 0.003 * k + 1e-8 * context * b * (1 + k)
                      + 5e-4 * b * (k > 0) + 2e-4 * prefill + rng.normal(0, 1e-4), 3)
    mean = model.mean
    p = mean.pricing()
    verified = np.array([4.0, 40.0, 100.0, 400.0])
    passes = {"m": np.array([0.0, 1.0, 3.0, 4.0]), "m2": np.array([2.0, 0.0, 0.0, 1.0])}
    tokens = {"m": np.array([0.0, 8.0, 48.0, 128.0]), "m2": np.array([8.0, 0.0, 0.0, 32.0])}
    drafting = {d: (x > 0).astype(float) for d, x in passes.items()}
    assert p.seconds_per_context_token > 0 and p.seconds_per_speculating_sequence > 0
    context, prefill = 300.0, 128.0
    verified[0] = 12.0  # a step without drafts: no speculating sequences
    want = (p.base_seconds + p.seconds_per_sequence * 12.0 + p.seconds_per_token * verified
            + p.seconds_per_context_token * context * verified
            + p.seconds_per_speculating_sequence * 12.0 * (verified > 12.0)
            + p.seconds_per_prefill_token * prefill
            + sum(a * np.maximum(0.0, verified - knot)
                  for knot, a in zip(p.knot_tokens, p.seconds_per_token_above, strict=True))
            + sum(d.fixed_seconds * drafting[name] + d.seconds_per_pass * passes[name]
                  + d.seconds_per_token * tokens[name] for name, d in p.drafts.items()))
    assert np.allclose(p.seconds(12.0, verified, passes, tokens, context, prefill), want,
                       rtol=1e-12)
    assert mean.extent is not None
    timed = verified <= mean.extent.tokens  # the largest step observed
    decode_only = want - p.seconds_per_prefill_token * prefill  # what the policy prices
    assert np.allclose(mean.predict_mixed(12.0, verified, drafting, passes, tokens,
                                          context_tokens=context)[timed], decode_only[timed],
                       rtol=1e-12)
    for name, b, k in (("m", 1, 0), ("m", 8, 3), ("m2", 32, 4), ("m2", 64, 2)):
        row = model.features(StepShape(b, b * (1 + k), name if k else "", k, b * k, context,
                                       prefill))
        priced = p.seconds(b, np.array([b * (1.0 + k)]), {name: np.array([float(k)])},
                           {name: np.array([b * float(k)])}, context, prefill)
        assert float(row @ mean.theta) == pytest.approx(float(priced[0]), rel=1e-12)


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
    # A context slope moves prices only where the steps read context.
    attentive = Composition(StepPricing(0.022, 1e-4, 2e-5, (64,), (1.6e-4,),
                                        {"m": DraftPricing(0.0, 0.0039, 2e-5)}, 1e-7),
                            COMP.expected_tokens, 0.01)
    assert not moved(COMP, attentive, [8], 4, 0.01)
    assert moved(COMP, attentive, [8], 4, 0.01, {8: 1000.0})


def test_bad_numbers_are_refused_naming_what() -> None:
    with pytest.raises(ValueError, match="finite"):
        StepPricing(float("nan"), 0.0, 0.0, (), ())
    with pytest.raises(ValueError, match="one slope per knot"):
        StepPricing(0.02, 0.0, 0.0, (64,), ())
    with pytest.raises(ValueError, match=r"E\(K\) of \('a', 'm'\)"):
        Composition(PRICING, {("a", "m"): (1.0, float("inf"))}, 0.01)
    with pytest.raises(ValueError, match="margin"):
        Composition(PRICING, {}, -0.5)
