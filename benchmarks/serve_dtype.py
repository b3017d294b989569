"""bfloat16 against float32 for the real model on this CPU: what ``smollm2.serve_dtype`` chooses
between, measured side by side.

An in-process engine per (repetition, dtype), the dtypes alternating in order, on the real target
(SmolLM2-135M-Instruct) and held-out ShareGPT chat prompts: the prefill of ``--batch`` prompts
(one output token each), and decode steps at batch 1 and ``--batch`` (32 tokens each, greedy,
end of sequence ignored; the prefill's time subtracted). Medians and the spread over repetitions;
the ratios are bfloat16 / float32 (above 1: bfloat16 is slower).

    .venv/bin/python benchmarks/serve_dtype.py --reps 3

Results: ``benchmarks/results/serve-dtype/`` (JSON and markdown).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DTYPES = ("bfloat16", "float32")
DECODE_TOKENS = 32
FIGURES = ("prefill_seconds", "decode_ms_batch_1", "decode_ms_batch_n")


def held_out_prompts(models: Any, count: int) -> list[Any]:
    """``count`` held-out chat prompts as token ids, whole (their real lengths)."""
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from benchmarks.real.sharegpt import HELDOUT, chat_ids

    tokenizer = AutoTokenizer.from_pretrained(models.target)
    chats = models.traffic.requests("chat", HELDOUT)[:count]
    return [TokensPrompt(prompt_token_ids=chat_ids(tokenizer, r.messages)) for r in chats]


def measure(target: Path, dtype: str, prompts: list[Any]) -> dict[str, float]:
    """The figures of one engine in ``dtype``."""
    from vllm import SamplingParams

    from benchmarks.demo.engine import llm_session

    first = SamplingParams(temperature=0.0, max_tokens=1)
    decode = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)

    def seconds(batch: list[Any], params: Any) -> float:
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started

    with llm_session(target, dtype=dtype, max_model_len=2048,
                     max_num_seqs=len(prompts), enable_prefix_caching=False) as llm:
        seconds(prompts[:1], decode)  # warm-up
        out = {"prefill_seconds": seconds(prompts, first)}
        for name, batch in (("decode_ms_batch_1", prompts[:1]), ("decode_ms_batch_n", prompts)):
            whole, prefill = seconds(batch, decode), seconds(batch, first)
            out[name] = (whole - prefill) / (DECODE_TOKENS - 1) * 1e3
    return out


def markdown(runs: dict[str, list[dict[str, float]]], batch: int) -> str:
    names = {"prefill_seconds": f"prefill of {batch} prompts (s)",
             "decode_ms_batch_1": "decode step, batch 1 (ms)",
             "decode_ms_batch_n": f"decode step, batch {batch} (ms)"}
    lines = ["| figure | " + " | ".join(DTYPES) + " | bfloat16 / float32 |",
             "|---|" + "---|" * (len(DTYPES) + 1)]
    for f in FIGURES:
        cells = []
        for d in DTYPES:
            xs = [r[f] for r in runs[d]]
            cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
        ratios = [b[f] / s[f] for b, s in zip(runs["bfloat16"], runs["float32"], strict=True)]
        lines.append(f"| {names[f]} | " + " | ".join(cells) + f" | {statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="prompts in the batch (default 16)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve-dtype")
    args = parser.parse_args(argv)

    from benchmarks.demo.engine import apply_engine_env

    apply_engine_env()  # before torch is imported: the engine's thread settings
    import torch

    from benchmarks.real.models import prepare_real_models
    from benchmarks.real.smollm2 import serve_dtype

    models = prepare_real_models(drafters=False)
    prompts = held_out_prompts(models, args.batch)
    runs: dict[str, list[dict[str, float]]] = {d: [] for d in DTYPES}
    for rep in range(args.reps):
        for dtype in DTYPES[::-1] if rep % 2 else DTYPES:
            runs[dtype].append(measure(models.target, dtype, prompts))
            print(f"rep {rep + 1}/{args.reps} {dtype}: " + ", ".join(
                f"{f} {v:.2f}" for f, v in runs[dtype][-1].items()), flush=True)
    capabilities = torch.cpu.get_capabilities()
    summary = {"reps": args.reps, "batch": args.batch, "cpu": capabilities.get("cpu_name"),
               "chosen": serve_dtype(), "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve-dtype.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = (f"CPU {capabilities.get('cpu_name')} (serve_dtype chooses {serve_dtype()}), "
             f"{args.reps} repetitions, medians (min-max):\n\n" + markdown(runs, args.batch))
    (args.out / "serve-dtype.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
