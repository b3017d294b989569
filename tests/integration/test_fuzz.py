"""Property-based fuzzing of every input the controller takes (issue 17 item 8).

Engine hellos and reports (valid-looking ones with one field perturbed, and wild ones of every
field with extreme values) through the pure layer (``wire`` -> ``ControllerCore``) and over gRPC;
raw bytes on the engine stream and on every policy RPC; every policy-API input, with and without
the token; the dashboard's HTTP write endpoints with arbitrary bodies; raw HTTP request heads
and engine ids of any text (every log line stays one printable line, no traceback). After each
example the invariants: the server is SERVING, nothing logged at ERROR, every estimate a
probability, every decision's K in 0..max_k with a finite speedup, step costs finite and
positive, overrides in force respected and refused writes changing nothing, the HTTP JSON
strict.

One server per test (not per example), so a failure found late may not replay alone: Hypothesis
then reports it as flaky, with the example that failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast, get_args

import aiohttp
import grpc
import numpy as np
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from specpilot.contract.engine_stream import hello_from_proto, report_from_proto
from specpilot.contract.records import BeyondRate, ReportRejected
from specpilot.contract.validation import (
    MAX_BATCH_SIZE,
    MIN_STEP_SECONDS,
    fastest_decode_seconds,
    interval_bound,
    valid_class_name,
)
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.metrics import RejectReason
from specpilot.controller.server.app import RECEIVE_LIMIT_FACTOR, RunningServer
from specpilot.controller.server.stubs import AsyncPolicyStub, async_policy_stub
from specpilot.controller.server.views import to_json_dict
from specpilot.controller.settings import core_config, load_settings
from specpilot.v1 import common_pb2, engine_pb2, policy_pb2
from tests.integration.conftest import FAST_SETTINGS, TOKEN
from tests.integration.engine_client import DRAFT, VOCAB, EngineClient, hello, report

pytestmark = pytest.mark.integration
M = TypeVar("M", bound=Message)
Field = Any  # a protobuf field descriptor (the pure-Python or the upb type)

# gRPC's own receive limit on the test server: a larger message ends its stream outright.
RECEIVE_LIMIT = RECEIVE_LIMIT_FACTOR * int(FAST_SETTINGS["max_report_bytes"])
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CLASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,63}")  # as documented, in full


def fuzz(examples: int) -> settings:
    """One server per test serves every example (its fixtures are function-scoped on
    purpose); the messages are large by design."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
        HealthCheck.large_base_example])

# --- values by protobuf field type, extremes first ---------------------------------------------


def _edgy(lo: int, hi: int, *extra: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, lo + 1, -1, 0, 1, 2, hi - 1, hi, *extra) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


UINT32 = _edgy(0, 2**32 - 1, 8, 9, 64, 65, 65_536, 65_537, 2**31)
UINT64 = _edgy(0, 2**64 - 1, 10**6, 10**6 + 1, 10**12, 10**12 + 1, 2**63)
INT64 = _edgy(-(2**63), 2**63 - 1, 10**12, 10**12 + 1)
INT32 = _edgy(-(2**31), 2**31 - 1, 3, 4)
DOUBLES = st.one_of(
    st.sampled_from([0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 1e308, -1e308,
                     1.7976931348623157e308, 5e-324, -5e-324, 2.2250738585072014e-308 / 3,
                     1e-7, 1e-6, 60.0, 60.000001, 1e9]),
    st.floats())
INTERESTING_TEXT = [
    "", " ", "*", "default", "other", "chat", "code", DRAFT, "ngram", "chat\n", "\n", "\x00",
    "a\x00b", "é", "日本語", "🙂" * 40, "\u202e", "\ufeff", "a" * 64, "a" * 65, "x" * 200,
    "x" * 201, "x" * 256, "x" * 257, "n" * 1000, "n" * 1001, "x" * 100_000, "é" * 70_000,
]
CLASS_LIKE = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,70}", fullmatch=True)
TEXT = st.one_of(st.sampled_from(INTERESTING_TEXT), CLASS_LIKE, st.text(max_size=20),
                 st.text(st.characters(codec="utf-8"), max_size=300))
# Lengths of repeated fields: small, or just past a limit (MAX_DRAFTS, MAX_PROFILE_POINTS, K).
LIST_SIZES = st.one_of(st.integers(0, 4), st.sampled_from([16, 17, 65, 66, 256, 257]))


def scalar(fd: Field) -> st.SearchStrategy[Any]:
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in fd.enum_type.values]), INT32)
    by_type: dict[int, st.SearchStrategy[Any]] = {
        FieldDescriptor.TYPE_UINT32: UINT32, FieldDescriptor.TYPE_UINT64: UINT64,
        FieldDescriptor.TYPE_INT64: INT64, FieldDescriptor.TYPE_INT32: INT32,
        FieldDescriptor.TYPE_DOUBLE: DOUBLES, FieldDescriptor.TYPE_BOOL: st.booleans(),
        FieldDescriptor.TYPE_STRING: TEXT,
    }
    return by_type[fd.type]  # a KeyError here: a field type this file does not fuzz yet


_INT_RANGES = {FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
               FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
               FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
               FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
               FieldDescriptor.TYPE_ENUM: (-(2**31), 2**31 - 1)}
# Characters that slip past a careless check when added to a valid name.
TRICKY = ["\n", "\x00", " ", "é", "*", "\u2028", "\r\n", "/", "\ufeff"]


def near(fd: Field, current: Any) -> st.SearchStrategy[Any]:
    """Values next to ``current``: a valid value made just invalid (or still valid)."""
    if fd.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(
            st.tuples(st.sampled_from(TRICKY), st.booleans()).map(
                lambda t: current + t[0] if t[1] else t[0] + current),
            st.sampled_from([current * 2, current[:-1], current.upper(), current.strip()]),
            st.sampled_from([63, 64, 65, 200, 201, 256, 257, 1000, 1001]).map(
                lambda n: ((current or "x") * n)[:n]))
    if fd.type == FieldDescriptor.TYPE_DOUBLE:
        return st.sampled_from([-current, current * (1 + 1e-12), current * 1e3, current / 1e3,
                                math.nextafter(current, math.inf), current * 1e300])
    if fd.type in _INT_RANGES:
        lo, hi = _INT_RANGES[fd.type]
        return st.sampled_from(sorted({v for v in (current - 1, current + 1, current * 2,
                                                   current * 1000, -current, current**2)
                                       if lo <= v <= hi} or {current}))
    return st.just(not current)


def _class_of(fd: Field) -> type[Message]:
    cls: type[Message] = message_factory.GetMessageClass(fd.message_type)
    return cls


def _extend(draw: st.DrawFn, repeated: Any, element: st.SearchStrategy[Any],
            message: bool) -> None:
    """Fill a repeated field: a few drawn elements, or many copies of one (cheap to draw)."""
    n = draw(LIST_SIZES)
    items = (draw(st.lists(element, min_size=n, max_size=n)) if n <= 4
             else [draw(element)] * n)
    for item in items:
        if message:
            repeated.add().CopyFrom(item)
        else:
            repeated.append(item)


