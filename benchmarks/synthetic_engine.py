"""A synthetic engine for integration tests: known per-position acceptance per class and a known
step-cost function, speaking the real wire protocol through the generated stubs.

It applies whatever policy the controller pushes (K per class and batch bucket, probing while off),
draws verification outcomes from the true rates, and reports histograms and step timings exactly
as the engine plugin does. The test then compares the pushed policy with a brute-force optimum over
the true parameters (``best_k``), computed here independently of the controller's code.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from specpilot.contract import engine_stream
from specpilot.contract.buckets import bucket_of
from specpilot.contract.records import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    StepProfile,
    StepTimingRecord,
)
from specpilot.controller.server.stubs import engine_stub
from specpilot.engine_plugin.profile import PROFILE_KS, profile_batch_sizes
from specpilot.v1 import common_pb2, engine_pb2

DRAFT = "draft-small"
VOCAB = "vocab-hash-0001"
MAX_BATCH = 64  # the max_num_seqs it announces


@dataclass(frozen=True)
class TrueCost:
    """Step seconds of the synthetic target + draft: memory-bound below ``ridge_tokens`` verified
    tokens, compute-bound above."""

    base: float = 0.020
    per_token: float = 2e-5
    ridge_tokens: int = 64
    per_token_above_ridge: float = 4e-4
    draft_per_pass: float = 0.004
    draft_per_token: float = 1e-5
    # What speculation costs every step even at K = 0 (vLLM's #49548: the drafter's state is
    # kept up to date); 0 for a plain engine.
    speculative_overhead: float = 0.0

    def step_seconds(self, batch: int, k: int) -> float:
        tokens = batch * (1 + k)
        t = self.base + self.per_token * tokens + self.speculative_overhead
        t += self.per_token_above_ridge * max(0, tokens - self.ridge_tokens)
        if k:
            t += k * (self.draft_per_pass + self.draft_per_token * batch)
        return t


def brute_force_goodputs(rates: np.ndarray, batch: int, cost: TrueCost) -> list[float]:
    """Tokens per second for K = 0..len(rates), straight from the definition (no shared code)."""
    values = []
    for k in range(len(rates) + 1):
        expected = 1.0
        survive = 1.0
        for i in range(k):
            survive *= float(rates[i])
            expected += survive
        values.append(expected * batch / cost.step_seconds(batch, k))
    return values


def best_k(rates: np.ndarray, batch: int, cost: TrueCost) -> tuple[int, float]:
    """(best K, its goodput margin over the runner-up as a ratio)."""
    values = brute_force_goodputs(rates, batch, cost)
    order = np.argsort(values)[::-1]
    return int(order[0]), values[order[0]] / values[order[1]]


def draw_histogram(rng: np.random.Generator, rates: np.ndarray, k: int, steps: int) -> list[int]:
    """Steps by number of accepted drafts: each step accepts positions until the first reject."""
    accepted = rng.random((steps, k)) < rates[:k]
    first_reject = np.where(accepted.all(axis=1), k, np.argmin(accepted, axis=1))
    counts: list[int] = np.bincount(first_reject, minlength=k + 1).tolist()
    return counts


@dataclass
class SyntheticEngine:
    """One engine: classes with true rates, a batch size the load chooses, a true cost."""

    rates: dict[str, np.ndarray]
    cost: TrueCost
    max_k: int
    batch_size: int = 1
    steps_per_report: int = 400
    engine_id: str = "synthetic-0"
    draft: str = DRAFT  # "" : a plain engine (no speculation: max_k is ignored)
    draft_vocab_hash: str = VOCAB
    seed: int = 0
    bucket_bounds: list[int] = field(default_factory=list)
    policy: engine_pb2.PolicyUpdate | None = None
    reports_sent: int = 0
    results: list[engine_pb2.ReportResult] = field(default_factory=list)
    # Reports an overloaded controller shed (unapplied), each sent again after its pause.
    shed: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def hello(self) -> engine_pb2.ConnectRequest:
        return engine_pb2.ConnectRequest(hello=engine_stream.hello_to_proto(EngineHello(
            engine_id=self.engine_id, model="synthetic-target", target_vocab_hash=VOCAB,
            drafts=((DraftSpec(self.draft, DraftKind.MODEL, self.max_k, self.draft_vocab_hash),)
                    if self.draft else ()),
            max_k=self.max_k if self.draft else 0,
            # Batch-wide: the synthetic drafter drafts only the K in force, so K=0 saves drafting.
            per_request_k=False, batch_wide_k=True,
            engine_version="synthetic", plugin_version="synthetic", max_batch_size=MAX_BATCH,
            step_profile=self.step_profile(),
        )))

    def step_profile(self) -> tuple[StepProfile, ...]:
        """The start-up profile a real engine's plugin sends (``engine_plugin/profile.py``): the
        true step time at its batch sizes and K."""
        return tuple(
            StepProfile(b, b * (1 + k), self.draft if k else "", k, self.cost.step_seconds(b, k))
            for b in profile_batch_sizes(MAX_BATCH) for k in PROFILE_KS
            if k <= (self.max_k if self.draft else 0))

    def bucket(self) -> int:
        return bucket_of(tuple(self.bucket_bounds), self.batch_size)

    def decision(self, traffic_class: str) -> common_pb2.Decision | None:
        """The decision in force for a class at the current batch bucket (None: static config)."""
        if self.policy is None:
            return None
        bucket = self.bucket()
        for d in self.policy.decisions:
            if d.traffic_class == traffic_class and d.batch_bucket == bucket:
                return d
        return next((d for d in self.policy.default_decisions if d.batch_bucket == bucket), None)

    def k_in_force(self, traffic_class: str) -> int:
        d = self.decision(traffic_class)
        return d.k if d is not None else (self.max_k if self.draft else 0)

    def report(self) -> engine_pb2.ConnectRequest:
        acceptance: list[AcceptanceRecord] = []
        timings: list[StepTimingRecord] = []
        for name, rates in self.rates.items():
            d = self.decision(name)
            k = self.k_in_force(name)
            steps = self.steps_per_report
            if k == 0 and d is not None and d.probe_k:
                k, steps = d.probe_k, int(self.rng.binomial(steps, d.probe_rate))
            if k and steps:
                acceptance.append(AcceptanceRecord(
                    name, self.draft, k, tuple(draw_histogram(self.rng, rates, k, steps))))
            k_run = self.k_in_force(name)
            b, n = self.batch_size, self.steps_per_report
            noise = 1.0 + 0.02 * float(self.rng.standard_normal())
            timings.append(StepTimingRecord(
                batch_bucket=self.bucket(), draft=self.draft if k_run else "", k=k_run, steps=n,
                sum_batch_size=n * b, sum_verified_tokens=n * b * (1 + k_run),
                sum_draft_tokens=n * b * k_run,
                sum_step_seconds=n * self.cost.step_seconds(b, k_run) * noise))
        self.reports_sent += 1
        # The interval its steps took, one after another: the controller bounds what a report
        # counts by what its engine can run in its interval.
        interval = max(sum(t.sum_step_seconds for t in timings), 0.05)
        return engine_pb2.ConnectRequest(report=engine_stream.report_to_proto(EngineReport(
            sequence=self.reports_sent, interval_seconds=interval,
            policy_version=self.policy.version if self.policy else 0,
            acceptance=tuple(acceptance), step_timings=tuple(timings),
            running_requests=self.batch_size)))


async def drive(
    engine: SyntheticEngine,
    target: str,
    reports: int,
    on_report: Callable[[SyntheticEngine, int], bool | None] | None = None,
    pause_seconds: float = 0.01,
) -> int:
    """Connect, send up to ``reports`` reports, apply pushed policies as they arrive; a report
    the controller sheds is sent again after the pause it asks (``engine.shed`` counts them).

    ``on_report(engine, i)`` runs after each report's result arrived; returning True stops early.
    Returns the number of reports sent.
    """
    outbox: asyncio.Queue[engine_pb2.ConnectRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[engine_pb2.ConnectRequest]:
        while (msg := await outbox.get()) is not None:
            yield msg

    async with grpc.aio.insecure_channel(target) as channel:
        stub = engine_stub(channel)
        call = stub.Connect(requests())
        await outbox.put(engine.hello())
        sent = 0
        async for msg in call:
            kind = msg.WhichOneof("message")
            if kind == "hello_ack":
                engine.bucket_bounds = list(msg.hello_ack.batch_bucket_upper_bounds)
            elif kind == "policy":
                engine.policy = msg.policy
                if sent == 0:  # first policy: start reporting
                    await outbox.put(engine.report())
                    sent = 1
            elif kind == "report_result":
                result = msg.report_result
                # Shed, nothing applied: sent again after the pause it asks, as the plugin does.
                if result.code == engine_stream.REPORT_SHED_CODE:
                    engine.shed += 1
                    await asyncio.sleep(max(result.retry_after_seconds, pause_seconds))
                    await outbox.put(engine.report())
                    continue
                engine.results.append(result)
                if on_report is not None and on_report(engine, sent):
                    break
                if sent >= reports:
                    break
                await asyncio.sleep(pause_seconds)
                await outbox.put(engine.report())
                sent += 1
        await outbox.put(None)
        call.cancel()
        return sent
