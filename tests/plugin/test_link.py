"""The controller link against the real controller on loopback (``start_server`` on its own loop
in a background thread): hello and policy, reports applied by the core, drop-oldest, rejected
reports, heartbeats, a controller that dies and comes back, and a controller that is not there."""

from __future__ import annotations

import logging
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.controller_thread import ControllerThread
from specpilot.contract.records import DraftKind, DraftSpec, EngineHello, HelloAck
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.snapshot import EngineView
from specpilot.controller.server import app
from specpilot.controller.server.auth import engine_token
from specpilot.engine_plugin.config import PluginConfig
from specpilot.engine_plugin.link import (
    KEEPALIVE_OPTIONS,
    MAX_SHED_BACKOFF,
    SHED_RECOVERY,
    ControllerLink,
    backoff_delay,
    shed_backoff,
    shed_pause,
)
from specpilot.engine_plugin.policy.stats import ReportPayload, StatsAggregator
from specpilot.engine_plugin.policy.view import Choice, PolicyView

pytestmark = pytest.mark.integration

ENGINE = "engine-test"
DRAFT = "d"
BOUNDS = [1, 8, 32]
# Reports every 50 ms, fail-static after 0.5 s, the HelloAck's bounds distinct from the defaults.
CONTROLLER_SETTINGS: dict[str, Any] = {
    "report_interval_seconds": 0.05, "fail_static_timeout_seconds": 0.5, "seed": 1,
    "batch_bucket_upper_bounds": BOUNDS, "policy_token": "test-token-0123456789",
}


def hello(engine_id: str = ENGINE) -> EngineHello:
    return EngineHello(
        engine_id=engine_id, model="tiny", target_vocab_hash="v1", max_k=4,
        drafts=(
            DraftSpec(DRAFT, DraftKind.MODEL, 4, "v1"),
            DraftSpec("mismatched", DraftKind.MODEL, 4, "v2"),
            DraftSpec("ngram", DraftKind.NGRAM, 4),
        ),
        per_request_k=True, engine_version="test", plugin_version="test", max_batch_size=256)


def config(target: str, **overrides: Any) -> PluginConfig:
    values: dict[str, Any] = {
        "controller": target, "engine_id": ENGINE, "report_interval_seconds": 0.05,
        "queue_size": 8, "reconnect_initial_seconds": 0.02, "reconnect_max_seconds": 0.2,
        **overrides}
    return PluginConfig(**values)