@st.composite
def wild(draw: st.DrawFn, cls: type[M]) -> M:
    """Any message of ``cls``: every field set or not, to any value of its type."""
    msg = cls()
    for fd in msg.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if fd.message_type is not None:
            if fd.is_repeated:
                _extend(draw, getattr(msg, fd.name), wild(_class_of(fd)), message=True)
            else:
                getattr(msg, fd.name).CopyFrom(draw(wild(_class_of(fd))))
        elif fd.is_repeated:
            _extend(draw, getattr(msg, fd.name), scalar(fd), message=False)
        else:
            setattr(msg, fd.name, draw(scalar(fd)))
    return msg


def _slots(msg: Message) -> Iterator[tuple[Message, Field]]:
    """Every field of ``msg`` and of its set sub-messages, recursively."""
    for fd in msg.DESCRIPTOR.fields:
        if fd.message_type is not None and fd.is_repeated:
            for sub in getattr(msg, fd.name):
                yield from _slots(sub)
        elif fd.message_type is not None and msg.HasField(fd.name):
            yield from _slots(getattr(msg, fd.name))
        yield msg, fd


@st.composite
def perturbed(draw: st.DrawFn, base: M) -> M:
    """``base`` with one field (anywhere in it) set to a value drawn for its type."""
    msg = type(base)()
    msg.CopyFrom(base)
    # Each distinct field (not each of its instances) as likely: a report's many counts do
    # not crowd out its one step time.
    slots: dict[str, list[tuple[Message, Field]]] = {}
    for parent, fd in _slots(msg):
        slots.setdefault(fd.full_name, []).append((parent, fd))
    parent, fd = draw(st.sampled_from(slots[draw(st.sampled_from(sorted(slots)))]))
    field = getattr(parent, fd.name)
    if fd.message_type is not None and fd.is_repeated:
        how = draw(st.sampled_from(["clear", "duplicate", "add", "many"]))
        if how == "clear":
            del field[:]
        elif how == "duplicate" and len(field):
            field.add().CopyFrom(field[-1])
        elif how == "many" and len(field):
            for _ in range(draw(st.sampled_from([16, 17, 256, 257]))):
                field.add().CopyFrom(field[0])
        else:
            field.add().CopyFrom(draw(wild(_class_of(fd))))
    elif fd.message_type is not None:
        field.CopyFrom(draw(wild(_class_of(fd))))
    elif fd.is_repeated:
        if len(field) and draw(st.booleans()):
            i = draw(st.integers(0, len(field) - 1))
            field[i] = draw(st.one_of(scalar(fd), near(fd, field[i])))
        else:
            del field[:]
            _extend(draw, field, scalar(fd), message=False)
    else:
        setattr(parent, fd.name, draw(st.one_of(scalar(fd), near(fd, field))))
    return msg


def fuzzed(base: st.SearchStrategy[M], cls: type[M]) -> st.SearchStrategy[tuple[M, bool]]:
    """(message, plausible): a plausible message as drawn, one perturbed, or a wild one. Only
    the first must be accepted; the others are mostly refused, and sometimes accepted too."""
    return st.one_of(
        base.map(lambda m: (m, True)),
        base.flatmap(perturbed).map(lambda m: (m, False)),
        wild(cls).map(lambda m: (m, False)),
    )


# --- plausible engines ---------------------------------------------------------------------------
_KINDS = {"draft-s": common_pb2.DRAFT_KIND_MODEL, "draft-t": common_pb2.DRAFT_KIND_MODEL,
          "ngram": common_pb2.DRAFT_KIND_NGRAM, "suffix": common_pb2.DRAFT_KIND_SUFFIX}
CLASSES = st.sampled_from(["chat", "code", "batch", "default", "other", "a.b:c/d-e_1"])


@st.composite
def plausible_hello(draw: st.DrawFn) -> engine_pb2.EngineHello:
    max_k = draw(st.integers(0, 8))
    names = draw(st.lists(st.sampled_from(sorted(_KINDS)), max_size=4, unique=True))
    drafts = [engine_pb2.DraftInfo(
        name=n, kind=_KINDS[n], max_k=draw(st.integers(1, max(max_k, 1))),
        vocab_hash=(draw(st.sampled_from([VOCAB, VOCAB, "vocab-other"]))
                    if _KINDS[n] == common_pb2.DRAFT_KIND_MODEL else ""))
        for n in names]
    models = [n for n in names if _KINDS[n] == common_pb2.DRAFT_KIND_MODEL]
    max_batch = draw(st.sampled_from([0, 1, 8, 64, 256]))
    profile = []
    for _ in range(draw(st.integers(0, 3))):
        batch = draw(st.integers(1, max_batch or 64))
        draft = draw(st.sampled_from(["", *models])) if max_k else ""
        passes = draw(st.integers(1, max_k)) if draft else 0
        profile.append(engine_pb2.StepProfile(
            batch_size=batch, verified_tokens=batch * (1 + passes), draft=draft,
            draft_passes=passes, seconds=draw(st.floats(1e-4, 1.0))))
    return engine_pb2.EngineHello(
        engine_id=draw(st.sampled_from(["engine-1", "engine-2"])), model="tiny-target",
        target_vocab_hash=VOCAB, drafts=drafts, max_k=max_k,
        capabilities=engine_pb2.EngineCapabilities(
            per_request_k=draw(st.booleans()), batch_wide_k=draw(st.booleans()),
            ngram_substitution=draw(st.booleans()), ngram_counterfactual=draw(st.booleans())),
        engine_version="fuzz", plugin_version="fuzz",
        max_batch_size=max_batch, step_profile=profile,
        hardware=draw(st.sampled_from(["", "NVIDIA H100 80GB HBM3 tp1 pp1 bfloat16", "cpu"])))


@dataclass(frozen=True)
class Engine:
    """What a plausible report of a connected engine must respect."""

    engine_id: str
    max_k: int
    drafts: dict[str, int]  # accepted draft -> its max K (the engine's max K at most)
    batch_limit: int
    n_buckets: int
    fastest_step_seconds: float  # its profile's fastest decode step (fastest_decode_seconds)

    @classmethod
    def of(cls, hello_msg: engine_pb2.EngineHello, accepted: list[str],
           n_buckets: int) -> Engine:
        own = {d.name: d.max_k for d in hello_msg.drafts}
        return cls(hello_msg.engine_id, hello_msg.max_k,
                   {n: min(own[n], hello_msg.max_k) for n in accepted},
                   hello_msg.max_batch_size or MAX_BATCH_SIZE, n_buckets,
                   fastest_decode_seconds(hello_from_proto(hello_msg).step_profile))


