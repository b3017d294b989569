"""Engine test helpers: vLLM's spec-decode counters (from :mod:`benchmarks.demo.engine`), a log
of the engine's steps, a stand-in
n-gram matcher, and the sampled-distribution check. Engine start and stop live in
:mod:`benchmarks.demo.engine`, which the tests import directly."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from benchmarks.controller_thread import ControllerThread
from benchmarks.demo.engine import SpecCounters as SpecCounters
from benchmarks.demo.engine import engine_core_of as engine_core_of
from benchmarks.demo.engine import runner_of as runner_of
from benchmarks.demo.engine import spec_counters as spec_counters
from specpilot.contract.records import Override
from specpilot.controller.core.controller import ControllerCore
from specpilot.engine_plugin.ngram import NGRAM_DRAFT
from specpilot.engine_plugin.worker_patch import is_decode_only

if TYPE_CHECKING:
    pass


@contextmanager
def step_log(llm: Any) -> Iterator[list[tuple[bool, int, bool]]]:
    """(decode only, batch K, drafter's forward ran) per engine step."""
    runner = runner_of(llm)
    steps: list[tuple[bool, int, bool]] = []
    execute, propose = runner.execute_model, runner.drafter.propose

    def spy_execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if scheduler_output.total_num_scheduled_tokens:
            steps.append((is_decode_only(scheduler_output),
                          scheduler_output.num_spec_tokens_to_schedule, False))
        return execute(scheduler_output, *args, **kwargs)

    def spy_propose(*args: Any, **kwargs: Any) -> Any:
        steps[-1] = (*steps[-1][:2], True)
        return propose(*args, **kwargs)

    runner.execute_model, runner.drafter.propose = spy_execute, spy_propose
    try:
        yield steps
    finally:
        del runner.execute_model, runner.drafter.propose


class ModeDrafts:
    """Stands in for the n-gram matcher, whose matches the tiny target's sampled text rarely
    gives: drafts the most frequent token of each position in the target's own samples. A
    deterministic function of the context (its length), plausible enough that verification
    accepts some and rejects some: exactly the case one-hot rows must get right."""

    def __init__(self, samples: list[list[int]], prompt_len: int) -> None:
        """``samples``: the target's own generations of one prompt of ``prompt_len`` tokens."""
        self.modes = [collections.Counter(s[i] for s in samples).most_common(1)[0][0]
                      for i in range(len(samples[0]))]
        self.prompt_len = prompt_len

    name = NGRAM_DRAFT  # put in the n-gram draft's place (specpilot.engine_plugin.deterministic)

    def propose(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int
                ) -> list[int]:
        at = len(tokens) - self.prompt_len
        return self.modes[at:at + k]

    def finish(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        pass


# Code-like prompts whose greedy continuations the tiny target repeats across requests (what
# suffix and n-gram drafts match), and vLLM's suffix decoding and n-gram prompt lookup at the
# plugin's largest K.
REPEATING_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
                     "import os\nimport sys\nimport os\nimport",
                     "one two three four one two three four one two",
                     "for i in range(10):\n    print(i)\n"]
SUFFIX_SPEC = {"method": "suffix", "num_speculative_tokens": 4}
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4}


# The sampled-distribution check: N_SAMPLES continuations of SAMPLE_PROMPT, SAMPLE_TOKENS each.
N_SAMPLES = 400
SAMPLE_TOKENS = 4
SAMPLE_PROMPT = "def foo(x):"


def sampling(temperature: float, n: int, tokens: int, seed0: int = 0) -> list[Any]:
    """``n`` SamplingParams with seeds ``seed0``, ``seed0 + 1``, ... (no EOS stop)."""
    from vllm import SamplingParams

    return [SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True,
                           seed=seed0 + i) for i in range(n)]


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def samples_of(llm: Any, seed0: int = 0) -> list[list[int]]:
    """The distribution check's samples from ``llm`` at T=0.8."""
    return token_ids(llm.generate([SAMPLE_PROMPT] * N_SAMPLES,
                                  sampling(0.8, N_SAMPLES, SAMPLE_TOKENS, seed0), use_tqdm=False))