def wait_for(cond: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def payload(steps_by_accepted: tuple[int, ...], cls: str = "chat", draft: str = DRAFT,
            running: int = 0) -> ReportPayload:
    agg = StatsAggregator()
    for accepted, n in enumerate(steps_by_accepted):
        for _ in range(n):
            agg.record_verification(cls, draft, len(steps_by_accepted) - 1, accepted)
    agg.record_step(2, 6, 4, draft, 2, 0.01)
    return agg.drain(running_requests=running)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def controller() -> Iterator[ControllerThread]:
    c = ControllerThread(**CONTROLLER_SETTINGS)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(name="links")
def link_fixture() -> Iterator[list[ControllerLink]]:
    """Links a test makes, stopped after it."""
    made: list[ControllerLink] = []
    yield made
    for link in made:
        link.stop()


def make_link(links: list[ControllerLink], target: str, view: PolicyView | None = None,
              **overrides: Any) -> ControllerLink:
    start = overrides.pop("start", True)
    view = view or PolicyView(4, DRAFT, 30.0)
    link = ControllerLink(target, hello(), view, config(target, **overrides),
                          rng=random.Random(0), start=start)
    links.append(link)
    return link


def evidence(controller: ControllerThread, cls: str, draft: str) -> tuple[list[float], ...]:
    """Decayed accepts and rejects per position, minus the prior, read on the server's loop."""
    def read(core: ControllerCore) -> tuple[list[float], ...]:
        estimate = core.estimate(cls, draft, time.time())
        if not estimate.has_evidence:
            return ([], [])
        post = estimate.posterior
        return ((post.alpha - post.prior_alpha).tolist(), (post.beta - post.prior_beta).tolist())
    return controller.call(read)


def engine_view(controller: ControllerThread) -> EngineView:
    """This test's engine as the controller sees it, read on the server's loop."""
    def read(core: ControllerCore) -> EngineView:
        return next(e for e in core.snapshot(time.time()).engines if e.engine_id == ENGINE)
    return controller.call(read)


def metric(controller: ControllerThread, name: str) -> float | None:
    return controller.call(lambda _: controller.server.metrics.registry.get_sample_value(name))


# --- unit -------------------------------------------------------------------------------------
def test_keepalive_is_compatible_with_the_server() -> None:
    server = dict(app.KEEPALIVE_OPTIONS)
    client = dict(KEEPALIVE_OPTIONS)
    # Client pings no more often than the server tolerates (else GOAWAY too_many_pings).
    min_interval = server["grpc.http2.min_ping_interval_without_data_ms"]
    assert client["grpc.keepalive_time_ms"] >= min_interval
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.keepalive_permit_without_calls"] == 1
    pings = "grpc.http2.max_pings_without_data"
    assert client[pings] == server[pings] == 0
    assert client["grpc.keepalive_timeout_ms"] == server["grpc.keepalive_timeout_ms"]


def test_backoff_is_exponential_with_full_jitter() -> None:
    rng = random.Random(3)
    for failures, ceiling in [(0, 0.5), (1, 1.0), (2, 2.0), (4, 8.0), (5, 10.0), (500, 10.0)]:
        draws = [backoff_delay(failures, 0.5, 10.0, rng) for _ in range(2000)]
        assert min(draws) >= 0.0 and max(draws) <= ceiling
        assert max(draws) > 0.95 * ceiling and min(draws) < 0.05 * ceiling
        assert statistics.mean(draws) == pytest.approx(ceiling / 2, rel=0.1)


# --- against the real controller ---------------------------------------------------------------
def test_hello_then_policy_arrives_in_the_view(
    controller: ControllerThread, links: list[ControllerLink], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="specpilot.engine_plugin.link")
    view = PolicyView(4, DRAFT, 30.0)
    acks: list[HelloAck] = []
    link = make_link(links, controller.target, view)
    link._on_ack = acks.append  # the callback hook, set before the first ack arrives
    wait_for(lambda: view.version > 0, "the first policy")
    assert link.connected and link.connects == 1
    # The HelloAck's settings reached the link and the view (the plugin's one copy of the bounds).
    assert link.report_interval_seconds == 0.05
    assert view.bucket_bounds == tuple(BOUNDS)
    assert view.fail_static_timeout_seconds == 0.5
    assert [list(a.accepted_drafts) for a in acks] == [[DRAFT, "ngram"]]
    # The controller's warm-up decision: K=2 with the model draft, for every bucket.
    version = controller.call(lambda core: core.version)
    assert view.version == version
    assert {view.choice("anything", b, "r") for b in (1, 5, 20, 100)} == {Choice(DRAFT, 2, False)}
    # The refused draft is logged loudly, with the controller's reason.
    refused = [r for r in caplog.records if r.levelno == logging.ERROR and "REFUSED" in r.message]
    assert len(refused) == 1 and "'mismatched'" in refused[0].message
    assert "vocabulary hash" in refused[0].message


def test_submitted_payloads_reach_the_estimator(
    controller: ControllerThread, links: list[ControllerLink],
) -> None:
    view = PolicyView(4, DRAFT, 30.0)
    link = make_link(links, controller.target, view)
    wait_for(lambda: view.version > 0, "the first policy")
    version = view.version
    link.submit(payload((1, 2, 7), running=3))  # 10 steps at K=2
    wait_for(lambda: evidence(controller, "chat", DRAFT)[0], "the report's evidence")
    accepts, rejects = evidence(controller, "chat", DRAFT)
    # tries_1 = 10, accepts_1 = 9; tries_2 = 9, accepts_2 = 7 (decay over < 1 s of a 300 s
    # half-life is below 0.3%).
    assert accepts[:2] == pytest.approx([9, 7], rel=0.01)
    assert rejects[:2] == pytest.approx([1, 2], rel=0.01)
    assert sum(accepts[2:]) == sum(rejects[2:]) == 0
    engine = engine_view(controller)
    if engine.last_sequence == 1:  # else a heartbeat followed (it carries the version then)
        assert engine.running_requests == 3
        # The version in force when the payload was submitted.
        assert engine.policy_version_applied == version
    assert link.reports_sent == 1 and link.reports_rejected == 0


def test_queue_overflow_drops_the_oldest_and_reports_it(
    controller: ControllerThread, links: list[ControllerLink],
) -> None:
    link = make_link(links, controller.target, queue_size=3, start=False)
    for i in range(5):  # 1, 2, 4, 8, 16 steps, every draft accepted
        link.submit(payload((0, 2**i)))
    assert link.queued == 3 and link.dropped == 2
    assert link.records_dropped == 4  # each dropped payload held a histogram and a step sum
    link.start()
    wait_for(lambda: link.queued == 0 and link.reports_accepted >= 3, "the queued reports")
    wait_for(lambda: metric(controller, "specpilot_engine_records_dropped_total") == 4,
             "records_dropped on the controller")
    accepts, rejects = evidence(controller, "chat", DRAFT)
    assert accepts[0] == pytest.approx(4 + 8 + 16, rel=0.01)  # the two oldest are gone
    assert rejects[0] == 0


def test_shed_reports_are_sent_again_later_and_nothing_is_lost(
    links: list[ControllerLink],
) -> None:
    # 1 ms of loop time a second for reports: less than a report and its decide round, so
    # the next one is shed (work beyond a window's budget is carried into the next). Evidence
    # that barely decays, so the sum counts every payload exactly however late the last one is
    # taken (at the default half-life 30 s of re-sends would cost 7% of it).
    controller = ControllerThread(**{**CONTROLLER_SETTINGS, "report_budget_share": 0.001,
                                     "half_life_seconds": 1e6})
    try:
        link = make_link(links, controller.target, queue_size=16, start=False)
        for i in range(3):  # 1, 2, 4 steps, every draft accepted
            link.submit(payload((0, 2**i)))
        link.start()
        wait_for(lambda: link.reports_shed > 0, "a shed report")
        assert link.report_interval_seconds > 0.05  # stretched while the controller sheds
        # Every payload taken in the end: none lost.
        wait_for(lambda: evidence(controller, "chat", DRAFT)[0][:1] == pytest.approx(
            [1 + 2 + 4], rel=0.01), "every payload taken", timeout=180.0)  # a busy CI host
        assert link.dropped == 0
        shed = metric(controller, "specpilot_reports_shed_total")
        assert shed is not None and shed == link.reports_shed > 0
    finally:
        controller.stop()


def test_rejected_report_is_logged_and_the_stream_stays(
    controller: ControllerThread, links: list[ControllerLink], caplog: pytest.LogCaptureFixture,
) -> None:
    view = PolicyView(4, DRAFT, 30.0)
    link = make_link(links, controller.target, view)
    wait_for(lambda: link.connected, "the connection")
    with caplog.at_level(logging.WARNING, logger="specpilot.engine_plugin.link"):
        link.submit(payload((1, 1), draft="mismatched"))  # a draft the controller refused
        wait_for(lambda: link.reports_rejected == 1, "the rejection")
    assert "rejected report 1" in caplog.text and "unknown draft 'mismatched'" in caplog.text
    link.submit(payload((0, 5)))
    wait_for(lambda: evidence(controller, "chat", DRAFT)[0], "the next report's evidence")
    assert link.connects == 1 and link.connected


def test_idle_engine_sends_heartbeats_and_stays_on_policy(
    controller: ControllerThread, links: list[ControllerLink],
) -> None:
    view = PolicyView(4, DRAFT, 30.0)
    link = make_link(links, controller.target, view)
    wait_for(lambda: view.version > 0, "the first policy")
    deadline = time.monotonic() + 1.2  # more than twice the 0.5 s fail-static timeout
    while time.monotonic() < deadline:
        assert not view.fail_static
        time.sleep(0.02)
    assert link.heartbeats_sent >= 5 and link.reports_sent == 0


def test_controller_dies_and_returns(links: list[ControllerLink]) -> None:
    first = ControllerThread(**CONTROLLER_SETTINGS)
    port = first.port
    second: ControllerThread | None = None
    view = PolicyView(3, DRAFT, 30.0)
    link = make_link(links, first.target, view)
    latencies: list[float] = []
    stop = threading.Event()

    def scheduler() -> None:  # submits like a scheduler loop, throughout
        while not stop.is_set():
            p = payload((0, 1, 1))
            t0 = time.perf_counter()
            link.submit(p)
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.005)

    sched = threading.Thread(target=scheduler)
    try:
        wait_for(lambda: view.version > 0, "the first policy")
        sched.start()
        wait_for(lambda: link.reports_accepted > 2, "reports on the first controller")
        last_version = view.version
        first_ack = link.last_hello_ack
        view.set_folded_classes(["folded-by-the-first"])
        first.stop()
        wait_for(lambda: not link.connected, "the link to notice")
        # Fail-static: the last policy, then after the timeout the static configuration.
        wait_for(lambda: view.fail_static, "fail-static", timeout=2.0)
        assert view.choice("chat", 1, "r") == Choice(DRAFT, 3, False) and view.version == 0
        second = ControllerThread(**CONTROLLER_SETTINGS, grpc_port=port)
        wait_for(lambda: link.connected and view.version > 0, "the reconnect")
        # The new controller's policy is in force again (no longer the static K=3).
        assert view.choice("new-class", 1, "r") == Choice(DRAFT, 2, False)
        assert link.connects == 2
        # A new epoch: its versions continue above the first controller's, and what the first
        # folded is forgotten.
        assert first_ack is not None and link.last_hello_ack is not None
        assert link.last_hello_ack.policy_epoch > first_ack.policy_epoch > 0
        wait_for(lambda: view.version > last_version, "the new controller's policy")
        assert view.folded_classes == frozenset()
        wait_for(lambda: evidence(second, "chat", DRAFT)[0], "reports on the new controller")
        # Sequence numbers started again at 1 on the new stream (else it would reject them).
        engine = engine_view(second)
        assert engine.last_sequence is not None
        assert engine.last_sequence < link.reports_sent + link.heartbeats_sent
    finally:
        stop.set()
        if sched.is_alive():
            sched.join()
        first.stop()
        if second is not None:
            second.stop()
    assert len(latencies) > 50
    assert max(latencies) < 0.05, f"submit blocked for {max(latencies):.3f} s"
    assert statistics.median(latencies) < 0.001