@st.composite
def plausible_report(draw: st.DrawFn, engine: Engine, sequence: int) -> engine_pb2.EngineReport:
    drafts = sorted(engine.drafts)
    acceptance = []
    for _ in range(draw(st.integers(0, 3)) if drafts else 0):
        name = draw(st.sampled_from(drafts))
        k = draw(st.integers(1, engine.drafts[name]))
        acceptance.append(engine_pb2.AcceptanceCounts(
            traffic_class=draw(CLASSES), draft=name, k=k,
            steps_by_accepted=draw(st.lists(st.integers(0, 500), min_size=k + 1,
                                            max_size=k + 1)),
            counterfactual=draw(st.booleans())))
    finished = []
    for _ in range(draw(st.integers(0, 2))):
        drafted = draw(st.integers(0, 4000))
        finished.append(engine_pb2.RequestSummary(
            traffic_class=draw(CLASSES), draft=draw(st.sampled_from(["", *drafts])),
            prompt_tokens=draw(st.integers(0, 4000)), output_tokens=draw(st.integers(0, 4000)),
            drafted_tokens=drafted, accepted_tokens=draw(st.integers(0, drafted)),
            latency_seconds=draw(st.floats(0, 100))))
    timings = []
    for _ in range(draw(st.integers(0, 3))):
        bucket = draw(st.integers(0, engine.n_buckets - 1))
        steps = draw(st.integers(1, 200)) if draw(st.integers(0, 9)) else 0  # some empty
        if steps == 0:
            timings.append(engine_pb2.StepTiming(batch_bucket=bucket))
            continue
        k = draw(st.integers(0, engine.max_k))
        sum_batch = steps * draw(st.integers(1, min(engine.batch_limit, 256)))
        timings.append(engine_pb2.StepTiming(
            batch_bucket=bucket, draft=draw(st.sampled_from(["", *drafts])) if k else "", k=k,
            steps=steps, sum_batch_size=sum_batch,
            sum_verified_tokens=sum_batch * (1 + draw(st.integers(0, k))),
            sum_draft_tokens=sum_batch * draw(st.integers(0, k)),
            sum_step_seconds=steps * draw(st.floats(1e-5, 1.0))))
    needed = needed_interval(engine, acceptance, timings)
    return engine_pb2.EngineReport(
        sequence=sequence, interval_seconds=max(draw(st.floats(1e-3, 10.0)), needed * 1.001),
        policy_version=draw(st.integers(0, 100)), acceptance=acceptance, finished=finished,
        step_timings=timings, records_dropped=draw(st.integers(0, 1000)),
        running_requests=draw(st.integers(0, min(engine.batch_limit, 512))))


def needed_interval(engine: Engine, acceptance: Iterable[engine_pb2.AcceptanceCounts],
                    timings: Iterable[engine_pb2.StepTiming]) -> float:
    """The shortest interval ``engine`` can have counted these records in, seconds
    (``validation.interval_bound``: per draft the verification steps, and the timed steps)."""
    per_second, request_per_second = interval_bound(1.0, engine.batch_limit,
                                                    engine.fastest_step_seconds)
    per_draft: dict[str, int] = {}
    for rec in acceptance:
        per_draft[rec.draft] = per_draft.get(rec.draft, 0) + sum(rec.steps_by_accepted)
    return max(max(per_draft.values(), default=0) / request_per_second,
               sum(t.steps for t in timings) / per_second)


def reports(engine: Engine, sequence: int
            ) -> st.SearchStrategy[tuple[engine_pb2.EngineReport, bool]]:
    return fuzzed(plausible_report(engine, sequence), engine_pb2.EngineReport)


# --- invariants ---------------------------------------------------------------------------------
def _probability(values: Any, where: str) -> None:
    arr = np.asarray(values, dtype=float)
    assert np.all(np.isfinite(arr)) and np.all((arr >= 0) & (arr <= 1)), (where, arr)


def check_decision(d: Any, max_k: int, n_buckets: int, drafts: dict[str, int] | None,
                   where: str) -> None:
    """A core Decision or a proto Decision: K in range, finite, and (``drafts``: those the
    connected engines offer; None with no engine connected, when nothing is re-decided) with a
    draft that allows it."""
    bucket = getattr(d, "bucket", getattr(d, "batch_bucket", None))
    assert bucket is not None and 0 <= bucket < n_buckets, (where, d)
    assert 0 <= d.k <= max_k, (where, d)
    assert math.isfinite(d.expected_speedup) and d.expected_speedup >= 0, (where, d)
    assert math.isfinite(d.probe_rate) and 0 <= d.probe_rate <= 1, (where, d)
    assert 0 <= d.probe_k <= max_k, (where, d)
    if drafts is not None:
        assert not d.k or (d.draft in drafts and d.k <= drafts[d.draft]), (where, d, drafts)
        assert not d.probe_k or (d.probe_draft in drafts
                                 and d.probe_k <= drafts[d.probe_draft]), (where, d, drafts)


def check_core(core: ControllerCore, now: float) -> None:
    """Every invariant of the core's state that holds whatever it was fed."""
    snap = core.snapshot(now)
    cfg = core.config
    max_k, n_buckets = cfg.policy.max_k, cfg.n_buckets
    drafts = offered_drafts(core, snap.engines)
    for c in snap.classes:
        assert CLASS_NAME.fullmatch(c.name), c.name
        for e in c.estimates:
            where = f"{c.name}/{e.draft}"
            alpha, beta = np.array(e.alpha), np.array(e.beta)
            assert np.all(np.isfinite(alpha)) and np.all(alpha > 0), (where, alpha)
            assert np.all(np.isfinite(beta)) and np.all(beta > 0), (where, beta)
            _probability(e.mean, where)
            lower, upper = e.credible_interval(0.9)
            _probability(lower, where)
            _probability(upper, where)
            assert np.all(np.isfinite(e.expected_tokens)), (where, e.expected_tokens)
        for d in c.decisions:
            check_decision(d, max_k, n_buckets, drafts, c.name)
        for value in (c.share, c.measured_tokens_per_step, c.measured_speedup):
            assert value is None or math.isfinite(value), (c.name, c)
    for d in snap.default_decisions:
        check_decision(d, max_k, n_buckets, drafts, "default_decisions")
    for b, seconds in enumerate(step_costs(core)):
        assert math.isfinite(seconds) and seconds > 0, (b, seconds)


def offered_drafts(core: ControllerCore, engines: Any) -> dict[str, int] | None:
    """The connected engines' drafts and their max K; None with no engine connected."""
    return {d.name: d.max_k for d in core.drafts()} if engines else None


def step_costs(core: ControllerCore) -> tuple[float, ...]:
    """The predicted step seconds at every bucket's batch size, for every arm."""
    cfg = core.config
    arms = [("", 0)] + [(d.name, k) for d in core.drafts()
                        for k in range(1, min(d.max_k, cfg.policy.max_k) + 1)]
    return tuple(core.predicted_step_seconds(cfg.bucket_batch_size(b), draft, k)
                 for b in range(cfg.n_buckets) for draft, k in arms)


