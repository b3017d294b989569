"""The client: vLLM's own serving benchmark (``vllm.benchmarks.serve.benchmark``, what
``vllm bench serve`` runs), one call per load phase, every request carrying its class in
``vllm_xargs`` and its class's temperature (per-request overrides of the benchmark's body).

The CLI's ``--dataset-name sharegpt`` path sends one temperature and one body for all requests
and drops prompts over 1,024 tokens, so the mixed classes are handed to the same benchmark
function as ``SampleRequest`` objects with their chat messages instead. Its result (the JSON
``vllm bench serve --save-result`` writes: throughput, TTFT/TPOT/ITL percentiles, per-request
lengths, latencies and texts) is kept as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
from collections.abc import Sequence
from typing import Any

from benchmarks.real.sharegpt import TrafficRequest

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50.0, 99.0)


def sample_request(request: TrafficRequest, max_tokens: int) -> Any:
    from vllm.benchmarks.datasets import SampleRequest

    return SampleRequest(
        prompt="", prompt_len=request.prompt_tokens,
        expected_output_len=min(max_tokens, request.max_tokens),
        chat_messages=list(request.messages), request_id=request.id,
        request_overrides={"vllm_xargs": {"traffic_class": request.class_name},
                           "temperature": request.temperature})


def run_phase(url: str, model: str, requests: Sequence[TrafficRequest], concurrency: int,
              max_tokens: int, tokenizer: Any) -> dict[str, Any]:
    """One load phase through vLLM's serving benchmark: ``requests`` with ``concurrency`` in
    flight, all sent at once (closed loop). Returns vLLM's result dict. ``tokenizer``: the
    target's (``vllm.tokenizers.get_tokenizer``); without one vLLM computes no TTFT, TPOT or
    ITL percentiles."""
    from vllm.benchmarks.serve import TaskType, benchmark

    samples = [sample_request(r, max_tokens) for r in requests]
    quiet = io.StringIO()  # its printed table; the figures are in the result
    with contextlib.redirect_stdout(quiet):
        result: dict[str, Any] = asyncio.run(benchmark(
            task_type=TaskType.GENERATION, endpoint_type="openai-chat",
            api_url=url + "/v1/chat/completions", base_url=url, model_id=model,
            model_name=model, tokenizer=tokenizer, input_requests=samples, logprobs=None,
            request_rate=math.inf, burstiness=1.0, disable_tqdm=True, num_warmups=0,
            profile=False, selected_percentile_metrics=list(PERCENTILE_METRICS),
            selected_percentiles=list(PERCENTILES), ignore_eos=False,
            goodput_config_dict={}, max_concurrency=concurrency, lora_modules=None,
            extra_headers=None, extra_body={}, ready_check_timeout_sec=0))
    failed = [e for e in result.get("errors", []) if e]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(samples)} requests failed; first: "
                           f"{failed[0][:300]}")
    return result
