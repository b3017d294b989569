"""The distribution probe through the server: a sampled class's fixed prompt, many short
continuations at its temperature, their token ids (``return_token_ids``), to compare each
configuration's samples with no speculation's (:mod:`benchmarks.demo.distribution`)."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.real.sharegpt import TrafficRequest

PROBE_SAMPLES = 200
PROBE_TOKENS = 4
PROBE_CONCURRENCY = 8  # a small batch, where every configuration speculates


def _sample(url: str, body: dict[str, Any]) -> list[int]:
    request = urllib.request.Request(url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        data = json.loads(response.read())
    return [int(t) for t in data["choices"][0]["token_ids"]]


def sample_probe(url: str, model: str, request: TrafficRequest,
                 samples: int = PROBE_SAMPLES) -> list[list[int]]:
    """``samples`` continuations of ``PROBE_TOKENS`` tokens of ``request``'s prompt at its
    class's temperature, labelled with its class."""
    body = {"model": model, "messages": request.messages, "max_tokens": PROBE_TOKENS,
            "temperature": request.temperature, "ignore_eos": True, "return_token_ids": True,
            "vllm_xargs": {"traffic_class": request.class_name}}
    with ThreadPoolExecutor(PROBE_CONCURRENCY) as pool:
        return list(pool.map(lambda _: _sample(url, body), range(samples)))