def fingerprint(core: ControllerCore, at: float) -> tuple[Any, ...]:
    """What input could change, seen at one instant (posteriors decay with time). Decisions
    are left out: a server's periodic round may move them at any time."""
    snap = core.snapshot(at)
    estimates = [e for c in snap.classes for e in c.estimates if e.has_evidence]
    return estimates, [c.name for c in snap.classes], snap.engines, snap.overrides, \
        step_costs(core)


# --- (a) the pure layer: wire -> ControllerCore ------------------------------------------------
_CORE_CONFIG = core_config(load_settings(**FAST_SETTINGS))


def hellos() -> st.SearchStrategy[tuple[engine_pb2.EngineHello, bool]]:
    return fuzzed(plausible_hello(), engine_pb2.EngineHello)


def _connect(core: ControllerCore, msg: engine_pb2.EngineHello, now: float) -> list[str] | None:
    """The accepted drafts, or None when the hello is refused (then nothing changed)."""
    before = fingerprint(core, now)
    try:
        outcome = core.connect_engine(hello_from_proto(msg), now)
    except ReportRejected:
        assert fingerprint(core, now) == before
        return None
    return list(outcome.accepted_drafts)


@fuzz(200)
@given(data=st.data())
def test_pure_layer_takes_or_refuses_every_hello_and_report(data: st.DataObject) -> None:
    """One to three engines (a hello may re-register one), then reports from any of them."""
    core = ControllerCore(_CORE_CONFIG, np.random.default_rng(1))
    now = 1000.0
    engines: dict[str, tuple[Engine, int]] = {}  # engine id -> (engine, last sequence)
    for _ in range(data.draw(st.integers(1, 3), "hellos")):
        hello_msg, plausible = data.draw(hellos(), "hello")
        accepted = _connect(core, hello_msg, now)
        assert accepted is not None or not plausible, "a plausible hello was refused"
        event(f"hello {'taken' if accepted is not None else 'refused'}")
        if accepted is not None:
            engines[hello_msg.engine_id] = (
                Engine.of(hello_msg, accepted, _CORE_CONFIG.n_buckets), 0)
            core.decide(now)
            check_core(core, now)
    if not engines:
        return
    for _ in range(data.draw(st.integers(1, 5), "reports")):
        now += 0.05
        engine, sequence = engines[data.draw(st.sampled_from(sorted(engines)), "engine")]
        msg: engine_pb2.EngineReport
        msg, plausible = data.draw(reports(engine, sequence + 1), "report")
        before = fingerprint(core, now)
        try:
            core.ingest(engine.engine_id, report_from_proto(msg), now)
        except ReportRejected as exc:
            assert not plausible, f"a plausible report was refused: {exc}"
            assert str(exc)  # names the field
            assert fingerprint(core, now) == before, "a refused report changed the state"
            event("report refused")
            continue
        event("report taken")
        names = ([r.traffic_class for r in msg.acceptance]
                 + [r.traffic_class for r in msg.finished])
        assert all(CLASS_NAME.fullmatch(n) for n in names), f"a bad class name taken: {names}"
        engines[engine.engine_id] = (engine, msg.sequence)
        core.decide(now)
        check_core(core, now)


@fuzz(100)
@given(data=st.data())
def test_a_report_counting_more_than_its_interval_allows_is_refused(
        data: st.DataObject) -> None:
    """A plausible report whose interval is shrunk below what its engine needs for what it
    counts: refused as BeyondRate, nothing changed; at the bound it is taken."""
    core = ControllerCore(_CORE_CONFIG, np.random.default_rng(1))
    now = 1000.0
    hello_msg = data.draw(plausible_hello(), "hello")
    accepted = _connect(core, hello_msg, now)
    assume(accepted)
    assert accepted is not None
    engine = Engine.of(hello_msg, accepted, _CORE_CONFIG.n_buckets)
    msg = data.draw(plausible_report(engine, 1), "report")
    needed = needed_interval(engine, msg.acceptance, msg.step_timings)
    assume(needed > 0)
    msg.interval_seconds = needed * data.draw(st.floats(0.01, 0.99), "shrink")
    before = fingerprint(core, now)
    with pytest.raises(BeyondRate, match="interval_seconds"):
        core.ingest(engine.engine_id, report_from_proto(msg), now)
    assert fingerprint(core, now) == before
    msg.interval_seconds = needed * 1.001
    core.ingest(engine.engine_id, report_from_proto(msg), now)


@fuzz(500)
@given(name=st.one_of(TEXT, CLASS_LIKE.flatmap(
    lambda n: near(engine_pb2.AcceptanceCounts.DESCRIPTOR.fields_by_name["traffic_class"], n))))
@example(name="chat\n")  # "$" matches before a final newline: it was taken
def test_class_names_are_checked_as_documented(name: str) -> None:
    """The one rule every class name passes (reports, overrides, the plugin): the documented
    pattern, matched in full, and at most 64 characters."""
    assert valid_class_name(name) == bool(CLASS_NAME.fullmatch(name)), repr(name)


# --- (b) over gRPC: a real server on loopback ----------------------------------------------------
def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


async def served_invariants(
        server: RunningServer, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
        http: aiohttp.ClientSession | None = None) -> policy_pb2.GetPolicyResponse:
    """Health SERVING, no ERROR logged, the core's invariants, GetPolicy's estimates and
    decisions in range with the overrides in force respected, and (with ``http``) strict JSON
    from /api/policy and /api/dashboard. Returns the GetPolicy response."""
    check: Callable[..., Awaitable[health_pb2.HealthCheckResponse]] = (
        health_pb2_grpc.HealthStub(channel).Check)
    health = await check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert not errors(caplog), errors(caplog)
    core = server.core
    check_core(core, time.time())
    resp = await async_policy_stub(channel).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
    cfg = core.config
    drafts = offered_drafts(core, resp.engines)
    for c in resp.classes:
        assert CLASS_NAME.fullmatch(c.traffic_class), c.traffic_class
        for e in c.estimates:
            for p in e.positions:
                _probability([p.lower, p.mean, p.upper], f"{c.traffic_class}/{e.draft}")
                assert p.lower <= p.mean + 1e-12 and p.mean <= p.upper + 1e-12, p
                assert math.isfinite(p.effective_tries) and p.effective_tries >= 0, p
            assert all(math.isfinite(x) and x >= 1 for x in e.expected_tokens), e
        for d in c.decisions:
            check_decision(d, cfg.policy.max_k, cfg.n_buckets, drafts, c.traffic_class)
        if c.overrides and drafts:
            respected(c, drafts, cfg.policy.max_k)
    for status in resp.engine_status:
        assert math.isfinite(status.report_age_seconds), status
    if http is not None:
        for path in ("/api/policy", "/api/dashboard"):
            async with http.get(server.http_url + path) as got:
                assert got.status == 200, path
                strict_json(await got.read())
    return resp


def _no_constant(name: str) -> Any:
    raise AssertionError(f"JSON carries {name}")


def strict_json(body: bytes) -> Any:
    return json.loads(body, parse_constant=_no_constant)


