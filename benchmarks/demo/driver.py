"""Drive a request plan through an in-process vLLM engine, phase by phase, and measure it.

The engine is stepped directly (``LLMEngine.add_request`` / ``step``) so that the number of
requests in flight is exactly the phase's concurrency: a closed loop, like a fleet of clients
that each send their next request when the last one returns. Each request samples at its
class's temperature with ``ignore_eos``, so every engine configuration does the same work on the
same requests.

Besides end-to-end throughput it measures decode throughput: the steps in which every request in
flight had already produced its first token (no prompt was being prefilled), their time and the
tokens they generated. That is the part speculation changes; prefill is the same in every
configuration.

Per request it records the generated token ids (for the greedy-identity check), admission and
finish times, and vLLM's per-request speculative-decoding histogram when the engine was started
with ``per_request_spec_decode_metrics="summary"`` (``config_session`` does).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from benchmarks.demo.workload import DemoRequest, RequestPlan


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    phase: int
    traffic_class: str
    token_ids: tuple[int, ...]
    admitted: float  # monotonic seconds
    finished: float
    # Draft tokens verified and accepted for this request (0/0 without speculation).
    drafted: int
    accepted: int
    # Verification steps by accepted drafts (index = accepted count); empty without speculation.
    histogram: tuple[int, ...]
    # Engine steps that gave it new tokens (its first, prefill, step included).
    steps: int = 0

    @property
    def seconds(self) -> float:
        return self.finished - self.admitted


@dataclass(frozen=True)
class PhaseResult:
    name: str
    concurrency: int
    seconds: float
    tokens: int
    # Decode-only steps (no prompt in prefill): their count, wall time, tokens generated, and
    # the sequences in flight summed over them.
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    decode_batch_sum: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def decode_step_seconds(self) -> float:
        """Mean wall time of one decode-only step (NaN without one)."""
        return self.decode_seconds / self.decode_steps if self.decode_steps else float("nan")

    @property
    def decode_batch(self) -> float:
        """Mean sequences in flight in a decode-only step (NaN without one)."""
        return self.decode_batch_sum / self.decode_steps if self.decode_steps else float("nan")


@dataclass(frozen=True)
class RunResult:
    """One pass of a plan through one engine configuration."""

    config: str
    phases: tuple[PhaseResult, ...]
    requests: tuple[RequestResult, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.phases)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        seconds = sum(p.decode_seconds for p in self.phases)
        return sum(p.decode_tokens for p in self.phases) / seconds if seconds > 0 else 0.0

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {r.request_id: r.token_ids for r in self.requests}


@dataclass
class LiveWindow:
    """Generated tokens per class since the last tick (for a live tokens/s display)."""

    phase: str = ""
    concurrency: int = 0
    in_flight: int = 0
    started: float = field(default_factory=time.monotonic)
    tokens: dict[str, int] = field(default_factory=dict)

    def rates(self, now: float) -> dict[str, float]:
        dt = max(now - self.started, 1e-9)
        return {cls: n / dt for cls, n in self.tokens.items()}


Tick = Callable[[LiveWindow, float], None]


def sampling_params(request: DemoRequest) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=request.temperature, max_tokens=request.max_tokens,
                          ignore_eos=True, extra_args={"traffic_class": request.traffic_class})


def _result(request: DemoRequest, output: Any, admitted: float, now: float,
            steps: int) -> RequestResult:
    completion = output.outputs[0]
    metrics = getattr(completion, "spec_decode_metrics", None)
    histogram = tuple(int(x) for x in (metrics.histogram if metrics is not None else ()))
    accepted = sum(i * n for i, n in enumerate(histogram))
    drafted = int(metrics.num_draft_tokens) if metrics is not None else 0
    return RequestResult(request.request_id, request.phase, request.traffic_class,
                         tuple(int(t) for t in completion.token_ids), admitted, now,
                         drafted, accepted, histogram, steps)


def run_plan(llm: Any, plan: RequestPlan, config: str, *, on_tick: Tick | None = None,
             tick_seconds: float = 1.0) -> RunResult:
    """Run every phase of ``plan`` on ``llm`` (a ``vllm.LLM``) and return what was measured.

    ``on_tick(window, now)`` is called about every ``tick_seconds`` with the tokens generated
    per class since the previous tick; the window is then reset.
    """
    engine = llm.llm_engine
    by_id: Mapping[str, DemoRequest] = {r.request_id: r for r in plan.requests}
    results: list[RequestResult] = []
    phases: list[PhaseResult] = []
    seen: dict[str, int] = {}
    steps: dict[str, int] = {}
    window = LiveWindow()
    for p_index, phase_requests in enumerate(plan.by_phase):
        phase = plan.workload.phases[p_index]
        window.phase, window.concurrency = phase.name, phase.concurrency
        queue = deque(phase_requests)
        admitted: dict[str, float] = {}
        prefilling: set[str] = set()  # admitted, no token yet
        tokens = 0
        decode = [0, 0.0, 0, 0]  # steps, seconds, tokens, batch sum
        started = time.monotonic()
        while queue or admitted:
            while queue and len(admitted) < phase.concurrency:
                request = queue.popleft()
                engine.add_request(request.request_id,
                                   {"prompt_token_ids": list(request.prompt_token_ids)},
                                   sampling_params(request))
                admitted[request.request_id] = time.monotonic()
                prefilling.add(request.request_id)
            decode_only, batch = not prefilling, len(admitted)
            before = time.monotonic()
            outputs = engine.step()
            now = time.monotonic()
            step_tokens = 0
            for output in outputs:
                request = by_id[output.request_id]
                n = len(output.outputs[0].token_ids)
                new = n - seen.get(output.request_id, 0)
                seen[output.request_id] = n
                step_tokens += new
                if new:
                    steps[output.request_id] = steps.get(output.request_id, 0) + 1
                if n:
                    prefilling.discard(output.request_id)
                cls = request.traffic_class
                window.tokens[cls] = window.tokens.get(cls, 0) + new
                if output.finished:
                    results.append(_result(request, output, admitted.pop(request.request_id),
                                           now, steps.pop(request.request_id, 0)))
            tokens += step_tokens
            if decode_only and step_tokens:
                decode[0] += 1
                decode[1] += now - before
                decode[2] += step_tokens
                decode[3] += batch
            window.in_flight = len(admitted)
            if on_tick is not None and now - window.started >= tick_seconds:
                on_tick(window, now)
                window.tokens = {}
                window.started = now
        phases.append(PhaseResult(phase.name, phase.concurrency, time.monotonic() - started,
                                  tokens, int(decode[0]), float(decode[1]), int(decode[2]),
                                  int(decode[3])))
    return RunResult(config, tuple(phases), tuple(results))