def test_nothing_listening_never_blocks_submit(links: list[ControllerLink]) -> None:
    target = f"127.0.0.1:{free_port()}"
    view = PolicyView(4, DRAFT, 30.0)
    link = make_link(links, target, view, queue_size=16)
    p = payload((1, 1))
    t0 = time.perf_counter()
    worst = 0.0
    for _ in range(500):
        t = time.perf_counter()
        link.submit(p)
        worst = max(worst, time.perf_counter() - t)
    assert time.perf_counter() - t0 < 0.5 and worst < 0.05
    time.sleep(0.3)  # several connection attempts
    assert not link.connected and link.connects == 0
    assert link.queued == 16 and link.dropped == 500 - 16
    assert view.version == 0 and view.choice("c", 1, "r") == Choice(DRAFT, 4, False)
    t0 = time.perf_counter()
    link.stop()
    assert time.perf_counter() - t0 < 1.0 and not link._thread.is_alive()


def test_stop_is_prompt_in_backoff_and_when_connected(
    controller: ControllerThread, links: list[ControllerLink],
) -> None:
    idle = make_link(links, f"127.0.0.1:{free_port()}", reconnect_initial_seconds=5.0,
                     reconnect_max_seconds=10.0)
    live = make_link(links, controller.target)
    wait_for(lambda: live.connected, "the connection")
    time.sleep(0.1)  # the idle link is now waiting out its backoff
    for link in (idle, live):
        t0 = time.perf_counter()
        link.stop()
        assert time.perf_counter() - t0 < 1.0 and not link._thread.is_alive()
    assert not live.connected
    live.submit(payload((1, 1)))  # after stop: still no error, no block