def respected(c: policy_pb2.ClassPolicy, drafts: dict[str, int], max_k: int) -> None:
    """The override in force (the first listed) decides every bucket of the class."""
    ov = c.overrides[0]
    action = ov.WhichOneof("action")
    for d in c.decisions:
        where = (c.traffic_class, action, ov, d)
        assert d.reason == common_pb2.DECISION_REASON_OVERRIDE, where
        if action == "force_off":
            assert d.k == 0, where
        elif action == "force_draft":
            if ov.force_draft in drafts:
                assert d.draft == ov.force_draft and 1 <= d.k <= drafts[d.draft], where
            else:
                assert d.k == 0, where
        else:
            pin = min(ov.pin_k, max_k)
            if pin == 0:
                assert d.k == 0, where
            else:
                assert d.k == min(pin, drafts[d.draft]), where
                if any(k >= pin for k in drafts.values()):
                    assert d.k == pin, where


async def _ended_with(call: Any) -> grpc.StatusCode:
    """Read until the stream ends; its status code."""
    try:
        while True:
            msg = await asyncio.wait_for(call.read(), 5.0)
            if msg is cast(Any, grpc.aio).EOF:
                break
    except grpc.aio.AioRpcError as err:
        return err.code()
    code: grpc.StatusCode = await call.code()
    return code


class Stream:
    """One engine stream kept across examples; reconnected when an example ends it."""

    def __init__(self, channel: grpc.aio.Channel, n_buckets: int) -> None:
        self.channel = channel
        self.n_buckets = n_buckets
        self.hello = hello()
        self.client = EngineClient(channel)
        self.engine = Engine("", 0, {}, 0, 0, MIN_STEP_SECONDS)
        self.sequence = 0

    async def connect(self) -> None:
        self.client = EngineClient(self.channel)
        ack = await self.client.connect(self.hello)
        self.engine = Engine.of(self.hello, list(ack.accepted_drafts), self.n_buckets)
        self.sequence = 0


@pytest.fixture
async def stream(server: RunningServer, channel: grpc.aio.Channel) -> AsyncIterator[Stream]:
    s = Stream(channel, server.core.config.n_buckets)
    await s.connect()
    yield s
    await s.client.close()


def _rejected_total(server: RunningServer) -> float:
    return sum(server.metrics.registry.get_sample_value(
        "specpilot_reports_rejected_total", {"reason": r}) or 0.0
        for r in get_args(RejectReason))


@fuzz(120)
@given(data=st.data())
async def test_reports_over_grpc(server: RunningServer, channel: grpc.aio.Channel,
                                 stream: Stream, caplog: pytest.LogCaptureFixture,
                                 data: st.DataObject) -> None:
    msg, plausible = data.draw(reports(stream.engine, stream.sequence + 1), "report")
    request = engine_pb2.ConnectRequest(report=msg)
    if request.ByteSize() > RECEIVE_LIMIT:  # gRPC's own limit ends the stream
        await stream.client.call.write(request)
        assert await _ended_with(stream.client.call) == grpc.StatusCode.RESOURCE_EXHAUSTED
        await stream.connect()
    else:
        at = time.time()
        before, rejected = fingerprint(server.core, at), _rejected_total(server)
        try:
            result = await stream.client.send(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, AssertionError) as exc:
            raise AssertionError(f"the stream ended ({exc!r}); logged: {errors(caplog)}") from exc
        assert result.sequence == msg.sequence
        event(f"report {'taken' if result.accepted else 'refused'}")
        if result.accepted:
            stream.sequence = msg.sequence
        else:
            assert not plausible, f"a plausible report was refused: {result.reason}"
            assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and result.reason
            assert _rejected_total(server) == rejected + 1
            assert fingerprint(server.core, at) == before, "a refused report changed the state"
    await served_invariants(server, channel, caplog)


@fuzz(60)
@given(data=st.data())
async def test_hellos_over_grpc_agree_with_the_pure_layer(
        server: RunningServer, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
        data: st.DataObject) -> None:
    msg, _ = data.draw(hellos(), "hello")
    scratch = ControllerCore(server.core.config, np.random.default_rng(1))
    want = _connect(scratch, msg, time.time())  # the pure layer's verdict
    client = EngineClient(channel)
    request = engine_pb2.ConnectRequest(hello=msg)
    try:
        await client.call.write(request)
        if request.ByteSize() > RECEIVE_LIMIT:
            assert await _ended_with(client.call) == grpc.StatusCode.RESOURCE_EXHAUSTED
        elif want is None:
            assert await _ended_with(client.call) == grpc.StatusCode.INVALID_ARGUMENT
        else:
            ack = (await client.read()).hello_ack
            assert list(ack.accepted_drafts) == want
            await client.next_policy()
            engine = Engine.of(msg, want, server.core.config.n_buckets)
            result = await client.send(data.draw(plausible_report(engine, 1), "report"))
            assert result.accepted, result.reason
            await served_invariants(server, channel, caplog)
    finally:
        # Whatever this example found, its stream ends and the engine is forgotten before the
        # next example names its id again (a stream proving no identity cannot replace a
        # connected one), so a failure is reported as itself, never as the next example's.
        await client.close()
        deadline = time.monotonic() + 10.0  # a loaded CI host takes its time
        while server.core.engines_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    assert not server.core.engines_connected
    assert not errors(caplog), errors(caplog)


# --- raw bytes on the engine stream and on every policy RPC --------------------------------------
def _identity(b: bytes) -> bytes:
    return b


def _parses(cls: type[Message], data: bytes) -> bool:
    try:
        cls.FromString(data)
    except DecodeError:
        return False
    return True


_GOOD = engine_pb2.ConnectRequest(report=report(1)).SerializeToString()
GARBAGE = st.one_of(
    st.sampled_from([
        b"\xff", b"\x0a\x05", b"\x12\x05\x22\x03\x0a\x01\xff",  # a class name of bad UTF-8
        b"\x0b" * 200 + b"\x0c" * 200,  # unknown groups nested past the parser's depth
        b"\x12" + b"\xff" * 10, _GOOD[:-1], _GOOD + b"\x80",
    ]),
    st.binary(max_size=64),
    st.tuples(st.integers(0, len(_GOOD)), st.binary(min_size=1, max_size=4)).map(
        lambda t: _GOOD[:t[0]] + t[1] + _GOOD[t[0] + len(t[1]):]),  # overwritten bytes
)


def _raw_connect(channel: grpc.aio.Channel) -> Any:
    return channel.stream_stream(
        "/specpilot.v1.EngineService/Connect", request_serializer=_identity,
        response_deserializer=engine_pb2.ConnectResponse.FromString)(None)


@fuzz(60)
@given(garbage=GARBAGE)
@example(garbage=b"\xff\xff\xff")
async def test_raw_bytes_as_the_first_message(
        server: RunningServer, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
        garbage: bytes) -> None:
    call = _raw_connect(channel)
    await call.write(garbage)
    if _parses(engine_pb2.ConnectRequest, garbage):
        await call.done_writing()
        code = await _ended_with(call)
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    else:
        assert await _ended_with(call) == grpc.StatusCode.INVALID_ARGUMENT
        details = await call.details()
        assert details.startswith("message 1: not a specpilot.v1.ConnectRequest ("), details
    call.cancel()
    await served_invariants(server, channel, caplog)


