"""The policy in force: lookups per (class, bucket), defaults, probing, fail-static and recovery."""

from __future__ import annotations

import random
import threading

import pytest

from specpilot.contract.engine_stream import policy_update_from_proto
from specpilot.engine_plugin.policy.points import probe_point
from specpilot.engine_plugin.policy.view import PROBE_EPOCH_SECONDS, Choice, PolicyView
from specpilot.v1 import common_pb2, engine_pb2

BOUNDS = (1, 4, 16)  # buckets 0: 1, 1: 2..4, 2: 5..16, 3: 17+


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def decision(cls: str, bucket: int, draft: str, k: int, probe_rate: float = 0.0,
             probe_k: int = 0, probe_draft: str = "") -> common_pb2.Decision:
    return common_pb2.Decision(traffic_class=cls, batch_bucket=bucket, draft=draft, k=k,
                               probe_rate=probe_rate, probe_k=probe_k, probe_draft=probe_draft)


def put(view: PolicyView, update: engine_pb2.PolicyUpdate) -> None:
    """Put ``update`` in force as the link does: the message made a record first."""
    view.apply(policy_update_from_proto(update))


def update(version: int = 7, timeout: float = 0.0) -> engine_pb2.PolicyUpdate:
    return engine_pb2.PolicyUpdate(
        version=version,
        decisions=[
            decision("chat", 0, "d", 4), decision("chat", 1, "d", 3),
            decision("chat", 2, "ngram", 2), decision("chat", 3, "", 0),
            decision("hard", 0, "", 0, probe_rate=0.1, probe_k=2, probe_draft="d"),
            decision("other", 0, "d", 1),
        ],
        default_decisions=[decision("", b, "d", 2) for b in range(4)],
        fail_static_timeout_seconds=timeout,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def view(clock: FakeClock) -> PolicyView:
    v = PolicyView(static_k=4, static_draft="d", fail_static_timeout_seconds=30, clock=clock,
                   bucket_bounds=BOUNDS)
    put(v, update())
    return v


def test_static_before_any_policy(clock: FakeClock) -> None:
    v = PolicyView(3, "d", 30, clock=clock)
    v.heard_from_controller()  # a HelloAck alone is not a policy
    assert v.choice("chat", 1, "r1") == Choice("d", 3, False)
    assert v.version == 0 and v.fail_static


def test_lookup_by_class_and_bucket(view: PolicyView) -> None:
    assert view.version == 7 and not view.fail_static
    assert view.choice("chat", 1, "r") == Choice("d", 4, False)
    assert view.choice("chat", 2, "r") == Choice("d", 3, False)
    assert view.choice("chat", 4, "r") == Choice("d", 3, False)
    assert view.choice("chat", 5, "r") == Choice("ngram", 2, False)
    assert view.choice("chat", 500, "r") == Choice("", 0, False)
    # Unknown classes and buckets a class has no decision for take the defaults.
    assert view.choice("new-class", 1, "r") == Choice("d", 2, False)
    assert view.choice("hard", 8, "r") == Choice("d", 2, False)


def test_bucket_mapping(view: PolicyView) -> None:
    assert [view.bucket_of(b) for b in (0, 1, 2, 4, 5, 16, 17, 10_000)] == [0, 0, 1, 1, 2, 2, 3, 3]
    view.set_bucket_bounds([8])
    assert [view.bucket_of(b) for b in (1, 8, 9)] == [0, 0, 1]
    assert view.choice("chat", 9, "r") == Choice("d", 3, False)
    with pytest.raises(ValueError):
        view.set_bucket_bounds([8, 2])
    assert view.bucket_bounds == (8,)


def test_k_is_never_above_the_engines_max(clock: FakeClock) -> None:
    v = PolicyView(2, "d", 30, clock=clock, bucket_bounds=BOUNDS)
    put(v, update())
    assert v.choice("chat", 1, "r") == Choice("d", 2, False)


def test_probe_share_tracks_probe_rate_and_is_stable(view: PolicyView) -> None:
    """Within one probe epoch (the clock does not move here)."""
    keys = [f"req-{i}" for i in range(20_000)]
    choices = [view.choice("hard", 1, key) for key in keys]
    probed = {key for key, c in zip(keys, choices, strict=True) if c.probe}
    assert all(c == Choice("d", 2, True) for c in choices if c.probe)
    assert all(c == Choice("", 0, False) for c in choices if not c.probe)
    # Binomial(20000, 0.1): sd 0.0021; allow 5 sd.
    assert abs(len(probed) / len(keys) - 0.1) < 0.011
    # The same requests every time (every step, every process: blake2b is not salted).
    assert probed == {k for k in keys if view.choice("hard", 1, k).probe}
    assert probe_point("req-1") == probe_point("req-1")
    # A lower rate probes a subset of the same requests.
    lower = update(version=8)
    lower.decisions[4].probe_rate = 0.02
    put(view, lower)
    probed_low = {k for k in keys if view.choice("hard", 1, k).probe}
    assert probed_low < probed and abs(len(probed_low) / len(keys) - 0.02) < 0.005
    # Probing is only where the controller asks for it (it does for classes off or on
    # deterministic drafts).
    assert not any(view.choice("chat", 1, k).probe for k in keys[:1000])


def test_the_probed_requests_are_redrawn_every_epoch(view: PolicyView, clock: FakeClock) -> None:
    keys = [f"req-{i}" for i in range(20_000)]

    def probed() -> set[str]:
        return {k for k in keys if view.choice("hard", 1, k).probe}

    first = probed()
    clock.now += PROBE_EPOCH_SECONDS * 0.4
    assert probed() == first  # the same epoch: the same requests
    clock.now += PROBE_EPOCH_SECONDS
    second = probed()
    # A fresh draw of the same size: about 10% of the first epoch's requests again.
    assert abs(len(second) - len(first)) < 0.011 * len(keys)
    assert abs(len(first & second) / len(first) - 0.1) < 0.03


def test_a_step_lookup_answers_as_choice_and_keeps_its_policy(view: PolicyView) -> None:
    """``lookup``: one resolution per class for the step, the same answers as ``choice`` (probe
    draws per request included), and the snapshot it was made from even after an update."""
    keys = [f"req-{i}" for i in range(2000)]
    for batch in (1, 5, 500):
        lookup = view.lookup(batch)
        for cls in ("hard", "chat", "new-class"):
            assert [lookup.choice(cls, k) for k in keys] == [view.choice(cls, batch, k)
                                                            for k in keys]
    lookup = view.lookup(1)
    before = lookup.choice("chat", "r")
    changed = engine_pb2.PolicyUpdate(version=10, decisions=[decision("chat", 0, "d", 1)])
    put(view, changed)
    assert lookup.choice("chat", "r") == before != view.choice("chat", 1, "r")


def test_whole_step_probes_probe_every_request_of_the_class_in_a_share_of_steps(
        clock: FakeClock) -> None:
    """probe_steps: one draw per class and lookup (a step), so in a probed step every request
    of the class probes and in the others none does; the share of steps tracks probe_rate.
    Other classes are untouched. Control: the same decision without probe_steps probes requests,
    which differ within one step."""
    rng = random.Random(7)
    view = PolicyView(static_k=4, static_draft="d", fail_static_timeout_seconds=30, clock=clock,
                      bucket_bounds=BOUNDS, step_draw=rng.random)
    probing = decision("hard", 2, "", 0, probe_rate=0.2, probe_k=1, probe_draft="d")
    probing.probe_steps = True
    put(view, engine_pb2.PolicyUpdate(version=3, decisions=[probing, decision("chat", 2, "d", 3)]))
    keys = [f"req-{i}" for i in range(40)]
    probed_steps = 0
    for _ in range(5000):
        lookup = view.lookup(8)
        choices = {lookup.choice("hard", k) for k in keys}
        assert len(choices) == 1  # all of the class's requests alike, within the step
        (choice,) = choices
        assert choice in (Choice("d", 1, True), Choice("", 0, False))
        assert lookup.uniform(["hard"]) == choice
        probed_steps += choice.probe
        assert lookup.choice("chat", "req-1") == Choice("d", 3, False)
    assert abs(probed_steps / 5000 - 0.2) < 0.02
    probing.probe_steps = False  # the control: request probes split the class within a step
    put(view, engine_pb2.PolicyUpdate(version=4, decisions=[probing]))
    lookup = view.lookup(8)
    assert len({lookup.choice("hard", k) for k in keys}) == 2
    assert lookup.uniform(["hard"]) is None


def test_fail_static_after_timeout_and_recovery(view: PolicyView, clock: FakeClock) -> None:
    clock.now += 29.9
    assert view.choice("chat", 1, "r") == Choice("d", 4, False) and view.version == 7
    clock.now += 0.2
    assert view.fail_static and view.version == 0
    assert view.choice("chat", 1, "r") == Choice("d", 4, False)  # static: d, K=4
    assert view.choice("chat", 500, "r") == Choice("d", 4, False)
    # Any message from the controller brings the last policy back.
    view.heard_from_controller()
    assert view.version == 7 and view.choice("chat", 500, "r") == Choice("", 0, False)


def test_update_sets_the_timeout(view: PolicyView, clock: FakeClock) -> None:
    put(view, update(version=9, timeout=2.0))
    assert view.fail_static_timeout_seconds == 2.0
    clock.now += 2.1
    assert view.version == 0
    put(view, update(version=10, timeout=float("nan")))  # ignored, keeps 2.0
    assert view.fail_static_timeout_seconds == 2.0 and view.version == 10


def test_static_zero_means_no_draft(clock: FakeClock) -> None:
    v = PolicyView(0, "d", 30, clock=clock, max_k=4)
    assert v.choice("x", 1, "r") == Choice("", 0, False)
    put(v, update())
    assert v.choice("chat", 1, "r") == Choice("d", 4, False)


def test_folded_classes_follow_other(view: PolicyView) -> None:
    assert view.choice("late", 1, "r") == Choice("d", 2, False)
    view.set_folded_classes(["late"])
    assert view.choice("late", 1, "r") == Choice("d", 1, False)
    assert view.choice("late", 2, "r") == Choice("d", 2, False)  # "other" has no bucket 1


def test_missing_default_for_a_bucket_falls_back_to_static(clock: FakeClock) -> None:
    v = PolicyView(4, "d", 30, clock=clock, bucket_bounds=BOUNDS)
    put(v, engine_pb2.PolicyUpdate(version=3, decisions=[decision("chat", 0, "d", 1)]))
    assert v.choice("chat", 1, "r") == Choice("d", 1, False)
    assert v.choice("chat", 100, "r") == Choice("d", 4, False)


def test_choice_never_raises(view: PolicyView) -> None:
    assert view.choice("hard", "big", "r") == Choice("d", 4, False)  # type: ignore[arg-type]
    assert view.choice("hard", 1, None) == Choice("d", 4, False)  # type: ignore[arg-type]


def test_readers_never_see_a_torn_policy(clock: FakeClock) -> None:
    """A writer swapping policies while a reader looks up: every answer belongs to one of the
    two policies, never a mix, and no lookup fails."""
    v = PolicyView(4, "d", 30, clock=clock, bucket_bounds=BOUNDS)
    a = engine_pb2.PolicyUpdate(version=1, decisions=[decision("c", b, "d", 1) for b in range(4)])
    b = engine_pb2.PolicyUpdate(version=2, decisions=[decision("c", b, "d", 3) for b in range(4)])
    put(v, a)
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            put(v, b)
            put(v, a)

    t = threading.Thread(target=writer)
    t.start()
    try:
        seen = {v.choice("c", 1 + i % 40, "r").k for i in range(20_000)}
    finally:
        stop.set()
        t.join()
    assert seen <= {1, 3}


def test_static_configuration_is_readable(clock: FakeClock) -> None:
    v = PolicyView(3, "d", 30, clock=clock)
    assert (v.static_k, v.static_draft, v.static_choice) == (3, "d", Choice("d", 3, False))


def _composed(clock: FakeClock, nan: bool = False) -> PolicyView:
    """chat settled on "d" K=2, docs settled off, hot exploring on "d" K=4, cold off probing:
    with a composition in which one chat sequence among many does not pay the drafter."""
    from specpilot.contract.engine_stream import composition_to_proto, decision_to_proto
    from specpilot.contract.pricing import Composition, DraftPricing, StepPricing
    from specpilot.contract.records import Decision, Reason

    view = PolicyView(static_k=4, static_draft="d", fail_static_timeout_seconds=30, clock=clock,
                      bucket_bounds=BOUNDS)
    update = engine_pb2.PolicyUpdate(version=5)
    for b in range(len(BOUNDS) + 1):
        for d in (Decision("chat", b, "d", 2, Reason.GOODPUT, 1.3),
                  Decision("docs", b, "", 0, Reason.GOODPUT),
                  Decision("other", b, "", 0, Reason.GOODPUT),
                  Decision("hot", b, "d", 4, Reason.EXPLORE, 1.4),
                  Decision("cold", b, "", 0, Reason.GOODPUT, 1.0, 0.05, 1, "d")):
            update.decisions.append(decision_to_proto(d))
    pricing = StepPricing(0.022, 1e-4, 2e-5, (64,), (1.6e-4,), {"d": DraftPricing(0, 0.0039, 0)})
    curves: dict[tuple[str, str], tuple[float, ...]] = {
        (c, "ngram"): (1.0, 1.05, 1.06) for c in ("docs", "other", "hot", "cold")}
    curves |= {("chat", "d"): (1.0, 1.75, 2.31, 2.75), ("chat", "ngram"): (1.0, 1.15, 1.17),
               ("hot", "d"): (1.0, 1.5, 1.9, 2.2, 2.4)}
    update.composition.CopyFrom(composition_to_proto(Composition(pricing, curves, 0.01)))
    if nan:
        update.composition.pricing.base_seconds = float("nan")
    put(view, update)
    return view


def test_compose_repicks_settled_classes_for_the_steps_counts(clock: FakeClock) -> None:
    view = _composed(clock)
    lookup = view.lookup(8)
    assert lookup.compose({"chat": 1, "docs": 7}, 8)["chat"].draft == "ngram"
    assert view.lookup(8).compose({"chat": 7, "docs": 1}, 8).get(
        "chat", Choice("d", 2, False)).draft == "d"  # seven share the passes: the model stays
    # An exploration and a probing class run as decided, whatever the counts; their sequences
    # still count (the exploring one pays the drafter for everyone).
    got = view.lookup(8).compose({"chat": 1, "hot": 1, "cold": 2, "docs": 4}, 8)
    assert "hot" not in got and "cold" not in got
    assert got.get("chat", Choice("d", 2, False)).draft == "d"  # the pass is paid: keep it
    # Classes folded into "other" follow its decision and count as it.
    view.set_folded_classes(["x", "y"])
    assert view.lookup(8).compose({"chat": 1, "x": 4, "y": 3}, 8)["chat"].draft == "ngram"


def test_an_unusable_composition_leaves_the_decisions_and_is_logged_once(
        clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    view = _composed(clock, nan=True)
    assert view.lookup(8).compose({"chat": 1, "docs": 7}, 8) == {}
    assert view.choice("chat", 8, "r") == Choice("d", 2, False)
    put(view, view_update := engine_pb2.PolicyUpdate(version=6))
    view_update.composition.margin = float("inf")
    put(view, view_update)
    assert sum("composition is unusable" in r.message for r in caplog.records) == 1
