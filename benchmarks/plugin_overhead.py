"""Benchmark of the engine plugin's hot-path cost: scheduler time per engine step at batch 16, with
and without the plugin, measured side by side in one run on a real in-process vLLM-CPU engine.

    .venv/bin/python benchmarks/plugin_overhead.py [--repeats N] [--out benchmarks/results]

Four engines on the tiny target, each with the target as its own draft (K=4, acceptance 1.0),
``max_num_seqs=16``, live side by side in this process:

- ``base``: vLLM's own ``vllm.v1.core.sched.scheduler.Scheduler``;
- ``plugin``: ``specpilot.engine_plugin.scheduler.SpecPilotScheduler`` connected to the real
controller
  (``benchmarks.controller_thread.ControllerThread``, run in a child process as in a sidecar
  deployment, so that its server and decisions do not share this process's GIL; the plugin's own
  link thread stays here, as in production). The controller pins every class to K=4 (operator
  override), so all engines do the same work: same steps, tokens and drafts;
- ``plugin-no-ctl``: the same scheduler with no controller (static configuration, no link thread);
- ``plugin-no-ngram``: with the controller and ``SPECPILOT_PLUGIN_NGRAM_DRAFTS=false``,
  ``SUFFIX_DRAFTS=false`` (no deterministic drafts offered, so no counterfactual scoring): shows
  what that feature costs.

(``--only-controller`` keeps the first two.)

``--cut`` measures instead the token cut's price, at batch 1, 16 and 32 (``--cut-batches``): three
engines with ``max_num_seqs`` 32 and no controller, the base and the plugin twice, each plugin
with a pushed policy that pins K=4 to the drafter (no n-gram or suffix drafts): ``plugin-cut-off``
without a ``TokenCut``, ``plugin-cut-on`` with one whose calibration covers every token (P(accept)
0.7 at every position and confidence) and whose ``min_survival`` is 0, so that every drafted token
is looked up and none is cut: the same drafts, steps and verifications, the difference being the
deciding alone. The paired difference of their scheduler time per step is the cut's cost; a
second, untimed pass counts the ``cut_length`` calls per step (the check that the cut ran), and
``timeit`` prices the pure function over 32 requests x K=4. Writes plugin_overhead_cut.json and
.md.

On each engine's scheduler instance the three per-step calls (``schedule``,
``update_from_output``, ``update_draft_token_ids``) are wrapped with ``perf_counter``
accumulators (the plugin's per-step work runs inside them; ``_free_request`` runs inside
``update_from_output``), and so is the engine-core step (``step_fn`` + ``post_step``, i.e. the
in-process client's ``get_output``). ``add_request`` is timed too and reported per request. A
repetition sends 16 concurrent greedy requests (``max_tokens`` 128, ``ignore_eos``: the batch
stays 16 until all finish) to each engine in turn, in alternating order (A B C, C B A, ...).
Per repetition and engine: mean scheduler time per step and mean step time; the tables report
medians over repetitions, and the overhead as the median of the paired per-repetition
differences, in microseconds and as a percentage of the base scheduler time and of the base step
time.

A separate, untimed pass afterwards times each plugin hook (``Pilot.on_*``) and its main parts,
times one n-gram proposal at several context lengths, and, when the overhead is above either goal
(10% of the base scheduler's time, 0.5% of the base engine step; or with ``--profile``), runs
cProfile inside the hooks only. Without ``OMP_WAIT_POLICY`` set, the
script sets it to PASSIVE (see below): the same in every configuration.

Writes plugin_overhead.json and plugin_overhead.md (and plugin_overhead_profile.txt when
profiled) under --out. A benchmark, not a test: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


# libgomp's spinning worker threads fight the Python thread for 2 cores: without this, steps of the
# same work vary from ~15 ms to ~600 ms on this machine. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BASE = "base"
PLUGIN = "plugin"
PLUGIN_BARE = "plugin-no-ctl"
PLUGIN_NO_NGRAM = "plugin-no-ngram"
PILOT_CLS = "specpilot.engine_plugin.scheduler.SpecPilotScheduler"
SCHEDULERS = {BASE: "vllm.v1.core.sched.scheduler.Scheduler", PLUGIN: PILOT_CLS,
              PLUGIN_BARE: PILOT_CLS, PLUGIN_NO_NGRAM: PILOT_CLS}
# SPECPILOT_PLUGIN_* settings per configuration ("{ctl}": the controller's address). Each engine
# gets its own id: engines of one process share the default <hostname>-<pid>.
PLUGIN_ENV = {
    BASE: {},
    PLUGIN: {"controller": "{ctl}", "engine_id": "bench-plugin"},
    PLUGIN_BARE: {"controller": "", "engine_id": "bench-no-ctl"},
    PLUGIN_NO_NGRAM: {"controller": "{ctl}", "engine_id": "bench-no-ngram",
                      "ngram_drafts": "false", "suffix_drafts": "false"},
}
CUT_OFF = "plugin-cut-off"
CUT_ON = "plugin-cut-on"
CUT_CONFIGS = (BASE, CUT_OFF, CUT_ON)
CUT_BATCHES = (1, 16, 32)
CUT_ENV = {"controller": "", "ngram_drafts": "false", "suffix_drafts": "false"}
SCHEDULERS.update({CUT_OFF: PILOT_CLS, CUT_ON: PILOT_CLS})
PLUGIN_ENV.update({CUT_OFF: {**CUT_ENV, "engine_id": "bench-cut-off"},
                   CUT_ON: {**CUT_ENV, "engine_id": "bench-cut-on"}})
CUT_ACCEPT = 0.7  # the pushed calibration's P(accept), every position and confidence bucket
LABELS = {BASE: "vLLM `Scheduler` (base)",
          PLUGIN: "`SpecPilotScheduler` + controller",
          PLUGIN_BARE: "`SpecPilotScheduler`, no controller",
          PLUGIN_NO_NGRAM: "`SpecPilotScheduler` + controller, no n-gram or suffix drafts",
          CUT_OFF: "`SpecPilotScheduler`, K=4 pinned, cut off",
          CUT_ON: "`SpecPilotScheduler`, K=4 pinned, cut on (every token looked up, none cut)"}
K = 4
BATCH = 16
# Goals: the plugin's overhead at most 10% of the base scheduler's time per step and at most
# 0.5% of the base engine step.
GOAL_SCHEDULER_PERCENT = 10.0
GOAL_STEP_PERCENT = 0.5
WRAPPED_CALLS = ("schedule", "update_from_output", "update_draft_token_ids")
HOOKS = ("on_add_request", "on_schedule_start", "on_output", "after_output", "on_drafts",
         "on_free", "batch_k")
PROMPT_SEEDS = [
    "def add(a, b):\n    return a + b\n\ndef",
    "The licence grants you the right to copy, modify and distribute",
    "import os\nimport sys\nimport",
    "one two three four one two three four",
    "Permission is hereby granted, free of charge, to any person",
    "for i in range(10):\n    print(i)\n",
    "class Foo:\n    def __init__(self):\n",
    "GNU GENERAL PUBLIC LICENSE Version 3",
]


# --- the controller, in a child process ----------------------------------------------------------
def controller_child() -> None:
    """Run the real controller on loopback, pin every class to K=4, print its address, and serve
    until stdin closes."""
    from benchmarks.controller_thread import ControllerThread
    from specpilot.contract.records import Override

    ctl = ControllerThread(seed=1)
    ctl.call(lambda core: core.set_override(Override("*", pin_k=K)))
    print(ctl.target, flush=True)
    sys.stdin.read()
    ctl.stop()


def start_controller() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, __file__, "--controller-child"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    target = proc.stdout.readline().strip()
    if not target:
        proc.kill()
        raise RuntimeError("controller child did not start")
    return proc, target


# --- instrumentation -----------------------------------------------------------------------------
@dataclass
class Recorder:
    """perf_counter accumulators on one engine's scheduler and engine-core step."""

    calls: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WRAPPED_CALLS, 0.0))
    steps: list[dict[str, float]] = field(default_factory=list)
    add_request_s: float = 0.0
    add_requests: int = 0
    _in_step: float = 0.0
    _batch: int = 0
    _tokens: int = 0
    _spec: int = 0

    def reset(self) -> None:
        self.calls = dict.fromkeys(WRAPPED_CALLS, 0.0)
        self.steps = []
        self.add_request_s, self.add_requests = 0.0, 0

    def install(self, llm: Any) -> None:
        client = llm.llm_engine.engine_core
        sched = client.engine_core.scheduler
        perf = time.perf_counter

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = perf()
                out = fn(*args, **kwargs)
                dt = perf() - t0
                self.calls[name] += dt
                self._in_step += dt
                if name == "schedule":
                    self._batch = len(out.num_scheduled_tokens)
                    self._tokens = out.total_num_scheduled_tokens
                    self._spec = sum(len(v) for v in out.scheduled_spec_decode_tokens.values())
                return out
            return wrapper

        for name in WRAPPED_CALLS:
            setattr(sched, name, timed(name, getattr(sched, name)))

        add_request = sched.add_request

        def add_wrapper(request: Any) -> None:
            t0 = perf()
            add_request(request)
            self.add_request_s += perf() - t0
            self.add_requests += 1
        sched.add_request = add_wrapper

        get_output = client.get_output  # in-process: step_fn() + post_step() (drafts handed over)

        def step_wrapper() -> Any:
            self._in_step, self._batch = 0.0, 0
            t0 = perf()
            out = get_output()
            wall = perf() - t0
            if self._batch:  # a step that ran the model
                self.steps.append({"wall": wall, "sched": self._in_step, "batch": self._batch,
                                   "tokens": self._tokens, "spec": self._spec})
            return out
        client.get_output = step_wrapper