@fuzz(60)
@given(garbage=GARBAGE)
@example(garbage=b"\xff\xff\xff")
async def test_raw_bytes_after_the_hello_are_a_rejected_report(
        server: RunningServer, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
        garbage: bytes) -> None:
    call = _raw_connect(channel)
    await call.write(engine_pb2.ConnectRequest(hello=hello("raw")).SerializeToString())
    while not (await call.read()).HasField("policy"):
        pass
    validation = server.metrics.registry.get_sample_value(
        "specpilot_reports_rejected_total", {"reason": "validation"}) or 0.0
    await call.write(garbage)
    while not (msg := await asyncio.wait_for(call.read(), 5.0)).HasField("report_result"):
        pass
    result = msg.report_result
    if not _parses(engine_pb2.ConnectRequest, garbage):
        assert not result.accepted and result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert result.reason.startswith("message 2: not a specpilot.v1.ConnectRequest ("), \
            result.reason
        assert server.metrics.registry.get_sample_value(
            "specpilot_reports_rejected_total", {"reason": "validation"}) == validation + 1
    # The stream stays: a good report is taken.
    (raw,) = [e for e in server.core.snapshot(time.time()).engines if e.engine_id == "raw"]
    following = report((raw.last_sequence or 0) + 1)
    await call.write(engine_pb2.ConnectRequest(report=following).SerializeToString())
    while not (msg := await asyncio.wait_for(call.read(), 5.0)).HasField("report_result"):
        pass
    assert msg.report_result.accepted, msg.report_result.reason
    await call.done_writing()
    call.cancel()
    await served_invariants(server, channel, caplog)


_POLICY = policy_pb2.DESCRIPTOR.services_by_name["PolicyService"]


@fuzz(60)
@given(method=st.sampled_from([m.name for m in _POLICY.methods]), garbage=GARBAGE)
async def test_raw_bytes_to_every_policy_rpc(
        server: RunningServer, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
        method: str, garbage: bytes) -> None:
    m = _POLICY.methods_by_name[method]
    path = f"/{_POLICY.full_name}/{method}"
    parses = _parses(message_factory.GetMessageClass(m.input_type), garbage)
    code = grpc.StatusCode.OK
    try:
        if m.server_streaming:
            call = channel.unary_stream(path, request_serializer=_identity,
                                        response_deserializer=_identity)(garbage, metadata=AUTH)
            try:
                await asyncio.wait_for(call.read(), 0.2)
            finally:
                call.cancel()
        else:
            await channel.unary_unary(path, request_serializer=_identity,
                                      response_deserializer=_identity)(
                garbage, metadata=AUTH, timeout=5)
    except grpc.aio.AioRpcError as err:
        code = err.code()
    except TimeoutError:  # a watch that parsed and waits for decisions
        assert parses
    if not parses:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code)
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method, code)
    await served_invariants(server, channel, caplog)


# --- every policy-API input ---------------------------------------------------------------------
TOKENS = st.sampled_from([
    AUTH, (), (("authorization", "Bearer wrong"),), (("authorization", f"bearer {TOKEN}"),),
    (("authorization", f"Basic {TOKEN}"),), (("authorization", "Bearer"),),
    (("authorization", f"Bearer  {TOKEN} "),), (("authorization", ""),),
])
NAMES = st.one_of(st.sampled_from(["chat", "code", "default", "other", "*", "new-1"]), TEXT)
SCOPES = st.one_of(st.sampled_from([0, 0, 1, 2]), INT32)


@st.composite
def plausible_override(draw: st.DrawFn) -> policy_pb2.SetOverrideRequest:
    """One the policy API takes: a class the engine reported (or "*"), a valid action."""
    ov = policy_pb2.Override(traffic_class=draw(st.sampled_from(["chat", "default", "*"])),
                             note=draw(st.sampled_from(["", "incident 42"])),
                             scope=cast(Any, draw(st.sampled_from([0, 1]))))
    action = draw(st.sampled_from(["pin_k", "force_draft", "force_off"]))
    if action == "pin_k":
        ov.pin_k = draw(st.integers(0, 8))
    elif action == "force_draft":
        ov.force_draft = draw(st.sampled_from([DRAFT, "ngram"]))
    else:
        ov.force_off = True
    return policy_pb2.SetOverrideRequest(override=ov)


@st.composite
def any_override(draw: st.DrawFn) -> policy_pb2.SetOverrideRequest:
    """Each field drawn on its own: mostly refused, for one reason or several."""
    ov = policy_pb2.Override(traffic_class=draw(NAMES),
                             note=draw(st.one_of(st.sampled_from(["", "incident 42"]), TEXT)),
                             scope=cast(Any, draw(SCOPES)))
    action = draw(st.sampled_from(["pin_k", "force_draft", "force_off", "none"]))
    if action == "pin_k":
        ov.pin_k = draw(st.one_of(st.integers(0, 9), UINT32))
    elif action == "force_draft":
        ov.force_draft = draw(st.one_of(st.sampled_from([DRAFT, "ngram", "no-such"]), TEXT))
    elif action == "force_off":
        ov.force_off = draw(st.booleans())
    if draw(st.booleans()):
        ov.set_unix_seconds, ov.set_by = draw(DOUBLES), draw(TEXT)
    request = policy_pb2.SetOverrideRequest(override=ov)
    if draw(st.integers(0, 20)) == 0:
        request.ClearField("override")
    return request


def overrides() -> st.SearchStrategy[policy_pb2.SetOverrideRequest]:
    """Plausible ones (a good share, so that taken overrides are checked too), as drawn or with
    one field perturbed, and any."""
    return st.one_of(plausible_override(), plausible_override(),
                     fuzzed(plausible_override(), policy_pb2.SetOverrideRequest).map(
                         lambda t: t[0]), any_override())


