"""The drafter tax: throughput of an all-n-gram batch in specpilot's draft-model engine relative
to a plain ``ngram:4`` engine, with the idle-drafter skip off (before) and on (after); and what
the skip's holes in the drafter's KV cache cost in later acceptance.

    .venv/bin/python benchmarks/drafter_tax.py [--models DIR] [--repeats N] [--out DIR]

Throughput: three engines live side by side in this process on the same target: ``ngram4``
(``{"method": "ngram", "num_speculative_tokens": 4}``, lookup 2..4), and specpilot's scheduler
on a draft-model engine in ``batch_max`` with every request on substituted n-gram drafts,
``skip-off`` and ``skip-on`` (``SPECPILOT_PLUGIN_SKIP_IDLE_DRAFTER``). Per repetition and batch
size (1, 16, 32) each engine in turn (order alternating) generates ``batch`` greedy requests of
``--tokens`` tokens (``ignore_eos``); tokens/s = output tokens / wall time. Ratios are per
repetition against ``ngram4`` of the same repetition, then the median.

Holes: the target as its own drafter (acceptance 1.0 with a complete KV cache), each request on
n-gram drafts for its first ``--switch`` tokens and on the model draft at K=4 afterwards; the
model draft's acceptance after the switch with the skip on against off (the n-gram phase is
identical in both: greedy outputs and n-gram drafts are, and a third run with the model draft
replaced by "off" measures it to subtract). With ``--models`` holding an ``eagle`` head (the
demo's, :mod:`benchmarks.demo.eagle`), the same for the head (``eagle_holes``).

Models: ``--models`` is a folder with ``target`` and ``draft`` (the demo's models); by default
the test cache's tiny models. Results: ``drafter_tax.json`` under ``--out``, and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 16, 32)
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "import os\nimport sys\nimport os\nimport",
    "one two three four one two three four one two",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]


def force_choice(llm: Any, choose: Callable[[Any], Any]) -> None:
    """Every request runs ``choose(request)`` (a ``Choice``, asked every step) instead of the
    policy: the choice per request replaced, and no step taken as one choice for all."""
    from specpilot.engine_plugin.policy.view import PolicyLookup

    class PerRequest(PolicyLookup):
        __slots__ = ()

        def uniform(self, classes: Any) -> None:
            return None

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pilot = scheduler._pilot
    assert pilot is not None and pilot.engine.can_substitute, "no n-gram substitution"
    per_request = PerRequest(pilot.view.static_choice, None, 0, frozenset())
    pilot._lookup = lambda batch_size: per_request
    pilot._choice = lambda req_id, lookup: choose(scheduler.requests[req_id])


@contextmanager
def engines(target: Path, draft: Path) -> Iterator[dict[str, Any]]:
    from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment
    from specpilot.engine_plugin.ngram import NGRAM_DRAFT
    from specpilot.engine_plugin.policy.view import Choice

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    draft_spec = {"model": draft, "num_speculative_tokens": 4}
    all_ngram = Choice(NGRAM_DRAFT, 4, False)
    with ExitStack() as stack:
        out = {"ngram4": stack.enter_context(llm_session(target, ngram, max_num_seqs=32))}
        for name, skip in (("skip-off", "false"), ("skip-on", "true")):
            with plugin_environment({"k_mode": "batch_max", "skip_idle_drafter": skip}):
                llm = stack.enter_context(llm_session(target, draft_spec, SCHEDULER,
                                                      max_num_seqs=32))
            force_choice(llm, lambda request: all_ngram)
            out[name] = llm
        yield out


def run_batch(llm: Any, batch: int, tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def throughput(target: Path, draft: Path, repeats: int, tokens: int) -> dict[str, Any]:
    rates: dict[int, dict[str, list[float]]] = {b: {} for b in BATCHES}
    with engines(target, draft) as llms:
        names = list(llms)
        for llm in llms.values():
            run_batch(llm, 4, 8)  # warm-up
        for rep in range(repeats):
            order = names if rep % 2 == 0 else names[::-1]
            for batch in BATCHES:
                for name in order:
                    rates[batch].setdefault(name, []).append(run_batch(llms[name], batch, tokens))
    table: dict[str, Any] = {}
    for batch, by_name in rates.items():
        base = by_name["ngram4"]
        medians = {n: statistics.median(v) for n, v in by_name.items()}
        row: dict[str, Any] = {"tokens_per_s": medians}
        for name in ("skip-off", "skip-on"):
            ratios = [x / b for x, b in zip(by_name[name], base, strict=True)]
            row[f"{name}_vs_ngram4"] = statistics.median(ratios)
            row[f"{name}_vs_ngram4_range"] = [min(ratios), max(ratios)]
        table[str(batch)] = row
    return table


def drafted_accepted(llm: Any) -> tuple[int, int]:
    """vLLM's cumulative (draft tokens, accepted tokens)."""
    m = {x.name: int(getattr(x, "value", 0)) for x in llm.get_metrics()}
    return m["vllm:spec_decode_num_draft_tokens"], m["vllm:spec_decode_num_accepted_tokens"]