def test_without_a_controller_no_thread_starts(links: list[ControllerLink]) -> None:
    view = PolicyView(4, DRAFT, 30.0)
    link = make_link(links, "", view, queue_size=2)
    link.start()
    assert link._thread.ident is None
    for _ in range(3):
        link.submit(payload((1, 1)))
    assert link.queued == 2 and link.dropped == 1 and not link.connected
    assert view.choice("c", 1, "r") == Choice(DRAFT, 4, False)
    link.stop()


def test_start_is_idempotent(controller: ControllerThread, links: list[ControllerLink]) -> None:
    link = make_link(links, controller.target, start=False)
    link.start()
    link.start()
    wait_for(lambda: link.connected, "the connection")
    assert link.connects == 1


def test_refused_hello_is_an_error_and_retried(
    controller: ControllerThread, links: list[ControllerLink], caplog: pytest.LogCaptureFixture,
) -> None:
    view = PolicyView(4, DRAFT, 30.0)
    cfg = config(controller.target)
    good = hello()
    # The controller refuses the hello: drafts[0].max_k must be >= 1.
    bad = replace(good, drafts=(replace(good.drafts[0], max_k=0), *good.drafts[1:]))
    with caplog.at_level(logging.DEBUG, logger="specpilot.engine_plugin.link"):
        link = ControllerLink(controller.target, bad, view, cfg, rng=random.Random(0))
        links.append(link)
        wait_for(lambda: sum("still unreachable" in r.message for r in caplog.records) >= 2,
                 "retries")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "INVALID_ARGUMENT" in errors[0].message
    assert "drafts[0].max_k" in errors[0].message
    assert not link.connected and view.version == 0