def assert_sampled_arm(llm: Any, arm: str, reference: list[list[int]], *, one_hot: bool,
                       seed0: int, monkeypatch: Any, rows: str = "n-gram") -> None:
    """Samples from ``llm`` under the policy in force are distributed as ``reference`` (the
    target's); with ``one_hot`` off (the control: deterministic ``rows`` verified against the
    drafter's probabilities) they must not be, or the check could not fail."""
    from specpilot.engine_plugin.worker_patch import mark_step

    pilot = pilot_of(llm)
    if not one_hot:
        monkeypatch.setattr(pilot, "mark_step", lambda output, batch_size: mark_step(
            output, skip_drafter=False, deterministic=()))
    before = spec_counters(llm)
    samples = samples_of(llm, seed0=seed0)
    used = spec_counters(llm) - before
    print(f"\n[{arm}] {used} acceptance={used.acceptance:.3f}")
    assert used.draft_tokens > 0
    failures = differing_positions(reference, samples)
    if one_hot:
        assert not failures, f"{arm}: sampled distribution differs from the target's: {failures}"
    else:
        assert failures, f"{arm}: the control should show the bias of unmarked {rows} rows"


def differing_positions(reference: list[list[int]], other: list[list[int]]) -> list[str]:
    """Generated positions (the first comes from the prefill's sampler) whose tokens are not
    distributed alike in the two samples."""
    from benchmarks.demo.distribution import compare_samples

    out = []
    for pos in range(1, SAMPLE_TOKENS):
        c = compare_samples([s[pos] for s in reference], [s[pos] for s in other])
        if not c.same:
            out.append(f"position {pos}: p={c.p_value:.3g} tv={c.total_variation:.3f}")
    return out


# --- a controller on loopback, steered through the core --------------------------------------
# Fast enough for tests: reports every 0.1 s, decisions may change after 0.2 s.
FAST_CONTROLLER = {"report_interval_seconds": 0.1, "dwell_seconds": 0.2, "seed": 3,
                   "fail_static_timeout_seconds": 30.0}


def pilot_of(llm: Any) -> Any:
    """The engine's pilot (the engine must run specpilot's scheduler with the plugin on)."""
    pilot = engine_core_of(llm).scheduler._pilot
    assert pilot is not None
    return pilot


def wait_for_policy(llm: Any, controller: ControllerThread, timeout: float = 20.0) -> None:
    """Until the engine runs the controller's current policy version."""
    view = pilot_of(llm).view
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if view.version and view.version == controller.call(lambda core: core.version):
            return
        time.sleep(0.05)
    raise AssertionError(f"engine did not reach the controller's policy (view {view.version})")


def set_override(controller: ControllerThread, override: Override) -> None:
    """Straight on the core, decided at once so ``core.version`` moves now; the server's
    periodic decide pushes the new version."""
    def set_(core: ControllerCore) -> None:
        core.set_override(override)
        core.decide(time.time())

    controller.call(set_)


def clear_overrides(controller: ControllerThread) -> None:
    def clear(core: ControllerCore) -> None:
        for ov in core.snapshot(time.time()).overrides:
            core.clear_override(ov.traffic_class)
            core.decide(time.time())

    controller.call(clear)


def params(traffic_class: str | None = None, max_tokens: int = 24, **kw: Any) -> Any:
    """Greedy SamplingParams, tagged with ``traffic_class`` for the plugin's classifier."""
    from vllm import SamplingParams

    extra = {"traffic_class": traffic_class} if traffic_class else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra, **kw)


def observed_acceptance(controller: ControllerThread, traffic_class: str, draft: str,
                        positions: int | None = None) -> tuple[float, float]:
    """Per-token acceptance of ``draft`` for ``traffic_class`` in the controller's evidence (the
    prior left out) over its first ``positions`` positions (all: None), and the tries behind it."""
    post = controller.call(lambda core: core.estimate(traffic_class, draft, time.time()).posterior)
    tries = float(post.effective_tries[:positions].sum())
    accepts = float((post.alpha[:positions] - post.prior_alpha).sum())
    return accepts / max(tries, 1.0), tries