def patch_timers(targets: list[tuple[str, Any, str]], totals: dict[str, list[float]],
                 profiler: cProfile.Profile | None = None) -> Callable[[], None]:
    """Wrap ``obj.attr`` (instance attributes) with perf_counter accumulators
    ``totals[label] = [seconds, calls]``, and with ``profiler`` enabled inside them when given
    (the outermost wrapper switches it); returns a function that restores the originals."""
    perf = time.perf_counter
    depth = [0]
    saved: list[tuple[Any, str, Any, bool]] = []
    for label, obj, attr in targets:
        fn = getattr(obj, attr)
        acc = totals.setdefault(label, [0.0, 0])

        def wrapper(*args: Any, _fn: Any = fn, _acc: list[float] = acc, **kwargs: Any) -> Any:
            depth[0] += 1
            if profiler is not None and depth[0] == 1:
                profiler.enable()
            t0 = perf()
            try:
                return _fn(*args, **kwargs)
            finally:
                _acc[0] += perf() - t0
                _acc[1] += 1
                depth[0] -= 1
                if profiler is not None and depth[0] == 0:
                    profiler.disable()
        saved.append((obj, attr, fn, attr in vars(obj)))
        setattr(obj, attr, wrapper)

    def restore() -> None:
        for obj, attr, fn, own in reversed(saved):
            if own:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)
    return restore


