"""The client: vLLM's own serving-benchmark code (``vllm.benchmarks``, what ``vllm bench serve``
runs), closed loop for a phase's wall-clock time.

vLLM's ``benchmark`` function sends a fixed list of requests and cannot stop at a time (its
ramp-up is an open-loop request rate), so a phase drives the request function it uses for each
request (``ASYNC_REQUEST_FUNCS["openai-chat"]``: the streamed chat request, its TTFT,
inter-token times and the server's token count) from ``concurrency`` clients, each sending the
phase's next request as soon as its last one finished, until the phase's time is up. vLLM's
``calculate_metrics`` then computes the phase's figures (TTFT, TPOT, ITL and end-to-end
percentiles, output lengths) and vLLM's ``fetch_spec_decode_metrics`` before and after gives
its acceptance; the result has the keys of vLLM's result JSON. Every request carries its class
in ``vllm_xargs`` and its class's temperature.

A phase ends by draining: no request starts after its time, the ones in flight run to the end
(every request sent has its whole text for the exactness check and its whole latency). Its
tokens/s counts the phase's time only: the tokens streamed before the deadline over the phase's
seconds (:func:`window_tokens`), so the drain, where fewer requests share the engine, biases
neither; vLLM's own ``output_throughput`` (all tokens over the time to the last one) is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from benchmarks.real.sharegpt import TrafficRequest

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50.0, 99.0)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Loop(Generic[T, R]):
    """A closed loop's record: the items sent, in the order they were taken, and their
    outputs; ``start``, ``deadline`` and ``end`` (the last one finished) on its clock."""

    sent: list[T]
    outputs: list[R]
    start: float
    deadline: float
    end: float


async def closed_loop(send: Callable[[int, T], Awaitable[R]], items: Iterator[T],
                      concurrency: int, seconds: float,
                      clock: Callable[[], float] = time.perf_counter) -> Loop[T, R]:
    """``concurrency`` clients, each taking the next of ``items`` and awaiting ``send(position,
    item)`` until ``seconds`` have passed; then the ones in flight finish. Positions are taken
    in order, so the items sent are a prefix of ``items``."""
    sent: list[T] = []
    outputs: dict[int, R] = {}
    start = clock()
    deadline = start + seconds

    async def client() -> None:
        while clock() < deadline:
            position = len(sent)  # taken and recorded with no await between: dense, ordered
            item = next(items)
            sent.append(item)
            outputs[position] = await send(position, item)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return Loop(sent, [outputs[i] for i in range(len(sent))], start, deadline, clock())


def window_tokens(start: float, ttft: float, itl: Sequence[float], tokens: int,
                  deadline: float) -> float:
    """How many of a request's ``tokens`` it streamed by ``deadline``: all when its last chunk
    came by then, none when its first came after, else its tokens times the share of its
    chunks that came by then (a chunk carries one engine step's tokens, one or more with
    speculation, so the share is of its steps)."""
    at = start + ttft
    if at > deadline:
        return 0.0
    chunks = arrived = 1
    for gap in itl:
        at += gap
        chunks += 1
        arrived += at <= deadline
    return tokens * arrived / chunks


def request_input(request: TrafficRequest, position: int, tag: str, url: str, model: str,
                  max_tokens: int) -> Any:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput

    return RequestFuncInput(
        prompt="", api_url=url + "/v1/chat/completions", prompt_len=request.prompt_tokens,
        output_len=min(max_tokens, request.max_tokens), model=model, model_name=model,
        # A sequence that starts over sends a request again: the engine's id stays unique.
        request_id=f"{request.id}@{tag}.{position}", chat_messages=list(request.messages),
        extra_body={"vllm_xargs": {"traffic_class": request.class_name},
                    "temperature": request.temperature})


def _spec_decode(before: Any, after: Any) -> dict[str, Any]:
    # As vLLM's benchmark reports them: the counters' growth over the phase.
    if before is None or after is None:
        return {}
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if drafted <= 0:
        return {}
    return {"spec_decode_acceptance_rate": accepted / drafted * 100,
            "spec_decode_acceptance_length": 1 + accepted / drafts if drafts > 0 else 0.0,
            "spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(drafted),
            "spec_decode_accepted_tokens": int(accepted)}


def phase_result(loop: Loop[TrafficRequest, Any], metrics: Any, output_lens: Sequence[int],
                 spec_decode: dict[str, Any]) -> dict[str, Any]:
    """vLLM's result JSON of a phase (its keys, from its metrics), with the phase's own:
    ``phase_seconds``, ``drain_seconds``, per request its id, class and ``window_output_tokens``,
    and ``window_tokens_per_second``."""
    outputs = loop.outputs
    result: dict[str, Any] = {
        "duration": loop.end - loop.start, "completed": metrics.completed,
        "failed": metrics.failed, "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": list(output_lens),
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests, **spec_decode}
    for m in PERCENTILE_METRICS:
        for stat in ("mean", "median", "std"):
            result[f"{stat}_{m}_ms"] = float(getattr(metrics, f"{stat}_{m}_ms"))
        for p, value in getattr(metrics, f"percentiles_{m}_ms"):
            result[f"p{int(p) if int(p) == p else p}_{m}_ms"] = float(value)
    window = [window_tokens(o.start_time, o.ttft, o.itl, n, loop.deadline)
              for o, n in zip(outputs, output_lens, strict=True)]
    seconds = loop.deadline - loop.start
    result.update({
        "phase_seconds": seconds, "drain_seconds": max(0.0, loop.end - loop.deadline),
        "request_ids": [r.id for r in loop.sent], "classes": [r.class_name for r in loop.sent],
        "window_output_tokens": window, "window_tokens_per_second": sum(window) / seconds})
    return result


async def _drive(url: str, model: str, requests: Iterator[TrafficRequest], concurrency: int,
                 seconds: float, max_tokens: int, tag: str
                 ) -> tuple[Loop[TrafficRequest, Any], Any, Any]:
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS
    from vllm.benchmarks.serve import fetch_spec_decode_metrics

    send_one = ASYNC_REQUEST_FUNCS["openai-chat"]
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency,
                                     keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, trust_env=True,
                                     timeout=aiohttp.ClientTimeout(total=6 * 60 * 60)) as session:
        before = await fetch_spec_decode_metrics(url, session)

        async def send(position: int, request: TrafficRequest) -> Any:
            return await send_one(request_func_input=request_input(
                request, position, tag, url, model, max_tokens), session=session)

        loop = await closed_loop(send, requests, concurrency, seconds)
        after = await fetch_spec_decode_metrics(url, session)
    return loop, before, after


def run_phase(url: str, model: str, requests: Iterator[TrafficRequest], concurrency: int,
              seconds: float, max_tokens: int, tokenizer: Any, tag: str = "") -> dict[str, Any]:
    """One load phase: ``concurrency`` closed-loop clients sending ``requests`` in order for
    ``seconds``, then draining. Returns vLLM's result dict with the phase's own keys
    (:func:`phase_result`). ``tokenizer``: the target's (``vllm.tokenizers.get_tokenizer``),
    for responses without a token count; ``tag`` makes the engine's request ids unique."""
    from vllm.benchmarks.serve import calculate_metrics

    loop, before, after = asyncio.run(_drive(url, model, requests, concurrency, seconds,
                                             max_tokens, tag))
    failed = [o.error for o in loop.outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(loop.outputs)} requests failed; first: "
                           f"{failed[0][:300]}")
    quiet = io.StringIO()  # its printed plots; the figures are in the result
    with contextlib.redirect_stdout(quiet):
        metrics, output_lens = calculate_metrics(
            input_requests=[], outputs=loop.outputs, dur_s=loop.end - loop.start,
            tokenizer=tokenizer, selected_percentiles=list(PERCENTILES),
            goodput_config_dict={})
    return phase_result(loop, metrics, output_lens, _spec_decode(before, after))
