"""A minimal engine for the server tests: the real generated stubs on a real channel, driven one
message at a time so each test states exactly what it sends and what must come back."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from specpilot.controller.server.stubs import engine_stub
from specpilot.v1 import common_pb2, engine_pb2

DRAFT = "draft-s"
VOCAB = "vocab-0001"
TIMEOUT = 5.0


def hello(engine_id: str = "engine-1", max_k: int = 4) -> engine_pb2.EngineHello:
    """One good model draft, one whose tokenizer differs from the target's, and n-gram."""
    return engine_pb2.EngineHello(
        engine_id=engine_id, model="tiny-target", target_vocab_hash=VOCAB, max_k=max_k,
        drafts=[
            engine_pb2.DraftInfo(name=DRAFT, kind=common_pb2.DRAFT_KIND_MODEL, vocab_hash=VOCAB,
                                 max_k=max_k),
            engine_pb2.DraftInfo(name="draft-other-tokenizer", kind=common_pb2.DRAFT_KIND_MODEL,
                                 vocab_hash="vocab-9999", max_k=max_k),
            engine_pb2.DraftInfo(name="ngram", kind=common_pb2.DRAFT_KIND_NGRAM, max_k=max_k),
        ],
        capabilities=engine_pb2.EngineCapabilities(per_request_k=True),
        engine_version="test", plugin_version="test", max_batch_size=64,
    )


def acceptance(cls: str = "chat", steps_by_accepted: Sequence[int] = (10, 20, 70),
               draft: str = DRAFT, k: int | None = None) -> engine_pb2.AcceptanceCounts:
    return engine_pb2.AcceptanceCounts(
        traffic_class=cls, draft=draft,
        k=len(steps_by_accepted) - 1 if k is None else k, steps_by_accepted=steps_by_accepted)


def report(sequence: int, *records: engine_pb2.AcceptanceCounts,
           finished: Sequence[engine_pb2.RequestSummary] = ()) -> engine_pb2.EngineReport:
    """A report of ``records`` (default: one good record for class "chat")."""
    return engine_pb2.EngineReport(sequence=sequence, interval_seconds=0.05,
                                   acceptance=records or [acceptance()], finished=finished)


class EngineClient:
    """One Connect stream. ``policies`` collects every PolicyUpdate seen while reading."""

    def __init__(self, channel: grpc.aio.Channel,
                 metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        self.call = engine_stub(channel).Connect(None, metadata=metadata)
        self.policies: list[engine_pb2.PolicyUpdate] = []

    async def read(self) -> engine_pb2.ConnectResponse:
        msg = await asyncio.wait_for(self.call.read(), TIMEOUT)
        if not isinstance(msg, engine_pb2.ConnectResponse):
            raise AssertionError("the controller ended the stream")
        if msg.HasField("policy"):
            self.policies.append(msg.policy)
        return msg

    async def connect(self, msg: engine_pb2.EngineHello | None = None) -> engine_pb2.HelloAck:
        """Send a hello; return the ack once the first policy has arrived too."""
        await self.call.write(engine_pb2.ConnectRequest(hello=msg or hello()))
        ack = (await self.read()).hello_ack
        await self.next_policy()
        return ack

    async def send(self, msg: engine_pb2.EngineReport) -> engine_pb2.ReportResult:
        """Send a report and return its result (policy updates on the way are collected)."""
        await self.call.write(engine_pb2.ConnectRequest(report=msg))
        while not (resp := await self.read()).HasField("report_result"):
            pass
        return resp.report_result

    async def next_policy(self) -> engine_pb2.PolicyUpdate:
        while not (resp := await self.read()).HasField("policy"):
            pass
        return resp.policy

    async def close(self) -> None:
        await self.call.done_writing()
        self.call.cancel()
