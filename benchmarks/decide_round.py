"""What one decide round costs the controller's loop as classes and drafts grow: a full round
after every class brought new evidence, and one bucket of the joint search (what the periodic
task runs per loop turn), with the joint search's bounds (``specpilot.controller.core.mix``:
JOINT_MAX_FREE classes moved, JOINT_ARM_BUDGET arms priced) and without them, side by side.

    python benchmarks/decide_round.py [--shapes 8x2,16x16,64x16,255x16] [--unbounded-up-to 64]
                                      [--out benchmarks/results]

Writes decide_round.json and decide_round.md under --out (docs/reliability.md quotes the
table). The engine is batch-wide (the joint search runs) with one model draft and n-gram drafts
beside it; every class reports histograms for every draft. Unbounded searches are timed only up
to ``--unbounded-up-to`` classes (at 255 classes one bucket took 20-27 s). A benchmark, not a
test: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specpilot.contract.records import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    StepTimingRecord,
)
from specpilot.controller.core import mix
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.settings import core_config, load_settings

ROOT = Path(__file__).resolve().parent.parent

MAX_K = 8
RECORDS_PER_REPORT = 512
JOINT_REPEATS = 3


@contextlib.contextmanager
def unbounded() -> Iterator[None]:
    """The joint search without its bounds (as it was before them)."""
    saved = mix.JOINT_MAX_FREE, mix.JOINT_ARM_BUDGET
    mix.JOINT_MAX_FREE, mix.JOINT_ARM_BUDGET = 10**9, 10**12
    try:
        yield
    finally:
        mix.JOINT_MAX_FREE, mix.JOINT_ARM_BUDGET = saved


def loaded_core(n_classes: int, n_drafts: int) -> ControllerCore:
    """A core with one batch-wide engine and evidence for every (class, draft)."""
    core = ControllerCore(core_config(load_settings(max_classes=max(n_classes + 1, 16),
                                                    max_k=MAX_K)), np.random.default_rng(0))
    drafts = tuple(DraftSpec(f"draft-{i}", DraftKind.MODEL if i == 0 else DraftKind.NGRAM,
                             MAX_K, "v1") for i in range(n_drafts))
    core.connect_engine(EngineHello(engine_id="e1", model="m", target_vocab_hash="v1",
                                    drafts=drafts, max_k=MAX_K, batch_wide_k=True), 0.0)
    rng = np.random.default_rng(1)
    records = [AcceptanceRecord(f"class-{c:03d}", d.name, 4,
                                tuple(int(x) for x in rng.integers(1, 50, 5)))
               for c in range(n_classes) for d in drafts]
    timings = tuple(StepTimingRecord(b, "draft-0", 4, 100, 100 * 2**b, 500 * 2**b, 400 * 2**b,
                                     3.0) for b in range(4))
    for seq, i in enumerate(range(0, len(records), RECORDS_PER_REPORT), start=1):
        core.ingest("e1", EngineReport(sequence=seq, interval_seconds=1.0, policy_version=0,
                                       acceptance=tuple(records[i:i + RECORDS_PER_REPORT]),
                                       step_timings=timings, running_requests=16), now=1.0)
    return core


def measure(n_classes: int, n_drafts: int) -> dict[str, float]:
    """Seconds of a full round on new evidence, and the median of one joint bucket."""
    core = loaded_core(n_classes, n_drafts)
    t0 = time.perf_counter()
    core.decide(1.0)
    full = time.perf_counter() - t0
    joint = []
    for r in range(JOINT_REPEATS):  # each later than joint_interval_seconds: a bucket is due
        t0 = time.perf_counter()
        core.refresh_joint(10.0 + 6.0 * r, max_buckets=1)
        joint.append(time.perf_counter() - t0)
    return {"full_round_s": full, "joint_bucket_s": statistics.median(joint)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x2,16x2,16x16,64x16,255x16",
                        help="classes x drafts, comma-separated")
    parser.add_argument("--unbounded-up-to", type=int, default=64,
                        help="time the unbounded search only up to this many classes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core: the loop's
    rows = []
    for shape in args.shapes.split(","):
        n_classes, n_drafts = (int(x) for x in shape.split("x"))
        print(f"decide round: {n_classes} classes x {n_drafts} drafts, bounded ...", flush=True)
        row: dict[str, object] = {"classes": n_classes, "drafts": n_drafts,
                                  "bounded": measure(n_classes, n_drafts)}
        if n_classes <= args.unbounded_up_to:
            print("  ... unbounded", flush=True)
            with unbounded():
                row["unbounded"] = measure(n_classes, n_drafts)
        rows.append(row)
    result = {"machine": f"{platform.machine()} cpus={os.cpu_count()}",
              "python": platform.python_version(), "max_k": MAX_K,
              "joint_max_free": mix.JOINT_MAX_FREE, "joint_arm_budget": mix.JOINT_ARM_BUDGET,
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decide_round.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| classes x drafts | full round, bounded | unbounded | joint bucket, bounded | "
             "unbounded | joint speed-up |", "|---|---|---|---|---|---|"]
    for row in rows:
        b = row["bounded"]
        u = row.get("unbounded")
        assert isinstance(b, dict) and (u is None or isinstance(u, dict))
        lines.append(
            f"| {row['classes']} x {row['drafts']} | {b['full_round_s']:.3f} s | "
            + (f"{u['full_round_s']:.3f} s" if u else "not timed") + " | "
            + f"{b['joint_bucket_s'] * 1e3:.0f} ms | "
            + (f"{u['joint_bucket_s'] * 1e3:.0f} ms | "
               f"{u['joint_bucket_s'] / b['joint_bucket_s']:.1f}x |" if u else "not timed | - |"))
    table = "\n".join(lines)
    (args.out / "decide_round.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
