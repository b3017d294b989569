"""Soak: the controller's faults injected in a loop under load, with a real vLLM-CPU engine and the
plugin, to show the engine keeps serving exact outputs through every controller fault
(``tests/engine/test_faults.py`` runs each fault once).

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--out benchmarks/results]

One engine on the tiny target (``benchmarks.demo.tiny_models``, built once into ``--models``)
drafting with the tiny random draft at K=4, its plugin pointed through a byte-forwarding TCP
proxy at ``specpilot serve`` in a child process, kept busy by batches of eight greedy requests
whose outputs are compared with the same prompts without speculation. In turn, until the time is
up (each at least once): the controller SIGSTOPped (``--freeze-seconds``) and SIGCONTed, flooded
by ``--streams`` synthetic engines sending large valid reports as fast as they go, its stream
cut through the proxy in the middle of a report, restarted with SIGTERM, and SIGKILLed and
restarted on the same port (``benchmarks.faults`` holds the procedures). One progress line per
fault.

Every controller pins every class to K=4 with the model draft, the engine's static
configuration too, so fail-static changes nothing of the engine's work; step times under a
fault are compared with normal windows of the same length just before and after it (the
engine-core step and the scheduler's calls, timed by ``benchmarks.plugin_overhead.Recorder``).
The controller and the flood run at CPU priority ``--nice`` (19; 20: SCHED_IDLE; 0: none): on a
small machine they share the engine's cores, and the figures are meant to show what the plugin
controls, not the CPU a busy neighbour takes.

Writes soak.json (every fault's measurements, and totals by kind) and soak.md under --out. Exit
status 1 if a request failed, an output differed or a fault's checks could not complete.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.demo.engine import apply_engine_env
from benchmarks.faults import (
    FAST_SETTINGS,
    PROMPTS,
    FaultRig,
    fault_rig,
    reference_outputs,
)

ROOT = Path(__file__).resolve().parent.parent

KINDS = ("sigstop", "overload", "cut", "sigterm", "sigkill")
# Where each fault's "back to normal" time is in its result.
RECONNECT_KEYS = {
    "sigstop": "first_accepted_after_thaw_s",
    "overload": "report_accepted_after_flood_s",
    "cut": "reconnect_s",
    "sigterm": "reconnect_after_fault_s",
    "sigkill": "reconnect_after_fault_s",
}


def _summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"n": float(len(ordered)), "median": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "min": ordered[0], "max": ordered[-1]}


def _line(i: int, elapsed: float, result: dict[str, Any]) -> str:
    """One progress line for a fault."""
    kind, load = result["kind"], result.get("load", {})
    parts = [f"[{elapsed:6.0f} s] #{i:<3} {kind:<8}"]
    if "error" in result:
        return " ".join([*parts, f"ERROR {result['error']}"])
    if "ratio" in result:
        r = result["ratio"]
        parts.append(f"step median x{r.get('median_ms', float('nan')):.2f} "
                     f"p99 x{r.get('p99_ms', float('nan')):.2f} "
                     f"sched x{r.get('sched_median_ms', float('nan')):.2f}")
    parts.append(f"back in {result[RECONNECT_KEYS[kind]]:.2f} s")
    if kind == "overload":
        h = result["health_flooded"]
        parts.append(f"health p50 {h.get('p50_ms', 0):.0f} ms max {h.get('max_ms', 0):.0f} ms")
    parts.append(f"requests {load.get('completed', 0)} ok {load.get('failed', 0)} failed "
                 f"{load.get('greedy_mismatches', 0)} differ")
    return " ".join(parts)


def run_fault(rig: FaultRig, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    procedures: dict[str, Callable[[], dict[str, Any]]] = {
        "sigstop": lambda: rig.freeze(args.freeze_seconds),
        "overload": lambda: rig.flood(args.window_seconds, streams=args.streams),
        "cut": rig.cut,
        "sigterm": lambda: rig.restart(graceful=True),
        "sigkill": lambda: rig.restart(graceful=False),
    }
    started = time.monotonic()
    try:
        result = procedures[kind]()
    except Exception as exc:  # recorded; the soak goes on with a working controller
        result = {"kind": kind, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=5)}
        if not rig.controller.alive:
            rig.controller.close()
            rig.controller = rig.start_controller(rig.controller.grpc_port)
    result["took_s"] = time.monotonic() - started
    return result


def totals(events: list[dict[str, Any]], load: dict[str, Any]) -> dict[str, Any]:
    by_kind: dict[str, Any] = {}
    for kind in KINDS:
        mine = [e for e in events if e["kind"] == kind]
        ok = [e for e in mine if "error" not in e]
        entry: dict[str, Any] = {
            "count": len(mine), "errors": len(mine) - len(ok),
            "back_to_normal_s": _summary([e[RECONNECT_KEYS[kind]] for e in ok]),
            "requests_failed": sum(e["load"]["failed"] for e in ok),
            "greedy_mismatches": sum(e["load"]["greedy_mismatches"] for e in ok),
            "reports_dropped": sum(e["link"]["dropped"] for e in ok),
            "reports_shed": sum(e["link"].get("reports_shed", 0) for e in ok),
            "reports_lost_in_flight": sum(max(e["link"]["outstanding"], 0)
                                          + e["link"]["unanswered"] for e in ok),
        }
        if kind in ("sigstop", "overload"):
            for key in ("median_ms", "p99_ms", "sched_median_ms", "steps_per_second"):
                entry[f"step_ratio_{key}"] = _summary([e["ratio"][key] for e in ok
                                                       if key in e["ratio"]])
            entry["normal_median_ms"] = _summary([e["normal"]["median_ms"] for e in ok])
            entry["fault_median_ms"] = _summary([e["fault"]["median_ms"] for e in ok])
            entry["normal_p99_ms"] = _summary([e["normal"]["p99_ms"] for e in ok])
            entry["fault_p99_ms"] = _summary([e["fault"]["p99_ms"] for e in ok])
            submit = "submit_while_frozen" if kind == "sigstop" else "submit_during_flood"
            entry["submit_max_ms"] = max((e[submit]["max_ms"] for e in ok), default=0.0)
            entry["reconnects_during_fault"] = sum(e["link"]["connects"] for e in ok)
        if kind == "sigstop":
            entry["fail_static_while_frozen"] = sum(e["fail_static_while_frozen"] for e in ok)
        if kind == "overload":
            entry["health_p50_ms"] = _summary([e["health_flooded"]["p50_ms"] for e in ok])
            entry["health_max_ms"] = _summary([e["health_flooded"]["max_ms"] for e in ok])
            entry["health_not_serving"] = sum(e["health_flooded"]["checks"]
                                              - e["health_flooded"]["serving"] for e in ok)
            entry["health_quiet_p50_ms"] = _summary([e["health_quiet"]["p50_ms"] for e in ok])
            entry["flood_reports_per_second"] = _summary(
                [e["flood"]["reports_per_second"] for e in ok])
            entry["flood_reports_accepted"] = sum(e["flood"]["accepted"] for e in ok)
            entry["engine_fail_static_during_flood"] = sum(e["fail_static_during_flood"]
                                                           for e in ok)
        if kind in ("sigterm", "sigkill"):
            entry["reconnect_after_start_s"] = _summary([e["reconnect_after_start_s"]
                                                         for e in ok])
            entry["controller_start_s"] = _summary([e["controller_start_s"] for e in ok])
            entry["versions_increased"] = sum(
                e["new_version_in_force"] > e["old_version"]
                and e["new_epoch"] > e["old_epoch"] for e in ok)
        if kind == "sigkill":
            entry["fail_static_after_s"] = _summary([e["fail_static_after_s"] for e in ok])
        entry["controller_errors_logged"] = sum(
            len(e.get("errors_logged", e.get("errors_logged_by_new_controller", [])))
            for e in ok)
        by_kind[kind] = entry
    return {"faults": {k: by_kind[k]["count"] for k in KINDS}, "requests": load,
            "by_kind": by_kind}


def markdown(result: dict[str, Any]) -> str:
    def f(summary: dict[str, float], key: str = "median", fmt: str = "{:.2f}") -> str:
        return fmt.format(summary[key]) if summary else "-"

    req = result["requests"]
    rows = [
        f"Soak of {result['duration_s'] / 60:.1f} min: {req['sent']} requests, "
        f"{req['completed']} completed, {req['failed']} failed, "
        f"{req['greedy_mismatches']} greedy outputs differing.",
        "",
        "| fault | count | back to normal, s (median / max) | step median, fault/normal "
        "(median / max) | step p99, fault/normal (median) | reports dropped / lost in "
        "flight | controller ERROR lines |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, e in result["by_kind"].items():
        back = e["back_to_normal_s"]
        ratio = e.get("step_ratio_median_ms", {})
        p99 = e.get("step_ratio_p99_ms", {})
        rows.append(f"| {kind} | {e['count']} | {f(back)} / {f(back, 'max')} | "
                    f"{f(ratio)} / {f(ratio, 'max')} | {f(p99)} | {e['reports_dropped']} / "
                    f"{e['reports_lost_in_flight']} | {e['controller_errors_logged']} |")
    flood = result["by_kind"]["overload"]
    if flood["count"]:
        rows += ["", f"Health check under the flood: p50 {f(flood['health_p50_ms'], fmt='{:.0f}')}"
                 f" ms (median over floods), worst {f(flood['health_max_ms'], 'max', '{:.0f}')} "
                 f"ms, not serving {flood['health_not_serving']}; quiet p50 "
                 f"{f(flood['health_quiet_p50_ms'], fmt='{:.0f}')} ms."]
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "",
                                     prog="soak.py")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to inject faults")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--models", type=Path, default=ROOT / ".cache" / "tiny-models",
                        help="where the tiny models are (built there the first time)")
    parser.add_argument("--freeze-seconds", type=float, default=10.0,
                        help="how long each SIGSTOP lasts (and its normal windows)")
    parser.add_argument("--window-seconds", type=float, default=8.0,
                        help="how long each flood is measured (and its normal windows)")
    parser.add_argument("--streams", type=int, default=16, help="synthetic engines per flood")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--nice", type=int, default=19,
                        help="CPU priority of the controller and the flood (20: SCHED_IDLE)")
    args = parser.parse_args(argv)

    apply_engine_env()
    from benchmarks.demo.engine import llm_session
    from benchmarks.demo.tiny_models import build_tiny_models

    t0 = time.monotonic()
    print(f"specpilot soak: {args.minutes:g} min of faults ({', '.join(KINDS)}), "
          f"controller and flood at nice {args.nice}", flush=True)
    models = build_tiny_models(args.models)
    with llm_session(models.target) as plain:
        reference = reference_outputs(plain, PROMPTS, args.max_tokens)
    print(f"  reference outputs without speculation ready ({time.monotonic() - t0:.0f} s)",
          flush=True)
    events: list[dict[str, Any]] = []
    with fault_rig(models.target, models.draft, reference, max_tokens=args.max_tokens,
                   nice=args.nice) as rig:
        print(f"  engine serving, plugin connected through the proxy "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        start = time.monotonic()
        deadline = start + 60.0 * args.minutes
        i = 0
        while time.monotonic() < deadline or i < len(KINDS):
            kind = KINDS[i % len(KINDS)]
            result = run_fault(rig, kind, args)
            i += 1
            events.append(result)
            print(_line(i, time.monotonic() - start, result), flush=True)
        duration = time.monotonic() - start
        rig.load.stop()
        load = rig.load.counts().as_dict()
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}",
        "python": platform.python_version(),
        "started_unix": time.time() - (time.monotonic() - t0),
        "duration_s": duration,
        "settings": {"controller": dict(FAST_SETTINGS), "nice": args.nice,
                     "freeze_seconds": args.freeze_seconds,
                     "window_seconds": args.window_seconds, "streams": args.streams,
                     "max_tokens": args.max_tokens, "batch": len(PROMPTS), "k": 4},
        **totals(events, load),
        "events": events,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    table = markdown(result)
    (args.out / "soak.md").write_text(table)
    print(table)
    errors = sum(e["errors"] for e in result["by_kind"].values())
    bad = load["failed"] or load["greedy_mismatches"] or errors
    print(f"wrote {args.out / 'soak.json'} and soak.md; total {time.monotonic() - t0:.0f} s; "
          + ("FAILED" if bad else "no request failed, no output differed"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