def test_steps_are_bucketed_with_the_controllers_bounds(
    controller: ControllerThread, links: list[ControllerLink],
) -> None:
    """Recorded before the HelloAck (under the default bounds batch 100 is bucket 7 of 9), sent
    to a controller with 4 buckets: bucketed at send time, so bucket 3 and accepted."""
    agg = StatsAggregator()
    agg.record_step(100, 300, 200, DRAFT, 2, 0.05)
    link = make_link(links, controller.target, start=False)
    link.submit(agg.drain(running_requests=100))
    link.start()
    wait_for(lambda: link.reports_accepted + link.reports_rejected >= 1, "the result")
    assert link.reports_rejected == 0
    load = engine_view(controller).running_requests
    assert load == 100


def test_the_link_presents_its_token_and_a_wrong_one_is_refused(
    links: list[ControllerLink], caplog: pytest.LogCaptureFixture,
) -> None:
    guarded = ControllerThread(**CONTROLLER_SETTINGS, engine_token="engine-secret-42")
    try:
        good = make_link(links, guarded.target, token="engine-secret-42")
        wait_for(lambda: good.connected, "the link with the token")
        bad = make_link(links, guarded.target, token="guessed")
        with caplog.at_level(logging.ERROR, logger="specpilot.engine_plugin.link"):
            wait_for(lambda: "PERMISSION_DENIED" in caplog.text, "the refusal logged")
        assert not bad.connected and good.connected
    finally:
        guarded.stop()


def test_the_link_reads_its_own_token_from_its_file_at_each_connect(
    links: list[ControllerLink], caplog: pytest.LogCaptureFixture, tmp_path: Path,
) -> None:
    secret = "engine-secret-0123456789abcdef-0123456789"
    guarded = ControllerThread(**CONTROLLER_SETTINGS, engine_secret=secret)
    try:
        path = tmp_path / "token"
        with caplog.at_level(logging.DEBUG, logger="specpilot.engine_plugin.link"):
            link = make_link(links, guarded.target, token_file=str(path))
            wait_for(lambda: "SPECPILOT_PLUGIN_TOKEN_FILE" in caplog.text, "the missing file")
            assert not link.connected
            # Another engine's token, claiming this engine's id: refused.
            path.write_text(engine_token(secret, "another-engine") + "\n")
            wait_for(lambda: "token is not engine_id" in caplog.text, "the refusal logged")
            assert not link.connected
            path.write_text(engine_token(secret, ENGINE) + "\n")  # its own, re-issued
            wait_for(lambda: link.connected, "the link with its own token")
    finally:
        guarded.stop()


def test_a_shed_report_waits_for_the_longer_of_the_backoff_and_the_controllers_hint() -> None:
    # The controller's retry_after_seconds is honoured where it asks for more than the
    # plugin's own stretched interval, never past MAX_SHED_BACKOFF intervals, and a hint that
    # is not a number changes nothing.
    assert shed_pause(1.0, 2.0, 0.5) == 2.0  # the backoff is longer
    assert shed_pause(1.0, 2.0, 5.0) == 5.0  # the hint is longer
    assert shed_pause(1.0, 2.0, 1e9) == MAX_SHED_BACKOFF  # capped
    assert shed_pause(0.5, 1.0, float("nan")) == 0.5
    factor = 1.0
    for _ in range(10):
        factor = shed_backoff(factor, shed=True)
    assert factor == MAX_SHED_BACKOFF
    assert shed_backoff(factor, shed=False) == MAX_SHED_BACKOFF / SHED_RECOVERY
    assert shed_backoff(1.1, shed=False) == 1.0