def _expected_auth(auth: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    """What a write with metadata ``auth`` gets for its token alone."""
    if not auth or not auth[0][1]:
        return grpc.StatusCode.UNAUTHENTICATED
    scheme, _, given = auth[0][1].partition(" ")
    if scheme.lower() != "bearer" or given.strip() != TOKEN:
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.OK


def _expected_set(request: policy_pb2.SetOverrideRequest, auth: tuple[tuple[str, str], ...],
                  server: RunningServer) -> grpc.StatusCode:
    """What SetOverride must answer, from the documented rules alone."""
    if request.ByteSize() > RECEIVE_LIMIT:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if _expected_auth(auth) != grpc.StatusCode.OK:
        return _expected_auth(auth)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    ov, core = request.override, server.core
    action = ov.WhichOneof("action")
    if (not request.HasField("override") or ov.scope not in (0, 1) or action is None
            or (action == "force_off" and not ov.force_off)):
        return invalid
    name = ov.traffic_class
    tracked = {c.name for c in core.snapshot(time.time()).classes}
    if name != "*" and not (CLASS_NAME.fullmatch(name) and name in tracked):
        return invalid  # a class an engine reported (or a declared one), or "*"
    if action == "pin_k" and ov.pin_k > core.config.policy.max_k:
        return invalid
    # With engines connected, no more than the largest K they offer.
    if action == "pin_k" and core.engines_connected and ov.pin_k > max(
            (d.max_k for d in core.drafts()), default=0):
        return invalid
    if action == "force_draft" and ov.force_draft not in {d.name for d in core.drafts()}:
        return invalid
    if len(ov.note) > 1000:
        return invalid
    return grpc.StatusCode.OK


def stable(resp: policy_pb2.GetPolicyResponse) -> list[Any]:
    """What a refused write must not change: the classes, their arms and their overrides."""
    return [(c.traffic_class, [(d.batch_bucket, d.draft, d.k) for d in c.decisions],
             [o.SerializeToString() for o in c.overrides]) for c in resp.classes]


def changed(before: policy_pb2.GetPolicyResponse, after: policy_pb2.GetPolicyResponse
            ) -> list[Any]:
    """What differs between two ``stable`` views, class by class."""
    old = {c[0]: c[1:] for c in stable(before)}
    new = {c[0]: c[1:] for c in stable(after)}
    return [(name, old.get(name), new.get(name)) for name in sorted(old.keys() | new.keys())
            if old.get(name) != new.get(name)]


async def _status(call: Awaitable[object]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def engine(stream: Stream) -> Stream:
    """One engine connected with one accepted report for class "chat"."""
    assert (await stream.client.send(report(1))).accepted
    return stream


@fuzz(150)
@given(data=st.data())
async def test_every_override_write(server: RunningServer, channel: grpc.aio.Channel,
                                    engine: Stream, caplog: pytest.LogCaptureFixture,
                                    data: st.DataObject) -> None:
    policy = async_policy_stub(channel)
    auth = data.draw(st.one_of(st.just(AUTH), TOKENS), "auth")
    before = await policy.GetPolicy(policy_pb2.GetPolicyRequest())
    if data.draw(st.integers(0, 3)) == 0:
        clear = policy_pb2.ClearOverrideRequest(traffic_class=data.draw(NAMES),
                                                scope=cast(Any, data.draw(SCOPES)))
        code = await _status(policy.ClearOverride(clear, metadata=auth, timeout=5))
        valid = (clear.traffic_class == "*" or CLASS_NAME.fullmatch(clear.traffic_class)) \
            and clear.scope in (0, 1)
        want = _expected_auth(auth)
        if clear.ByteSize() > RECEIVE_LIMIT:
            want = grpc.StatusCode.RESOURCE_EXHAUSTED
        elif want == grpc.StatusCode.OK and not valid:
            want = grpc.StatusCode.INVALID_ARGUMENT
        assert code == want, (clear, auth)
    else:
        request = data.draw(overrides(), "request")
        want = _expected_set(request, auth, server)
        code = await _status(policy.SetOverride(request, metadata=auth, timeout=5))
        assert code == want, (request, auth)
        event(f"SetOverride {code.name}")
    after = await served_invariants(server, channel, caplog)
    if code != grpc.StatusCode.OK:
        assert stable(after) == stable(before), ("a refused write changed the policy",
                                                 changed(before, after))


EXPLAIN = st.builds(policy_pb2.ExplainDecisionRequest, traffic_class=NAMES,
                    batch_bucket=st.one_of(st.integers(0, 10), UINT32))


@fuzz(60)
@given(method=st.sampled_from(["GetPolicy", "ExplainDecision", "WatchDecisions",
                               "GetRecommendations"]),
       name=NAMES, explain=EXPLAIN, auth=TOKENS)
async def test_every_read(server: RunningServer, channel: grpc.aio.Channel, engine: Stream,
                          caplog: pytest.LogCaptureFixture, method: str, name: str,
                          explain: policy_pb2.ExplainDecisionRequest,
                          auth: tuple[tuple[str, str], ...]) -> None:
    policy: AsyncPolicyStub = async_policy_stub(channel)
    snap = server.core.snapshot(time.time())
    known = name == "" or name in {c.name for c in snap.classes}
    cfg = server.core.config
    drafts = offered_drafts(server.core, snap.engines)
    oversized = (explain.ByteSize() if method == "ExplainDecision"
                 else len(name.encode())) > RECEIVE_LIMIT
    try:
        if method == "GetPolicy":
            resp = await policy.GetPolicy(policy_pb2.GetPolicyRequest(traffic_class=name),
                                          metadata=auth, timeout=5)
            assert known and (not name or [c.traffic_class for c in resp.classes] == [name])
        elif method == "ExplainDecision":
            ex = await policy.ExplainDecision(explain, metadata=auth, timeout=5)
            assert explain.batch_bucket < cfg.n_buckets
            check_decision(ex.decision, cfg.policy.max_k, cfg.n_buckets, drafts, "explain")
            for arm in ex.arms:
                assert all(math.isfinite(v) for v in (arm.expected_tokens, arm.step_seconds,
                                                      arm.goodput_tokens_per_second,
                                                      arm.speedup)), arm
                assert arm.step_seconds > 0, arm
        elif method == "WatchDecisions":
            replay = len(snap.events(name))
            call = policy.WatchDecisions(policy_pb2.WatchDecisionsRequest(traffic_class=name),
                                         metadata=auth)
            for _ in range(replay):
                got = cast(policy_pb2.WatchDecisionsResponse,
                           await asyncio.wait_for(call.read(), 5.0))
                e = got.event
                assert not name or e.decision.traffic_class == name
                # The log is history: its drafts need not be offered now.
                check_decision(e.decision, cfg.policy.max_k, cfg.n_buckets, None, "watch")
            call.cancel()
        else:
            await policy.GetRecommendations(
                policy_pb2.GetRecommendationsRequest(traffic_class=name), metadata=auth,
                timeout=5)
            raise AssertionError("recommendations without a shared store")
    except grpc.aio.AioRpcError as err:
        if oversized:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        elif method == "GetPolicy":
            assert err.code() == grpc.StatusCode.NOT_FOUND and not known
        elif method == "ExplainDecision":
            assert err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
        else:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    await served_invariants(server, channel, caplog)


# --- the dashboard's HTTP write endpoints ---------------------------------------------------------
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12)
FIELD_VALUES = st.one_of(JSON_VALUES, st.sampled_from(
    ["chat", "*", 0, 1, 8, 9, 2**32, 2**64, -1, "2", 1.5, 1e400, True, DRAFT,
     "OVERRIDE_SCOPE_POD", "OVERRIDE_SCOPE_FLEET", "OVERRIDE_SCOPE_NOPE", "NaN", "n" * 1001]))
OVERRIDE_KEYS = ["traffic_class", "pin_k", "force_draft", "force_off", "note", "scope",
                 "set_unix_seconds", "set_by", "trafficClass", "pinK", "unknown"]


@st.composite
def http_bodies(draw: st.DrawFn, path: str) -> bytes:
    kind = draw(st.sampled_from(["plausible", "plausible", "override", "clear", "json",
                                 "bytes", "special"]))
    body: Any
    if kind == "plausible" and path.endswith("/clear"):  # as the page sends them
        body = {"traffic_class": draw(st.sampled_from(["chat", "default", "*"]))}
    elif kind == "plausible":
        body = to_json_dict(draw(overrides()))
    elif kind == "override":
        fields = draw(st.dictionaries(st.sampled_from(OVERRIDE_KEYS), FIELD_VALUES, max_size=4))
        body = {"override": fields}
    elif kind == "clear":
        body = draw(st.dictionaries(st.sampled_from(["traffic_class", "scope", "x"]),
                                    FIELD_VALUES, max_size=3))
    elif kind == "json":
        body = draw(JSON_VALUES)
    elif kind == "bytes":
        return draw(st.binary(max_size=100))
    else:
        return draw(st.sampled_from([
            b"", b"{", b"[" * 100_000 + b"]" * 100_000, b'{"override": ' * 5000 + b"1",
            b'{"override": {"traffic_class": "chat", "pin_k": NaN}}',
            b'{"override": {"traffic_class": "chat", "force_off": true, "note": "'
            + b"n" * (2 * 1024 * 1024) + b'"}}',
            b'{"traffic_class": "\xff"}', b'{"traffic_class": "\\ud800"}',
        ]))
    return json.dumps(body).encode()


CONTENT_TYPES = st.sampled_from([
    "application/json", "application/json; charset=utf-8", "text/plain",
    "application/json; charset=latin-1", "application/json; charset=bogus", "",
])
HTTP_AUTH = st.one_of(st.just(f"Bearer {TOKEN}"), st.sampled_from(
    [f"Bearer {TOKEN}", "", "Bearer wrong", f"Basic {TOKEN}", "Bearer"]))
PATHS = ["/api/overrides", "/api/overrides/clear"]


@fuzz(100)
@given(request=st.sampled_from(PATHS).flatmap(lambda p: st.tuples(st.just(p), http_bodies(p))),
       content_type=st.one_of(st.just("application/json"), CONTENT_TYPES),
       authorization=HTTP_AUTH)
async def test_http_writes_answer_4xx_with_a_reason_never_500(
        server: RunningServer, channel: grpc.aio.Channel, engine: Stream,
        caplog: pytest.LogCaptureFixture, request: tuple[str, bytes], content_type: str,
        authorization: str) -> None:
    path, body = request
    headers = {k: v for k, v in (("Content-Type", content_type),
                                 ("Authorization", authorization)) if v}
    async with aiohttp.ClientSession() as http:
        before = await served_invariants(server, channel, caplog)
        async with http.post(server.http_url + path, data=body, headers=headers) as resp:
            status, answer = resp.status, await resp.read()
            json_answer = resp.content_type == "application/json"
        event(f"HTTP {status}")
        assert status == 200 or 400 <= status < 500, (status, answer[:200])
        if json_answer:
            parsed = strict_json(answer)
            assert status == 200 or parsed["error"], parsed
        else:
            assert status != 200 and answer, (status, answer[:200])
        after = await served_invariants(server, channel, caplog, http)
    if status != 200:
        assert stable(after) == stable(before), ("a refused write changed the policy",
                                                 changed(before, after))


def one_line_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Every specpilot log line is one line of printable text, without a traceback."""
    for r in caplog.records:
        if r.name.startswith("specpilot"):
            line = r.getMessage()
            assert line.isprintable() and r.exc_info is None, (r.levelname, line[:300])


# Engine ids of every kind of text: line breaks, escapes, NUL, separators, long ones.
ENGINE_IDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=256)


@fuzz(60)
@given(engine_id=ENGINE_IDS)
@example(engine_id="e1\nspecpilot: CRITICAL root: forged")
@example(engine_id="e1\x1b[2J\x00\u2028")
async def test_engine_ids_never_forge_a_log_line(
        server: RunningServer, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
        engine_id: str) -> None:
    caplog.clear()
    engine = EngineClient(channel)
    try:
        await engine.connect(hello(engine_id))  # a draft is refused: a WARNING names the id
    except grpc.aio.AioRpcError as exc:
        event(f"hello refused: {exc.code()}")
    finally:
        engine.call.cancel()
    one_line_logs(caplog)
    await served_invariants(server, channel, caplog)


# Raw request heads: methods, targets, versions and headers of any bytes, and over-long ones.
HEAD_PART = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                      st.integers(8_000, 40_000).map(lambda n: b"a" * n))
RAW_REQUESTS = st.builds(
    lambda method, target, version, headers: b"%s %s %s\r\n%s\r\n" % (
        method, target, version, b"".join(h + b"\r\n" for h in headers)),
    st.one_of(st.sampled_from([b"GET", b"POST", b"PRI", b"G\x00T"]), HEAD_PART),
    st.one_of(st.sampled_from([b"/healthz", b"/api/events", b"/api/dashboard", b"*"]),
              HEAD_PART),
    st.one_of(st.just(b"HTTP/1.1"), HEAD_PART),
    st.lists(st.one_of(st.sampled_from([b"Host: evil.example", b"Host: 127.0.0.1",
                                        b"Connection: keep-alive"]), HEAD_PART), max_size=4))


@fuzz(80)
@given(request=RAW_REQUESTS)
@example(request=b"PRI /healthz HTTP/1.1\r\n\r\n")  # held until the idle timeout
async def test_raw_http_requests_cost_no_error_log_and_leave_health_fast(
        server: RunningServer, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture,
        request: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        writer.write(request)
        await writer.drain()
        # An answer, or the close: at once, or (a head llhttp pauses on, such as a `PRI` line
        # that is not HTTP/2's preface) when http_idle_timeout_seconds (15 s) ends it.
        answer = await asyncio.wait_for(reader.read(200), 20)
    except ConnectionError:
        answer = b""
    finally:
        writer.close()
    event(answer[:12].decode(errors="replace") or "closed")
    one_line_logs(caplog)
    start = time.perf_counter()
    async with aiohttp.ClientSession() as http, http.get(server.http_url + "/healthz") as r:
        assert r.status == 200
    assert time.perf_counter() - start < 1.0
    await served_invariants(server, channel, caplog)


# --- regressions the fuzzer found, as plain examples ----------------------------------------------
def test_a_class_name_with_a_trailing_newline_is_refused() -> None:
    """``$`` matches before a final newline: "chat\\n" passed the class-name check and became a
    class of its own (and a metric label)."""
    core = ControllerCore(_CORE_CONFIG, np.random.default_rng(1))
    assert _connect(core, hello(), 1000.0) is not None
    bad = report(1)
    bad.acceptance[0].traffic_class = "chat\n"
    with pytest.raises(ReportRejected, match="class name"):
        core.ingest("engine-1", report_from_proto(bad), 1000.0)
