"""The controller's predicted step times against measured ones, per (batch, K), right after the
engine's start-up profile (issue 11: "within 10%").

    python -m benchmarks.cost_calibration [--target DIR --draft DIR] [--batches 1 16 32]
                                          [--ks 0 1 2 4] [--repeats 3]

Starts an in-process vLLM engine with the plugin (model drafter, per-request K) and a controller
on loopback. Right after the hello (the profile is in it, nothing else is known yet) it reads the
controller's predictions; then it pins each K in turn, decodes a batch of B requests, and takes the
mean step seconds of the steps with exactly B sequences from the engine's own step timings
(medians over repeats). Without --target/--draft: the demo models under .cache/demo-models if
built, else the test's tiny models. Timings on a shared machine are noisy: run it quiet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.controller_thread import ControllerThread
from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment
from controller.core.controller import ControllerCore
from controller.core.types import EngineReport, Override

_PROMPT = "def parse(line):\n    fields = line.split(',')\n    return"


def _models(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.target and args.draft:
        return Path(args.target), Path(args.draft)
    for base in (Path(".cache/demo-models"), Path("/work/main/.cache/demo-models")):
        for built in sorted(base.glob("*/demo-models.json")):
            return built.parent / "trained_target", built.parent / "draft"
    from benchmarks.demo.tiny_models import build_tiny_models

    tiny = build_tiny_models(Path(os.environ.get("SPECPILOT_TEST_CACHE", ".cache")) / "tiny-models")
    return Path(tiny.target), Path(tiny.draft)


def _pin(core: ControllerCore, k: int) -> None:
    core.clear_override("*")
    core.set_override(Override("*", pin_k=k) if k else Override("*", force_off=True))
    core.decide(time.time())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--profile-weight", type=float, default=100.0,
                   help="cost_prior_profile_weight_steps of the controller")
    args = p.parse_args(argv)
    target, draft = _models(args)
    from vllm import SamplingParams

    ctl = ControllerThread(report_interval_seconds=0.2, dwell_seconds=0.2, seed=3,
                           cost_prior_profile_weight_steps=args.profile_weight)
    timings: list[tuple[float, float, float]] = []  # (batch, mean step s, steps)

    def spy(core: ControllerCore) -> None:
        original = core.ingest

        def ingest(engine_id: str, report: EngineReport, now: float) -> Any:
            timings.extend((st.sum_batch_size / st.steps, st.sum_step_seconds / st.steps,
                            st.steps) for st in report.step_timings if st.steps)
            return original(engine_id, report, now)

        core.ingest = ingest  # type: ignore[method-assign]

    ctl.call(spy)
    spec = {"model": str(draft), "num_speculative_tokens": max(args.ks)}
    measured: dict[tuple[int, int], list[float]] = {}
    with plugin_environment({"controller": ctl.target}), llm_session(
            target, spec, SCHEDULER, max_num_seqs=max(args.batches)) as llm:
        ctl.wait_for(lambda core: bool(core.snapshot(time.time()).engines), what="hello")
        draft_name = ctl.call(lambda core: core.drafts()[0].name)
        from engine_plugin.profile import step_profile

        print("start-up profile (batch, verified tokens, passes, ms): " + ", ".join(
            f"({p.batch_size}, {p.verified_tokens}, {p.draft_passes}, {p.seconds * 1e3:.2f})"
            for p in step_profile(draft_name)))
        predicted = ctl.call(lambda core: {
            (b, k): core.predicted_step_seconds(b, draft_name if k else "", k)
            for b in args.batches for k in args.ks})
        for _ in range(args.repeats):
            for b in args.batches:
                for k in args.ks:
                    ctl.call(partial(_pin, k=k))
                    time.sleep(0.6)  # the policy reaches the engine
                    timings.clear()
                    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                            ignore_eos=True, extra_args={"traffic_class": "c"})
                    llm.generate([_PROMPT] * b, params, use_tqdm=False)
                    time.sleep(0.5)  # the last report
                    full = [(s, n) for bb, s, n in timings if abs(bb - b) < 0.5]
                    steps = sum(n for _, n in full)
                    if steps:
                        measured.setdefault((b, k), []).append(
                            sum(s * n for s, n in full) / steps)
    ctl.stop()
    print(f"target {target}, draft {draft} (per-request K: the drafter runs {max(args.ks)} "
          "passes every step)\n")
    print("| batch | K | predicted ms | measured ms (median) | error |")
    print("|---|---|---|---|---|")
    errors = []
    for (b, k), pred in sorted(predicted.items()):
        if (b, k) not in measured:
            print(f"| {b} | {k} | {pred * 1e3:.2f} | - | - |")
            continue
        m = statistics.median(measured[(b, k)])
        errors.append(abs(pred / m - 1))
        print(f"| {b} | {k} | {pred * 1e3:.2f} | {m * 1e3:.2f} | {pred / m - 1:+.1%} |")
    if errors:
        print(f"\nmedian |error| {statistics.median(errors):.1%}, max {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
