"""What short-lived engines with fresh n-gram draft names leave behind: the controller's
/metrics series, dashboard estimates (the policy part of /api/dashboard) and GetPolicy's
time (snapshot and answer, in process) before they came, while they
are within ``name_grace_seconds`` and once it passed (``ControllerCore.forget_departed``).

    python benchmarks/name_churn.py [--engines 400] [--names 13] [--grace 300]

Prints one JSON line. In process (the core and the server's own Metrics), no sockets.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np

from specpilot.contract.records import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
)
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.metrics import Metrics
from specpilot.controller.server.views import json_dumps, policy_json, policy_response
from specpilot.controller.settings import core_config, load_settings

HELLO = EngineHello(engine_id="steady", model="m", target_vocab_hash="v", max_k=4,
                    drafts=(DraftSpec("d", DraftKind.MODEL, 4, "v"),
                            DraftSpec("ngram", DraftKind.NGRAM, 4)), max_batch_size=64)


def _report(drafts: tuple[str, ...]) -> EngineReport:
    return EngineReport(sequence=1, interval_seconds=1.0, policy_version=0,
                        acceptance=tuple(AcceptanceRecord("chat", d, 2, (10, 20, 70))
                                         for d in drafts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=400)
    parser.add_argument("--names", type=int, default=13)
    parser.add_argument("--grace", type=float, default=300.0)
    parser.add_argument("--max-absent", type=int, default=64, help="max_absent_drafts")
    args = parser.parse_args()
    core = ControllerCore(core_config(load_settings(name_grace_seconds=args.grace,
                                                    max_absent_drafts=args.max_absent)),
                          np.random.default_rng(0))
    now = 0.0
    metrics = Metrics(core, lambda: now)

    def state() -> dict[str, float]:
        text = metrics.render().decode()
        series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        started = time.perf_counter()
        snap = core.snapshot(now)
        policy_response(snap)  # what GetPolicy answers
        get_policy_ms = 1e3 * (time.perf_counter() - started)
        return {"series": series, "metrics_bytes": len(text),
                "estimates": sum(len(c.estimates) for c in snap.classes),
                "dashboard_policy_bytes": len(json_dumps(policy_json(snap))),
                "get_policy_ms": round(get_policy_ms, 1)}

    core.connect_engine(HELLO, now)
    core.ingest("steady", _report(("d", "ngram")), now)
    core.decide(now)
    before = state()
    for i in range(args.engines):
        names = tuple(DraftSpec(f"ngram-{i}-{j}", DraftKind.NGRAM, 4) for j in range(args.names))
        hello = replace(HELLO, engine_id=f"brief-{i}", drafts=names)
        now += 0.1
        core.connect_engine(hello, now)
        core.ingest(hello.engine_id, _report(tuple(d.name for d in names)), now)
        core.disconnect_engine(hello.engine_id)
        core.forget_departed(now)
    within = state()
    now += args.grace
    core.forget_departed(now)
    print(json.dumps({"engines": args.engines, "names_each": args.names, "before": before,
                      "within_grace": within, "after_grace": state()}))


if __name__ == "__main__":
    main()
