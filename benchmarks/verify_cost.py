"""What a served step costs beyond its forward pass: the LM head and the sampler, or the
rejection sampler, on the real model, in-process.

The start-up profile times each dummy step with what a served step runs after its forward pass
(``engine_plugin.profile._Verification``). This script times the two halves apart, with the
profile's own objects, on the real model (SmolLM2-135M-Instruct) in an engine configured for
suffix decoding: per (batch, K), the forward pass of B(1+K) tokens, the sampling after it
(random path: temperature 1, no top-k or top-p) and the two in one call. Repetitions alternate
the order of the shapes; medians and the spread over repetitions are reported.

    .venv/bin/python benchmarks/verify_cost.py --reps 3

Results: ``benchmarks/results/verify-cost/`` (JSON and markdown).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PARTS = ("forward", "sampling", "step")


def time_shape(runner: Any, verification: Any, batch: int, k: int) -> dict[str, float]:
    """Seconds of the forward pass, the sampling after it, and both, for ``batch`` sequences
    verifying ``k`` drafts each (the fastest of the profile's repeats)."""
    from specpilot.engine_plugin.profile import _min_seconds, _timed_step

    runner.uniform_decode_query_len = 1 + k
    forward = partial(runner._dummy_run, batch * (1 + k), uniform_decode=True,
                      force_attention=True)
    sampling = verification.prepare(batch, k)
    return {"forward": _min_seconds(forward), "sampling": _min_seconds(sampling),
            "step": _min_seconds(_timed_step(forward, sampling))}


def markdown(rows: dict[tuple[int, int], list[dict[str, float]]]) -> str:
    lines = ["| batch | K | forward ms | sampling ms | step ms | sampling share of the step "
             "| step / K=0 step |", "|---|---|---|---|---|---|---|"]
    plain = {b: statistics.median(r["step"] for r in reps)
             for (b, k), reps in rows.items() if k == 0}
    for (b, k), reps in sorted(rows.items()):
        med = {p: statistics.median(r[p] for r in reps) for p in PARTS}
        spread = [r["sampling"] * 1e3 for r in reps]
        lines.append(
            f"| {b} | {k} | {med['forward'] * 1e3:.1f} | {med['sampling'] * 1e3:.1f} "
            f"({min(spread):.1f}-{max(spread):.1f}) | {med['step'] * 1e3:.1f} "
            f"| {med['sampling'] / med['step']:.2f} | {med['step'] / plain[b]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", default="1,16,32", help="batch sizes (default 1,16,32)")
    parser.add_argument("--ks", default="0,1,2,4", help="drafts a sequence (default 0,1,2,4)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/verify-cost")
    args = parser.parse_args(argv)

    from benchmarks.demo.engine import apply_engine_env, config_session, runner_of

    apply_engine_env()  # before torch is imported: the engine's thread settings
    import torch

    from benchmarks.real.bench import select_configs
    from benchmarks.real.models import prepare_real_models
    from benchmarks.real.smollm2 import serve_dtype
    from specpilot.engine_plugin.profile import _Verification

    shapes = [(int(b), int(k)) for b in args.batches.split(",") for k in args.ks.split(",")]
    models = prepare_real_models(drafters=False)
    rows: dict[tuple[int, int], list[dict[str, float]]] = {s: [] for s in shapes}
    (config,) = select_configs(["suffix:4"])
    with config_session(config, models.target, models.draft, dtype=serve_dtype(),
                        max_model_len=2048, max_num_seqs=max(b for b, _ in shapes)) as llm:
        runner = runner_of(llm)
        saved_q = runner.uniform_decode_query_len
        try:
            with torch.inference_mode():
                verification = _Verification.of(runner)
                if verification is None:
                    parser.error("this vLLM's runner lacks the sampling internals the profile "
                                 "times; see the log line above")
                for rep in range(args.reps):
                    for i, (b, k) in enumerate(shapes[::-1] if rep % 2 else shapes):
                        rows[(b, k)].append(time_shape(runner, verification, b, k))
                        print(f"rep {rep + 1}/{args.reps} shape {i + 1}/{len(shapes)}: batch {b} "
                              f"K={k} " + ", ".join(f"{p} {v * 1e3:.1f} ms"
                                                    for p, v in rows[(b, k)][-1].items()),
                              flush=True)
        finally:
            runner.uniform_decode_query_len = saved_q
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verify-cost.json").write_text(json.dumps(
        {"reps": args.reps, "dtype": serve_dtype(),
         "shapes": [{"batch": b, "k": k, "runs": r} for (b, k), r in sorted(rows.items())]},
        indent=1))
    table = markdown(rows)
    (args.out / "verify-cost.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