def holes(target: Path, switch: int, tokens: int, spec: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    """The model draft's acceptance after ``switch`` n-gram tokens, with the skip on and off.
    ``spec``: the drafter (default: the target drafting for itself, acceptance 1.0)."""
    from vllm import SamplingParams

    from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment
    from specpilot.engine_plugin.ngram import NGRAM_DRAFT
    from specpilot.engine_plugin.policy.view import Choice

    spec = spec or {"model": target, "num_speculative_tokens": 4}
    later = {"draft": Choice(Path(spec["model"]).name, 4, False),
             "off": Choice(NGRAM_DRAFT, 0, False)}
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    counts: dict[str, tuple[int, int]] = {}
    for name, skip, after in (("skip-on", "true", "draft"), ("skip-off", "false", "draft"),
                              ("ngram-phase", "true", "off")):
        then = later[after]
        with plugin_environment({"k_mode": "batch_max", "skip_idle_drafter": skip}), \
                llm_session(target, spec, SCHEDULER) as llm:
            def choose(request: Any, then: Choice = then) -> Choice:
                return Choice(NGRAM_DRAFT, 4, False) if request.num_output_tokens < switch else then

            force_choice(llm, choose)
            drafted0, accepted0 = drafted_accepted(llm)
            llm.generate(prompts, params, use_tqdm=False)
            drafted1, accepted1 = drafted_accepted(llm)
            counts[name] = (drafted1 - drafted0, accepted1 - accepted0)
    phase_drafted, phase_accepted = counts["ngram-phase"]
    result: dict[str, Any] = {"switch_after_tokens": switch, "tokens": tokens}
    for name in ("skip-on", "skip-off"):
        drafted = counts[name][0] - phase_drafted
        accepted = counts[name][1] - phase_accepted
        result[name] = accepted / drafted if drafted else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=None,
                        help="folder with target/ and draft/ (default: the tiny test models)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--switch", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    from benchmarks.demo.engine import apply_engine_env

    apply_engine_env()
    if args.models is None:
        from benchmarks.demo.tiny_models import build_tiny_models

        cache = Path(os.environ.get("SPECPILOT_TEST_CACHE") or ROOT / ".cache")
        tiny = build_tiny_models(cache / "tiny-models")
        target, draft = Path(tiny.target), Path(tiny.draft)
    else:
        target, draft = args.models / "target", args.models / "draft"
    result: dict[str, Any] = {
        "target": str(target), "draft": str(draft), "repeats": args.repeats,
        "throughput": throughput(target, draft, args.repeats, args.tokens),
        "holes": holes(target, args.switch, args.tokens)}
    eagle = args.models / "eagle" if args.models is not None else None
    if eagle is not None and (eagle / "config.json").exists():
        # The EAGLE head (benchmarks.demo.eagle) needs the target's hidden states of every
        # position; a skipped step leaves those positions out of its KV cache.
        result["eagle_holes"] = holes(target, args.switch, args.tokens, {
            "method": "eagle", "model": str(eagle), "num_speculative_tokens": 4})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter_tax.json").write_text(json.dumps(result, indent=2))
    print("\nbatch | ngram4 tok/s | skip-off tok/s | skip-on tok/s | off/ngram4 | on/ngram4")
    for batch, row in result["throughput"].items():
        t = row["tokens_per_s"]
        print(f"{batch:>5} | {t['ngram4']:12.1f} | {t['skip-off']:14.1f} | {t['skip-on']:13.1f}"
              f" | {row['skip-off_vs_ngram4']:10.3f} | {row['skip-on_vs_ngram4']:9.3f}"
              f"   (ranges {row['skip-off_vs_ngram4_range']}, {row['skip-on_vs_ngram4_range']})")
    print(f"model-draft acceptance after {args.switch} n-gram tokens: {result['holes']}")
    if "eagle_holes" in result:
        print(f"EAGLE head acceptance after {args.switch} n-gram tokens: "
              f"{result['eagle_holes']}")


if __name__ == "__main__":
    main()
