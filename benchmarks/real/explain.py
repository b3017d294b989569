"""What a running controller would answer ``ExplainDecision`` with, every few seconds: the arms
it scores for each class in each batch bucket (by posterior means) and its decision, as JSON
lines, each labelled with the run and phase the benchmark is in. Why a phase ran the K it ran
is then read off the run itself, not guessed from its totals."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import grpc


class ExplanationLog:
    """A thread polling the controller at ``target`` (host:port) every ``every_seconds`` into
    ``path`` (appended); ``label`` (the run and phase, set by the benchmark) is written with
    each line, and nothing is polled while it is empty. ``stop()`` ends it."""

    def __init__(self, target: str, path: Path, every_seconds: float) -> None:
        self.label = ""
        self._path = path
        self._every = every_seconds
        self._target = target
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="explanations")
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        from specpilot.controller.server.stubs import policy_stub
        from specpilot.v1 import policy_pb2

        self._path.parent.mkdir(parents=True, exist_ok=True)
        with grpc.insecure_channel(self._target) as channel, self._path.open("a") as out:
            stub = policy_stub(channel)
            while not self._stopped.wait(self._every):
                label = self.label
                if not label:
                    continue  # its engine is not running
                try:
                    line = snapshot(stub, policy_pb2)
                except grpc.RpcError:
                    continue  # between runs, or busy: the next poll says
                if line["classes"]:
                    out.write(json.dumps({"label": label, **line}) + "\n")
                    out.flush()


def snapshot(stub: Any, pb: Any) -> dict[str, Any]:
    """The controller's explanation of every class's decision in every bucket it measured."""
    import time

    policy = stub.GetPolicy(pb.GetPolicyRequest(), timeout=2)
    classes: dict[str, dict[str, Any]] = {}
    for c in policy.classes:
        buckets: dict[str, Any] = {}
        for bucket in policy.measured_batch_buckets:
            r = stub.ExplainDecision(pb.ExplainDecisionRequest(
                traffic_class=c.traffic_class, batch_bucket=bucket), timeout=2)
            buckets[str(bucket)] = {
                "batch_size": r.batch_size, "draft": r.decision.draft, "k": r.decision.k,
                # (draft, K, expected tokens, step ms, speedup) by posterior means
                "arms": [(a.draft, a.k, round(a.expected_tokens, 3),
                          round(a.step_seconds * 1e3, 2), round(a.speedup, 3))
                         for a in r.arms]}
        classes[c.traffic_class] = buckets
    return {"unix_seconds": time.time(), "version": policy.version, "classes": classes}