def hook_targets(pilot: Any, inner: bool) -> list[tuple[str, Any, str]]:
    """The pilot's hooks, or (``inner``) the parts of them that matter."""
    targets = [] if inner else [(f"Pilot.{h}", pilot, h) for h in HOOKS]
    if inner:
        targets += [
            ("Pilot.on_drafts > _choice (per request)", pilot, "_choice"),
            ("Pilot.after_output > _score_counterfactual", pilot, "_score_counterfactual"),
            ("Pilot.on_output, _score_counterfactual > StatsAggregator.record_verification",
             pilot.stats, "record_verification"),
            ("Pilot.after_output > StatsAggregator.drain (report)", pilot.stats, "drain"),
            ("Pilot.after_output > ControllerLink.submit", pilot.link, "submit")]
        targets += [(f"Pilot.after_output > _score_counterfactual > {name} proposals", cf,
                     "_propose") for name, cf in pilot.counterfactual.items()]
    return targets


def proposal_cost(pilot: Any, contexts: tuple[int, ...] = (128, 512, 2048)
                  ) -> dict[str, dict[str, float]]:
    """Microseconds per deterministic proposal at several context lengths: each of the pilot's
    deterministic drafts as the pilot calls it (``propose``, on the request's own state), and an
    n-gram proposal from a context read whole (``propose_tokens``: sliced and converted)."""
    import random

    from specpilot.engine_plugin.ngram import NGRAM_DRAFT

    rng = random.Random(0)
    calls = 2000
    timed: dict[str, Any] = {name: d.propose for name, d in pilot.deterministic.items()}
    ngram = pilot.deterministic.get(NGRAM_DRAFT)
    if ngram is not None:
        timed["ngram, context read whole"] = (
            lambda _req, tokens, _prompt, k: ngram.propose_tokens(tokens, k))
    out: dict[str, dict[str, float]] = {name: {} for name in timed}
    for n in contexts:
        tokens = [rng.randrange(2000) for _ in range(n)]
        for name, propose in timed.items():
            propose(f"cost{n}", tokens, n // 2, K)  # the request's state built once
            t0 = time.perf_counter()
            for _ in range(calls):
                propose(f"cost{n}", tokens, n // 2, K)
            out[name][str(n)] = 1e6 * (time.perf_counter() - t0) / calls
    for d in pilot.deterministic.values():
        for n in contexts:
            d.finish(f"cost{n}", [], 0)
    return out


# --- driving -------------------------------------------------------------------------------------
def prompts(n: int = BATCH) -> list[str]:
    return [f"{PROMPT_SEEDS[i % len(PROMPT_SEEDS)]} # {i}" for i in range(n)]


def run_batch(llm: Any, max_tokens: int, n: int = BATCH) -> int:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate(prompts(n), sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in out)


def summarize_rep(rec: Recorder, batch: int = BATCH) -> dict[str, Any]:
    steps = rec.steps
    n = len(steps)
    return {
        "steps": n,
        "full_batch_steps": sum(1 for s in steps if s["batch"] == batch),
        "scheduled_tokens": sum(int(s["tokens"]) for s in steps),
        "spec_tokens": sum(int(s["spec"]) for s in steps),
        "sched_us_per_step": 1e6 * sum(s["sched"] for s in steps) / n,
        "step_us_per_step": 1e6 * sum(s["wall"] for s in steps) / n,
        "sched_us_median_step": 1e6 * statistics.median(s["sched"] for s in steps),
        "calls_us_per_step": {k: 1e6 * v / n for k, v in rec.calls.items()},
        "add_request_us_per_request": 1e6 * rec.add_request_s / max(rec.add_requests, 1),
    }


def wait_connected(llm: Any, timeout: float = 30.0) -> None:
    """Until the plugin runs the controller's policy (a pinned K=4 with the target draft)."""
    pilot = llm.llm_engine.engine_core.engine_core.scheduler._pilot
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pilot.link.connected and pilot.view.version:
            choice = pilot.view.choice("default", BATCH, "probe-key")
            print(f"  plugin connected: policy v{pilot.view.version}, default class -> "
                  f"draft {choice.draft!r}, K={choice.k}", flush=True)
            return
        time.sleep(0.05)
    raise RuntimeError("the plugin did not receive the controller's policy")


def q(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1] if len(values) > 1 \
        else values[0]


def analyse(reps: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    res: dict[str, Any] = {"configs": {}, "overhead": {}}
    for cfg, rows in reps.items():
        res["configs"][cfg] = {
            "sched_us_per_step": statistics.median(r["sched_us_per_step"] for r in rows),
            "step_us_per_step": statistics.median(r["step_us_per_step"] for r in rows),
            "sched_us_median_step": statistics.median(r["sched_us_median_step"] for r in rows),
            "add_request_us_per_request": statistics.median(
                r["add_request_us_per_request"] for r in rows),
            "calls_us_per_step": {c: statistics.median(r["calls_us_per_step"][c] for r in rows)
                                  for c in WRAPPED_CALLS},
            "steps_per_rep": statistics.median(r["steps"] for r in rows),
            "workload": sorted({(r["steps"], r["scheduled_tokens"], r["spec_tokens"])
                                for r in rows}),
        }
    base = reps[BASE]
    base_sched = res["configs"][BASE]["sched_us_per_step"]
    base_step = res["configs"][BASE]["step_us_per_step"]
    for cfg in reps:
        if cfg == BASE:
            continue
        diffs = [p["sched_us_per_step"] - b["sched_us_per_step"]
                 for p, b in zip(reps[cfg], base, strict=True)]
        med = statistics.median(diffs)
        res["overhead"][cfg] = {
            "us_per_step": med,
            "us_per_step_p25": q(diffs, 25),
            "us_per_step_p75": q(diffs, 75),
            "percent_of_scheduler": 100 * med / base_sched,
            "percent_of_step": 100 * med / base_step,
            "paired_diffs_us": diffs,
        }
    return res


def markdown(res: dict[str, Any], meta: dict[str, Any]) -> str:
    cfgs = res["configs"]
    lines = [
        "| configuration | scheduler us/step | schedule / update_from_output / "
        "update_draft_token_ids us | engine step ms | add_request us/req |",
        "|---|---|---|---|---|",
    ]
    for cfg, c in cfgs.items():
        calls = " / ".join(f"{c['calls_us_per_step'][k]:.0f}" for k in WRAPPED_CALLS)
        lines.append(f"| {LABELS[cfg]} | {c['sched_us_per_step']:.0f} | {calls} | "
                     f"{c['step_us_per_step'] / 1e3:.1f} | {c['add_request_us_per_request']:.0f} |")
    lines += ["", "| overhead vs base (median of paired repetitions) | us/step [p25, p75] | "
                  "% of base scheduler time | % of base engine step |", "|---|---|---|---|"]
    for cfg, o in res["overhead"].items():
        lines.append(f"| {LABELS[cfg]} | {o['us_per_step']:.0f} [{o['us_per_step_p25']:.0f}, "
                     f"{o['us_per_step_p75']:.0f}] | {o['percent_of_scheduler']:.1f}% | "
                     f"{o['percent_of_step']:.2f}% |")
    if res.get("hooks"):
        lines += ["", "| plugin hook (> part of it; parts timed in a second pass), "
                      "`SpecPilotScheduler` + controller | us/step | calls/step |", "|---|---|---|"]
        for name, h in res["hooks"].items():
            lines.append(f"| {name} | {h['us_per_step']:.1f} | {h['calls_per_step']:.1f} |")
    if res.get("proposal_us"):
        cost = "; ".join(f"{name}: " + ", ".join(f"{us:.1f} us at {n}" for n, us in by_n.items())
                         for name, by_n in res["proposal_us"].items())
        lines += ["", f"One deterministic proposal, by tokens of context (the request's own "
                      f"state, as the pilot proposes and scores): {cost}."]
    lines += ["", f"{meta['repeats']} repetitions per configuration, alternating; {BATCH} "
                  f"concurrent greedy requests x {meta['max_tokens']} tokens "
                  f"(~{cfgs[BASE]['steps_per_rep']:.0f} steps at batch {BATCH}), K={K}, "
                  f"acceptance 1.0; identical workload in every configuration: "
                  f"{'yes' if meta['same_workload'] else 'NO'}."]
    return "\n".join(lines) + "\n"


def hook_pass(llm: Any, rec: Recorder, max_tokens: int, batches: int, inner: bool,
              profiler: cProfile.Profile | None = None) -> dict[str, dict[str, float]]:
    """Time per step of the pilot's hooks (or of their parts) over ``batches`` untimed batches,
    profiled inside them when ``profiler`` is given."""
    pilot = llm.llm_engine.engine_core.engine_core.scheduler._pilot
    totals: dict[str, list[float]] = {}
    restore = patch_timers(hook_targets(pilot, inner), totals, profiler)
    rec.reset()
    try:
        for _ in range(batches):
            run_batch(llm, max_tokens)
    finally:
        restore()
    steps = max(len(rec.steps), 1)
    return {name: {"us_per_step": 1e6 * t / steps, "calls_per_step": n / steps}
            for name, (t, n) in totals.items() if n}


def start_engines(configs: Any, model: Path, spec: dict[str, Any], ctl: str, max_num_seqs: int,
                  llms: dict[str, Any], recs: dict[str, Recorder]) -> None:
    """Start one instrumented engine per configuration into ``llms``/``recs`` (filled as they
    start, so that the caller shuts down those that did), each with its SPECPILOT_PLUGIN_*
    settings; the environment as it was afterwards."""
    from benchmarks.demo.engine import make_llm

    saved_env = {k: v for k, v in os.environ.items() if k.startswith("SPECPILOT_PLUGIN_")}
    try:
        for cfg in configs:
            for k in [k for k in os.environ if k.startswith("SPECPILOT_PLUGIN_")]:
                del os.environ[k]
            for name, value in PLUGIN_ENV[cfg].items():
                os.environ[f"SPECPILOT_PLUGIN_{name.upper()}"] = value.format(ctl=ctl)
            print(f"starting engine {cfg} ({SCHEDULERS[cfg]})...", flush=True)
            llms[cfg] = make_llm(model, spec, SCHEDULERS[cfg], max_num_seqs=max_num_seqs)
            recs[cfg] = Recorder()
            recs[cfg].install(llms[cfg])
    finally:
        for k in [k for k in os.environ if k.startswith("SPECPILOT_PLUGIN_")]:
            del os.environ[k]
        os.environ.update(saved_env)


def tiny_target() -> Path:
    """The tiny target every configuration serves (built on first use), vLLM's environment set."""
    print("importing vLLM...", flush=True)
    from benchmarks.demo.engine import apply_engine_env
    from benchmarks.demo.tiny_models import build_tiny_models

    apply_engine_env()
    return build_tiny_models(Path(os.environ.get("SPECPILOT_TEST_CACHE", ROOT / ".cache"))
                             / "tiny-models").target


def run_meta(args: argparse.Namespace, t_start: float, **extra: Any) -> dict[str, Any]:
    """What a result file says about its run."""
    return {"repeats": args.repeats, "max_tokens": args.max_tokens, **extra, "k": K,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "vllm": _vllm_version(), "date": time.strftime("%Y-%m-%d"),
            "seconds": round(time.monotonic() - t_start, 1)}


def write_results(out: Path, stem: str, data: dict[str, Any], table: str) -> None:
    """``stem``.json and ``stem``.md under ``out``; the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table)
    print()
    print(table)


# --- the token cut's price -----------------------------------------------------------------------
def push_cut_policy(llm: Any, cut: bool) -> None:
    """Pin every batch bucket of the default class to K=4 of the engine's drafter, with (``cut``)
    a TokenCut that looks up every drafted token and cuts none, or none."""
    from specpilot.contract.classes import DEFAULT_CLASS
    from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
    from specpilot.contract.records import (
        CalibrationRows,
        EngineDecision,
        PolicyUpdate,
        TokenCut,
    )

    pilot = llm.llm_engine.engine_core.engine_core.scheduler._pilot
    drafter, buckets = pilot.engine.drafter, len(pilot.view.bucket_bounds) + 1
    rows = CalibrationRows(DEFAULT_CLASS, drafter, False, K,
                           (CUT_ACCEPT,) * (K * N_CONFIDENCE_BUCKETS))
    pilot.view.apply(PolicyUpdate(
        1, tuple(EngineDecision(DEFAULT_CLASS, b, drafter, K) for b in range(buckets)),
        fail_static_timeout_seconds=1e9,
        cut=TokenCut((0.0,) * buckets, (rows,)) if cut else None))


def cut_microbench(requests: int = 32, number: int = 2000) -> dict[str, float]:
    """Microseconds of the pure decision for ``requests`` requests x K drafts: each request's
    rows looked up in a ``CutTable`` and its drafts' ``cut_length`` (every token evaluated);
    the best of 5 timeit repeats."""
    import random
    import timeit

    from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
    from specpilot.contract.records import CalibrationRows, TokenCut
    from specpilot.engine_plugin.policy.cut import CutTable, cut_length

    rng = random.Random(0)
    rows = CalibrationRows("default", "draft", False, K,
                           tuple(rng.uniform(0.5, 1.0) for _ in range(K * N_CONFIDENCE_BUCKETS)))
    table = CutTable(TokenCut((0.0,), (rows,)))
    confidences = [[rng.random() for _ in range(K)] for _ in range(requests)]

    def batch() -> None:
        for conf in confidences:
            found = table.rows("default", "draft", False)
            assert found is not None
            cut_length(conf, found, 0.0)

    best = min(timeit.repeat(batch, number=number, repeat=5)) / number
    return {"requests": requests, "k": K, "us_per_batch": 1e6 * best,
            "us_per_request": 1e6 * best / requests}


def cut_calls(llm: Any, rec: Recorder, max_tokens: int, batch: int) -> float:
    """``cut_length`` calls per step over one untimed batch (the pilot's own reference to it)."""
    import specpilot.engine_plugin.pilot as pilot_module

    totals: dict[str, list[float]] = {}
    restore = patch_timers([("cut_length", pilot_module, "cut_length")], totals)
    rec.reset()
    try:
        run_batch(llm, max_tokens, batch)
    finally:
        restore()
    return totals["cut_length"][1] / max(len(rec.steps), 1)


def cut_markdown(res: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = ["| batch | scheduler us/step: base / cut off / cut on | cut on - cut off, us/step "
             "[p25, p75] | % of base scheduler | `cut_length` calls/step | engine step ms "
             "(base) | same workload |", "|---|---|---|---|---|---|---|"]
    for batch, r in res["batches"].items():
        c = r["configs"]
        sched = " / ".join(f"{c[cfg]['sched_us_per_step']:.0f}" for cfg in CUT_CONFIGS)
        d = r["cut"]
        lines.append(f"| {batch} | {sched} | {d['us_per_step']:.0f} [{d['us_per_step_p25']:.0f}"
                     f", {d['us_per_step_p75']:.0f}] | {d['percent_of_scheduler']:.1f}% | "
                     f"{r['cut_length_calls_per_step']:.1f} | "
                     f"{c[BASE]['step_us_per_step'] / 1e3:.1f} | "
                     f"{'yes' if r['same_workload'] else 'NO'} |")
    m = res["microbench"]
    lines += ["", f"The pure decision (`CutTable.rows` + `cut_length`, every token evaluated), "
                  f"timeit, best of 5: {m['us_per_batch']:.1f} us for {m['requests']} requests "
                  f"x K={m['k']} ({m['us_per_request']:.2f} us per request).", "",
              f"{meta['repeats']} repetitions per configuration and batch, alternating order; "
              f"greedy requests x {meta['max_tokens']} tokens (ignore_eos), K={K} (the target as "
              f"its own draft: acceptance 1.0), max_num_seqs {max(meta['batches'])}."]
    return "\n".join(lines) + "\n"


def cut_main(args: argparse.Namespace) -> None:
    t_start = time.monotonic()
    from benchmarks.demo.engine import shutdown_llm

    model = tiny_target()
    spec = {"model": model, "num_speculative_tokens": K}
    batches = tuple(args.cut_batches)
    llms: dict[str, Any] = {}
    recs: dict[str, Recorder] = {}
    res: dict[str, Any] = {"batches": {}}
    reps: dict[int, dict[str, list[dict[str, Any]]]] = {
        b: {c: [] for c in CUT_CONFIGS} for b in batches}
    try:
        start_engines(CUT_CONFIGS, model, spec, "", max(batches), llms, recs)
        push_cut_policy(llms[CUT_OFF], cut=False)
        push_cut_policy(llms[CUT_ON], cut=True)
        print("warm-up...", flush=True)
        for cfg in CUT_CONFIGS:
            run_batch(llms[cfg], args.max_tokens, max(batches))
        print(f"measuring: {args.repeats} repetitions x {len(batches)} batches x "
              f"{len(CUT_CONFIGS)} configurations; scheduler us/step:", flush=True)
        for i in range(args.repeats):
            order = CUT_CONFIGS if i % 2 == 0 else CUT_CONFIGS[::-1]
            for batch in batches:
                line = []
                for cfg in order:
                    recs[cfg].reset()
                    run_batch(llms[cfg], args.max_tokens, batch)
                    row = summarize_rep(recs[cfg], batch)
                    reps[batch][cfg].append(row)
                    line.append(f"{cfg} {row['sched_us_per_step']:.0f}")
                print(f"  rep {i + 1}/{args.repeats}, batch {batch}: " + ", ".join(line),
                      flush=True)
        for batch in batches:
            r = analyse(reps[batch])
            diffs = [on["sched_us_per_step"] - off["sched_us_per_step"]
                     for on, off in zip(reps[batch][CUT_ON], reps[batch][CUT_OFF], strict=True)]
            med = statistics.median(diffs)
            r["cut"] = {"us_per_step": med, "us_per_step_p25": q(diffs, 25),
                        "us_per_step_p75": q(diffs, 75), "paired_diffs_us": diffs,
                        "percent_of_scheduler":
                            100 * med / r["configs"][BASE]["sched_us_per_step"]}
            r["same_workload"] = len({json.dumps(c["workload"])
                                      for c in r["configs"].values()}) == 1
            r["cut_length_calls_per_step"] = cut_calls(llms[CUT_ON], recs[CUT_ON],
                                                       args.max_tokens, batch)
            res["batches"][batch] = r
    finally:
        for llm in llms.values():
            shutdown_llm(llm)
    res["microbench"] = cut_microbench()
    meta = run_meta(args, t_start, batches=list(batches))
    table = cut_markdown(res, meta)
    write_results(args.out, "plugin_overhead_cut",
                  {"meta": meta, "result": res, "repetitions": reps}, table)
    print(f"{meta['seconds']} s; results in {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10, help="repetitions per configuration "
                    "(default 10; use at least 5)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--only-controller", action="store_true", help="measure only the base and "
                    "the plugin with a controller (skip the no-controller and no-n-gram engines)")
    ap.add_argument("--profile", action="store_true", help="cProfile the plugin hooks even when "
                    "the overhead is within the goal")
    ap.add_argument("--cut", action="store_true", help="measure the token cut's price instead: "
                    "base, plugin with the cut off and on, at each of --cut-batches")
    ap.add_argument("--cut-batches", type=int, nargs="+", default=list(CUT_BATCHES),
                    metavar="N", help="concurrent requests per batch with --cut (default 1 16 32)")
    ap.add_argument("--controller-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.controller_child:
        controller_child()
        return
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.cut:
        if min(args.cut_batches) < 1:
            ap.error("--cut-batches: each must be >= 1")
        cut_main(args)
        return

    t_start = time.monotonic()
    from benchmarks.demo.engine import shutdown_llm

    model = tiny_target()
    spec = {"model": model, "num_speculative_tokens": K}
    print("starting the controller (child process)...", flush=True)
    ctl_proc, target = start_controller()
    configs = [BASE, PLUGIN] + ([] if args.only_controller else [PLUGIN_BARE, PLUGIN_NO_NGRAM])
    llms: dict[str, Any] = {}
    recs: dict[str, Recorder] = {}
    try:
        start_engines(configs, model, spec, target, BATCH, llms, recs)
        for cfg in configs:
            if PLUGIN_ENV[cfg].get("controller"):
                wait_connected(llms[cfg])
        print("warm-up...", flush=True)
        for cfg in configs:
            run_batch(llms[cfg], args.max_tokens)

        reps: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        print(f"measuring: {args.repeats} repetitions x {len(configs)} configurations, "
              f"alternating order; scheduler us/step:", flush=True)
        for i in range(args.repeats):
            order = configs if i % 2 == 0 else configs[::-1]
            line = []
            for cfg in order:
                recs[cfg].reset()
                run_batch(llms[cfg], args.max_tokens)
                row = summarize_rep(recs[cfg])
                reps[cfg].append(row)
                line.append(f"{cfg} {row['sched_us_per_step']:.0f}")
            print(f"  rep {i + 1}/{args.repeats}: " + ", ".join(line), flush=True)
        res = analyse(reps)

        # Where the plugin's time goes, outside the timed repetitions (the wrappers cost a little).
        print("hook breakdown (2 x 3 untimed batches)...", flush=True)
        res["hooks"] = hook_pass(llms[PLUGIN], recs[PLUGIN], args.max_tokens, 3, inner=False)
        res["hooks"].update(hook_pass(llms[PLUGIN], recs[PLUGIN], args.max_tokens, 3,
                                      inner=True))
        pilot = llms[PLUGIN].llm_engine.engine_core.engine_core.scheduler._pilot
        res["proposal_us"] = proposal_cost(pilot)
        profile_text = ""
        if args.profile or over_goal(res["overhead"][PLUGIN]):
            print("cProfile inside the plugin hooks (2 untimed batches)...", flush=True)
            profiler = cProfile.Profile()
            hook_pass(llms[PLUGIN], recs[PLUGIN], args.max_tokens, 2, False, profiler)
            buf = io.StringIO()
            stats = pstats.Stats(profiler, stream=buf)
            stats.sort_stats("tottime").print_stats(20)
            stats.sort_stats("cumulative").print_stats(20)
            profile_text = buf.getvalue().replace(str(ROOT) + "/", "")
    finally:
        for llm in llms.values():
            shutdown_llm(llm)
        if ctl_proc.stdin:
            ctl_proc.stdin.close()
        try:
            ctl_proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            ctl_proc.kill()

    workloads = {json.dumps(c["workload"]) for c in res["configs"].values()}
    meta = run_meta(args, t_start, batch=BATCH, same_workload=len(workloads) == 1)
    table = markdown(res, meta)
    write_results(args.out, "plugin_overhead", {"meta": meta, "result": res, "repetitions": reps},
                  table)
    if profile_text:
        (args.out / "plugin_overhead_profile.txt").write_text(profile_text)
        print(profile_text)
    o = res["overhead"][PLUGIN]
    verdict = "ABOVE" if over_goal(o) else "within"
    print(f"plugin overhead: {o['us_per_step']:.0f} us/step = {o['percent_of_scheduler']:.1f}% "
          f"of scheduler time, {o['percent_of_step']:.2f}% of the engine step ({verdict} the "
          f"goals: {GOAL_SCHEDULER_PERCENT:.0f}%, {GOAL_STEP_PERCENT}%); {meta['seconds']} s; "
          f"results in {args.out}")


def over_goal(overhead: dict[str, Any]) -> bool:
    return bool(overhead["percent_of_scheduler"] > GOAL_SCHEDULER_PERCENT
                or overhead["percent_of_step"] > GOAL_STEP_PERCENT)


def _vllm_version() -> str:
    from specpilot.engine_plugin.vllm_compat import vllm_version

    return vllm_version() or "unknown"


if __name__ == "__main__":
    main()
