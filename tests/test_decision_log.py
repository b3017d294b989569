"""The decision log keeps the figures each decision was taken on, and its lines never contradict
the choice: for every reason and every override kind, in every view (the line on the dashboard
and in /api/decisions, the protobuf message of WatchDecisions and its JSON, the CLI's watch
line, the state store's record), and whatever the estimates have become since."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from google.protobuf import json_format

from specpilot.contract.buckets import DEFAULT_BUCKET_BOUNDS
from specpilot.contract.records import (
    OFFLINE_PIN,
    AcceptanceRecord,
    ArmFigures,
    Decision,
    DecisionEvent,
    DecisionFigures,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    Override,
    Reason,
    StepProfile,
    StepTimingRecord,
)
from specpilot.controller.cli import render_event
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.policy import ArmValue
from specpilot.controller.core.snapshot import Explanation
from specpilot.controller.dashboard.routes import Dashboard
from specpilot.controller.server.explain import arm_label, decision_detail, decision_text
from specpilot.controller.server.views import to_json_dict
from specpilot.controller.settings import core_config, load_settings
from specpilot.controller.store.codec import event_from_json, event_to_json
from specpilot.controller.wire import event_from_proto, event_to_proto
from specpilot.v1 import common_pb2, policy_pb2

MIN_SPEEDUP = core_config(load_settings()).policy.min_speedup
LABEL = r"off|\S+ K=\d+"
RATIO = re.compile(rf"({LABEL}) expects (\d+\.\d+)x the goodput of ({LABEL})")
# The comparison as lines worded it when they were recomputed from the estimates of the moment.
PERCENT_CLAIM = re.compile(rf"({LABEL}) goodput (\d+)% (above|below) ({LABEL})")
OVERRIDES = (Override("chat", pin_k=2), Override("chat", force_draft="ngram"),
             Override("chat", force_off=True))


# --- what a line must not say --------------------------------------------------------------------
def _by_goodput(fig: DecisionFigures, reason: Reason) -> bool:
    """Whether a goodput comparison made the choice (not an operator, a pin or warm-up)."""
    return not fig.pinned_by and reason is not Reason.OVERRIDE and reason is not Reason.WARMUP


def _shown_ratios(fig: DecisionFigures) -> set[str]:
    """Every ratio a line may show from the kept figures, as it prints them."""
    arms = [f for f in (fig.chosen, fig.previous, fig.best) if f is not None]
    out = {f"{f.speedup:.2f}" for f in arms}
    out |= {f"{a.goodput / b.goodput:.2f}" for a in arms for b in arms if b.goodput > 0}
    return out


def contradictions(event: DecisionEvent, text: str) -> list[str]:
    """What in ``text``, a line about ``event``, contradicts its choice or its kept figures."""
    found = [f"a change of {p}%" for p in re.findall(r"(-?\d+(?:\.\d+)?)%", text)
             if not 0 <= float(p) <= 100]
    if "0.00x" in text:
        found.append("0.00x (a figure that is missing or that rounds to nothing)")
    new, old, fig = event.decision, event.previous, event.figures
    if fig is None:
        return found
    new_label = arm_label(new.draft, new.k)
    old_label = arm_label(old.draft, old.k) if old is not None else None
    by_goodput = _by_goodput(fig, new.reason)
    if not by_goodput and ("%" in text or RATIO.search(text)):
        found.append("a comparison of goodputs for a choice no goodput comparison made")
    if by_goodput and fig.best is None:  # the posterior means favour the chosen arm
        for subject, _, direction, other in PERCENT_CLAIM.findall(text):
            if (subject, direction, other) == (old_label, "above", new_label):
                found.append(f"{old_label} said above the arm chosen over it")
        for subject, ratio, other in RATIO.findall(text):
            if (subject, other) == (old_label, new_label) and float(ratio) > 1:
                found.append(f"{old_label} said to expect more than the arm chosen over it")
            if (subject, other) == (new_label, old_label) and float(ratio) < 1:
                found.append(f"{new_label} said to expect less than the arm it replaced")
    shown = _shown_ratios(fig)
    found += [f"{r}x is not a kept figure"
              for r in re.findall(r"(?<!below )(\d+\.\d+)x", text) if r not in shown]
    rates = {f"{f.goodput:,.0f}" if f.goodput >= 10 else f"{f.goodput:.1f}"
             for f in (fig.chosen, fig.previous, fig.best) if f is not None}
    found += [f"{r} tokens/s is not a kept figure"
              for pair in re.findall(r"\(([\d,.]+) vs ([\d,.]+) tokens/s\)", text)
              for r in pair if r not in rates]
    kept = {f"{a.acceptance[0]:.2f} +/- {a.acceptance[1]:.2f}"
            for a in (fig.chosen, fig.previous) if a is not None and a.acceptance is not None}
    found += [f"acceptance {a} is not a kept figure"
              for a in re.findall(r"acceptance (\d\.\d\d \+/- \d\.\d\d)", text) if a not in kept]
    missing = fig.chosen is None or new.reason is Reason.WARMUP
    if missing and fig.pinned_by != OFFLINE_PIN and "no estimate yet" not in text:
        found.append("a missing figure not said to be missing")
    if new.reason is Reason.OVERRIDE and not ("operator" in text and fig.pinned_by in text):
        found.append("an override not said to be one")
    return found


def kept_figures_agree(event: DecisionEvent) -> bool:
    """The kept figures of a choice the posterior means favour back it: the chosen arm expects
    at least the old arm's goodput, or speculation went off because the old arm gained less than
    drafting must."""
    fig, new = event.figures, event.decision
    assert fig is not None
    if not _by_goodput(fig, new.reason) or fig.best is not None:
        return True
    if fig.chosen is None or fig.previous is None or fig.previous.too_little_evidence:
        return True  # no comparison is claimed
    return (fig.chosen.goodput >= fig.previous.goodput
            or (new.k == 0 and fig.previous.speedup < MIN_SPEEDUP))


def views(event: DecisionEvent) -> dict[str, str]:
    """The line as each view shows it (the CLI's with its own head: time, version, class,
    bucket and the change)."""
    message = event_to_proto(event)
    watched = policy_pb2.WatchDecisionsResponse.FromString(
        policy_pb2.WatchDecisionsResponse(event=message).SerializeToString()).event
    from_json = json_format.ParseDict(json.loads(json.dumps(to_json_dict(message))),
                                      common_pb2.DecisionEvent())
    return {
        "dashboard and /api/decisions": Dashboard.event_json(event)["text"],
        "WatchDecisions (a client's rendering)": decision_text(event_from_proto(watched)),
        "/api/decisions JSON (a client's rendering)": decision_text(event_from_proto(from_json)),
        "policy watch": render_event(message, DEFAULT_BUCKET_BOUNDS),
        "state store": decision_text(event_from_json(event_to_json(event))),
    }


# --- events of every reason, as the policy makes them --------------------------------------------
OFF_RATE = 1000.0  # tokens/s of the batch without speculation


def _arm(draft: str, k: int, goodput: float, acceptance: tuple[float, float] | None = (0.7, 0.03),
         ) -> ArmFigures:
    tokens = 1.0 + sum(0.7 ** i for i in range(1, k + 1))
    return ArmFigures(draft, k, tokens, goodput, max(goodput / OFF_RATE, 0.0),
                      acceptance if k else None)


OFF = _arm("", 0, OFF_RATE)


def _event(new: tuple[str, int], old: tuple[str, int] | None, reason: Reason,
           chosen: ArmFigures | None, previous: ArmFigures | None,
           best: ArmFigures | None = None, pinned_by: str = "") -> DecisionEvent:
    speedup = chosen.speedup if chosen is not None else 1.0
    decision = Decision("chat", 5, new[0], new[1], reason, speedup)
    before = None if old is None else Decision("chat", 5, old[0], old[1], Reason.GOODPUT)
    return DecisionEvent(7, 100.0, decision, before,
                         DecisionFigures(32, chosen, previous, best, pinned_by))


def _override_event(ov: Override) -> DecisionEvent:
    best = _arm("d", 4, 1300.0)
    if ov.force_off:
        return _event(("", 0), ("d", 4), Reason.OVERRIDE, OFF, best, best, ov.action)
    if ov.force_draft is not None:
        chosen = _arm(ov.force_draft, 3, 1100.0, acceptance=None)  # no data yet: the prior
        return _event((ov.force_draft, 3), ("d", 4), Reason.OVERRIDE, chosen, best, best,
                      ov.action)
    return _event(("d", 2), ("d", 4), Reason.OVERRIDE, _arm("d", 2, 950.0), best, best,
                  ov.action)


def cases(reason: Reason) -> Iterator[tuple[str, DecisionEvent]]:
    """Events with kept figures for ``reason``, in the shapes the policy makes them."""
    d4 = _arm("d", 4, 1300.0)
    if reason is Reason.WARMUP:
        yield "first decision, on the prior", _event(
            ("d", 2), None, reason, _arm("d", 2, 1500.0, acceptance=None), None)
    elif reason is Reason.GOODPUT:
        yield "off at high load", _event(("", 0), ("d", 4), reason, OFF, _arm("d", 4, 440.0))
        yield "on at low load", _event(("d", 4), ("", 0), reason, _arm("d", 4, 1840.0), OFF)
        yield "a shorter K", _event(("d", 2), ("d", 4), reason, _arm("d", 2, 1420.0),
                                    _arm("d", 4, 1290.0))
        yield "off: the old arm gains less than drafting must", _event(
            ("", 0), ("d", 1), reason, OFF, _arm("d", 1, 1010.0))
        yield "the old arm slows a shared batch", _event(
            ("draft", 4), ("suffix", 4), reason, _arm("draft", 4, 1250.0),
            _arm("suffix", 4, -910.0))
        yield "the old arm is no longer offered", _event(
            ("d", 3), ("d", 6), reason, _arm("d", 3, 1350.0), None)
        yield "first decision", _event(("d", 4), None, reason, d4, None)
        yield "another draft at the same K", _event(
            ("ngram", 4), ("d", 4), reason, _arm("ngram", 4, 1500.0, acceptance=None), d4)
        yield "a shorter K the posteriors cannot rank", _event(
            ("d", 2), ("d", 4), reason, _arm("d", 2, 1310.0),
            replace(_arm("d", 4, 1300.0), too_little_evidence=True))
        yield "a gain the posteriors cannot tell from none", _event(
            ("d", 1), ("", 0), reason, replace(_arm("d", 1, 1030.0), too_little_evidence=True),
            replace(OFF, too_little_evidence=True))
    elif reason is Reason.EXPLORE:
        yield "a K the means rank second", _event(
            ("d", 3), ("d", 4), reason, _arm("d", 3, 1210.0), d4, d4)
        yield "a K that gains less than drafting must", _event(
            ("d", 1), ("", 0), reason, _arm("d", 1, 1010.0), OFF, OFF)
    elif reason is Reason.NEIGHBOURS:
        yield "no longer than at a smaller batch", _event(
            ("d", 2), ("d", 4), reason, _arm("d", 2, 1200.0), d4, d4)
        yield "off as at a smaller batch, the posteriors unable to rank", _event(
            ("", 0), ("d", 1), reason, OFF, replace(_arm("d", 1, 1020.0), too_little_evidence=True),
            replace(_arm("d", 3, 1040.0), too_little_evidence=True))
    elif reason is Reason.CHANGE_DETECTED:
        yield "the means favour the new arm", _event(
            ("", 0), ("d", 4), reason, OFF, _arm("d", 4, 400.0))
        yield "a draw the means do not favour", _event(
            ("d", 1), ("d", 4), reason, _arm("d", 1, 1050.0), _arm("d", 4, 400.0),
            _arm("d", 2, 1100.0))
    elif reason is Reason.OVERRIDE:
        for ov in OVERRIDES:
            yield ov.action, _override_event(ov)
        yield "pin K=2, the pinned arm slows a shared batch", _event(
            ("d", 2), ("suffix", 4), reason, _arm("d", 2, -20000.0), _arm("suffix", 4, 952.0),
            _arm("suffix", 4, 952.0), "pin K=2")
        yield "pin K=2, no estimate of the pinned arm", _event(
            ("d", 2), ("d", 4), reason, None, d4, d4, "pin K=2")
    elif reason is Reason.OFFLINE:
        yield "pinned off", _event(("", 0), ("d", 2), reason, OFF, _arm("d", 2, 1400.0),
                                   _arm("d", 2, 1400.0), OFFLINE_PIN)
        yield "priced at full load", _event(("d", 2), ("", 0), reason, _arm("d", 2, 1400.0),
                                            OFF)
    else:  # a new reason needs its cases here
        raise AssertionError(f"no cases for {reason}")


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.value)
def test_every_view_of_every_reason_keeps_its_figures_and_never_contradicts_the_choice(
    reason: Reason,
) -> None:
    built = list(cases(reason))
    assert built
    for name, event in built:
        assert kept_figures_agree(event), name
        line = decision_text(event)
        assert contradictions(event, line) == [], (name, line)
        for view, text in views(event).items():
            assert text == line or view == "policy watch", (name, view)
            assert text.endswith(decision_detail(event)), (name, view)
            assert contradictions(event, text) == [], (name, view, text)


@pytest.mark.parametrize("override", OVERRIDES, ids=lambda o: o.action)
def test_an_override_says_an_operator_set_it_and_claims_no_gain_or_loss(
    override: Override,
) -> None:
    assert {o.action.split()[0] for o in OVERRIDES} == {"pin", "force"}
    assert len({o.action.split()[1] for o in OVERRIDES if o.force_draft or o.force_off}) == 2
    event = _override_event(override)
    line = decision_text(event)
    assert f"set by an operator ({override.action})" in line
    assert contradictions(event, line) == []
    assert "%" not in line and not RATIO.search(line)


def test_decision_lines_read_as_the_operator_needs() -> None:
    d4, d2 = _arm("d", 4, 1290.0, (0.52, 0.03)), _arm("d", 2, 1420.0, (0.52, 0.03))
    assert decision_text(_event(("d", 2), ("d", 4), Reason.GOODPUT, d2, d4)) == (
        "chat: K 4 -> 2 at batch 32 (goodput); d K=2 expects 1.10x the goodput of d K=4 "
        "(1,420 vs 1,290 tokens/s); expected 1.42x no speculation; d acceptance 0.52 +/- 0.03 "
        "at position 1")
    assert decision_text(_event(("", 0), ("d", 4), Reason.GOODPUT, OFF, _arm("d", 4, 440.0))) == (
        "chat: K 4 -> 0 at batch 32 (goodput); off expects 2.27x the goodput of d K=4 "
        "(1,000 vs 440 tokens/s); d acceptance 0.70 +/- 0.03 at position 1")
    assert decision_text(_event(("", 0), ("d", 1), Reason.GOODPUT, OFF, _arm("d", 1, 1010.0))) == (
        "chat: K 1 -> 0 at batch 32 (goodput); d K=1 expects only 1.01x no speculation, too "
        "little to pay for drafting; d acceptance 0.70 +/- 0.03 at position 1")
    assert decision_text(_event(("d", 2), ("d", 4), Reason.OVERRIDE, None, d4, d4,
                                "pin K=2")) == (
        "chat: K 4 -> 2 at batch 32 (override); set by an operator (pin K=2); d K=2: no "
        "estimate yet; by posterior means d K=4 would be the best, at 1.29x no speculation")
    assert decision_text(_override_event(Override("chat", pin_k=2))) == (
        "chat: K 4 -> 2 at batch 32 (override); set by an operator (pin K=2); expected 0.95x no "
        "speculation; by posterior means d K=4 would be the best, at 1.30x no speculation; "
        "d acceptance 0.70 +/- 0.03 at position 1")
    assert decision_text(_override_event(Override("chat", force_draft="ngram"))).endswith(
        "expected 1.10x no speculation; by posterior means d K=4 would be the best, at 1.30x no "
        "speculation; no acceptance data for ngram yet: priced on the prior")
    # Another draft at the same K says so; a first decision names the arm alone.
    explore = _event(("ngram", 2), ("d", 2), Reason.EXPLORE, _arm("ngram", 2, 1100.0), d2, d2)
    assert decision_text(explore).startswith(
        "chat: draft d -> ngram at K=2 at batch 32 (explore); exploring, to learn what ngram "
        "K=2 gains; ngram K=2 expects 0.77x the goodput of d K=2, the best by posterior means")
    assert decision_text(_event(("d", 4), None, Reason.GOODPUT, d4, None)) == (
        "chat: d K=4 at batch 32 (goodput); expected 1.29x no speculation; d acceptance "
        "0.52 +/- 0.03 at position 1")


def test_a_record_from_before_figures_were_kept_says_so() -> None:
    event = _event(("", 0), ("d", 4), Reason.GOODPUT, OFF, None)
    bare = replace(event, figures=None)
    stored = json.loads(event_to_json(bare))
    del stored["figures"]  # as records were written before
    old = event_from_json(json.dumps(stored))
    assert old.figures is None
    assert decision_text(old) == "chat: K 4 -> 0 (goodput); figures not recorded"
    assert all(text.endswith(decision_detail(old)) for text in views(old).values())


# --- the real core: figures kept from the moment of the decision --------------------------------
def _seconds(batch: int, k: int) -> float:
    """A step of ``batch`` sequences at K: memory-bound while small, then compute-bound."""
    return 0.01 + 2e-4 * batch * (1 + k) + 0.001 * k


HELLO = EngineHello(
    engine_id="e1", model="m", target_vocab_hash="v1",
    drafts=(DraftSpec("d", DraftKind.MODEL, 4, "v1"),), max_k=4, per_request_k=False,
    batch_wide_k=True,
    step_profile=tuple(StepProfile(b, b * (1 + k), "d" if k else "", k, _seconds(b, k))
                       for b in (1, 8, 32) for k in (0, 1, 2, 4)))
BATCH_32 = 5  # the bucket of batch size 32 under the default bounds
HIGH, LOW = (2, 3, 5, 10, 80), (95, 3, 1, 1, 0)  # steps by accepted drafts, K = 4


def _report(seq: int, steps_by_accepted: tuple[int, ...]) -> EngineReport:
    return EngineReport(
        sequence=seq, interval_seconds=1.0, policy_version=0,
        acceptance=(AcceptanceRecord("chat", "d", 4, steps_by_accepted),),
        step_timings=tuple(StepTimingRecord(bucket, "d", 2, 100, 100 * b, 300 * b, 200 * b,
                                            100 * _seconds(b, 2))
                           for bucket, b in ((0, 1), (BATCH_32, 32))),
        running_requests=1)


def _run(core: ControllerCore, first: int, last: int, steps: tuple[int, ...],
         lines: dict[int, str]) -> None:
    """Reports and decide rounds at t = first..last; each event's line as rendered at once,
    checked against the live explanation of that moment (one class: nothing else moves it)."""
    for t in range(first, last + 1):
        core.ingest("e1", _report(t, steps), now=float(t))
        for e in core.decide(float(t)):
            lines[id(e)] = decision_text(e)
            assert contradictions(e, lines[id(e)]) == [], lines[id(e)]
            assert e.figures is not None and kept_figures_agree(e), lines[id(e)]
            if e.decision.traffic_class != "chat" or e.figures.chosen is None:
                continue
            now = core.explain("chat", e.decision.bucket, float(t))
            live = next(a for a in now.arms if a.arm == e.decision.arm)
            assert (e.figures.chosen.goodput, e.figures.chosen.speedup) == pytest.approx(
                (live.goodput, live.speedup))


def recomputed_line(event: DecisionEvent, ex: Explanation) -> str:
    """The line as it was rendered when the comparison was recomputed from the class's
    explanation at the time of reading, not kept from the decision."""
    new, old = event.decision, event.previous
    assert old is not None
    goodput = {a.arm: a.goodput for a in ex.arms}
    change = (goodput[old.arm] / goodput[new.arm]) - 1.0
    line = (f"{new.traffic_class}: K {old.k} -> {new.k} at batch {ex.batch_size} "
            f"({new.reason.value}); {arm_label(old.draft, old.k)} goodput {abs(change):.0%} "
            f"{'below' if change < 0 else 'above'} {arm_label(new.draft, new.k)}")
    return line + (f"; expected {new.expected_speedup:.2f}x" if new.k else "")


def test_lines_keep_the_figures_of_the_decision_when_the_estimates_move() -> None:
    """And the control: the line recomputed from the estimates of the moment of reading
    contradicts the choice."""
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    core.connect_engine(HELLO, now=0.0)
    lines: dict[int, str] = {}
    _run(core, 1, 29, HIGH, lines)
    _run(core, 30, 69, LOW, lines)  # acceptance collapses: the class goes off
    # The line checked is a switch-off decided on goodput (a batch range may instead follow a
    # better-measured neighbour off: ``neighbours``).
    switched_off = next(e for e in core.snapshot(69.0).events("chat")
                        if e.decision.k == 0 and e.decision.reason is Reason.GOODPUT)
    bucket = switched_off.decision.bucket
    kept = decision_text(switched_off)
    assert re.match(r"chat: K [1-4] -> 0 at batch \d+ \(goodput\); off expects ", kept), kept
    _run(core, 70, 119, HIGH, lines)  # and recovers: the means now favour d K=4 again

    later = core.snapshot(119.0)
    assert later.events("chat")[-1].decision.k > 0
    for e in later.log:  # every line of the log reads as it did when decided
        assert decision_text(e) == lines[id(e)]
        assert all(text.endswith(decision_detail(e)) for text in views(e).values())
    # The control: the line recomputed from today's estimates says the arm switched away from
    # is the better one, under the reason "goodput".
    now = core.explain("chat", bucket, 119.0)
    goodput = {a.arm: a.goodput for a in now.arms}
    assert goodput[("d", 4)] > goodput[("", 0)]
    recomputed = recomputed_line(switched_off, now)
    assert re.search(r"d K=[1-4] goodput \d+% above off", recomputed), recomputed
    assert contradictions(switched_off, recomputed) != []
    assert contradictions(switched_off, kept) == []


@pytest.mark.parametrize(("case", "live", "kept", "old", "new"), [
    # A shared batch: the old arm's attributed goodput is below zero when the line is read.
    ("191% below",
     (ArmValue("suffix", 4, 2.0, 0.01, -910.0, 0.0), ArmValue("draft", 4, 2.4, 0.01, 1000.0, 1.25)),
     DecisionFigures(32, _arm("draft", 4, 1250.0), _arm("suffix", 4, 1100.0)),
     Decision("chat", 5, "suffix", 4, Reason.GOODPUT, 1.1),
     Decision("chat", 5, "draft", 4, Reason.GOODPUT, 1.25)),
    # A pin whose arm slowed the batch when it was set (its speedup read 0), and the arm it
    # replaced does so when the line is read.
    ("2101% below",
     (ArmValue("d", 4, 2.4, 0.01, -20010.0, 0.0), ArmValue("d", 2, 1.9, 0.01, 1000.0, 1.0)),
     DecisionFigures(32, _arm("d", 2, -50.0), _arm("d", 4, 1300.0), _arm("d", 4, 1300.0),
                     "pin K=2"),
     Decision("chat", 5, "d", 4, Reason.GOODPUT, 1.3),
     Decision("chat", 5, "d", 2, Reason.OVERRIDE, 0.0)),
])
def test_the_control_lines_recomputed_from_the_estimates_of_the_moment_contradict_themselves(
    case: str, live: tuple[ArmValue, ...], kept: DecisionFigures, old: Decision, new: Decision,
) -> None:
    event = DecisionEvent(3, 1.0, new, old, kept)
    recomputed = recomputed_line(event, Explanation("chat", new, 32, live, (), None))
    assert case in recomputed
    assert contradictions(event, recomputed) != []
    assert contradictions(event, decision_text(event)) == [], decision_text(event)


def test_the_real_core_words_every_override_kind_as_an_operator_s() -> None:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    ngram = DraftSpec("ngram", DraftKind.NGRAM, 4)
    core.connect_engine(replace(HELLO, drafts=(*HELLO.drafts, ngram)), now=0.0)
    lines: dict[int, str] = {}
    _run(core, 1, 9, HIGH, lines)
    for t, ov in enumerate(OVERRIDES, start=10):
        core.set_override(ov)
        events = [e for e in core.decide(float(t)) if e.decision.traffic_class == "chat"]
        assert events
        for e in events:
            line = decision_text(e)
            assert e.decision.reason is Reason.OVERRIDE
            assert f"set by an operator ({ov.action})" in line, line
            assert contradictions(e, line) == [], line


def test_a_comparison_the_posteriors_cannot_rank_reads_too_little_evidence_not_a_ratio() -> None:
    unranked = [(name, e) for reason in Reason for name, e in cases(reason)
                if e.figures is not None and any(
                    f is not None and f.too_little_evidence
                    for f in (e.figures.chosen, e.figures.previous, e.figures.best))]
    assert len(unranked) >= 3
    for name, event in unranked:
        fig = event.figures
        assert fig is not None
        line = decision_text(event)
        assert "too little evidence" in line, (name, line)
        compared = [f for f in (fig.previous, fig.best) if f is not None]
        for f in compared:
            if f.too_little_evidence:  # neither way round as a ratio of goodputs
                other = arm_label(f.draft, f.k)
                assert not any(other in (a, b) for a, _, b in RATIO.findall(line)), (name, line)
        if fig.chosen is not None and fig.chosen.too_little_evidence:
            assert "x no speculation" not in line.split("; by posterior means")[0], (name, line)


def test_policy_watch_prints_a_first_decision_as_one_not_as_a_change_from_off() -> None:
    """A class's first decision in a bucket had nothing in force before it: "first: off", never
    "off -> off" (nor "off -> d K=2" for a first speculative one)."""
    for new in (("", 0), ("d", 2)):
        chosen = OFF if not new[1] else _arm("d", 2, 1400.0)
        event = _event(new, None, Reason.GOODPUT, chosen, None)
        line = render_event(event_to_proto(event), DEFAULT_BUCKET_BOUNDS)
        assert f"  first: {arm_label(*new)}  " in line, line
        assert " -> " not in line, line
    changed = render_event(event_to_proto(_event(("", 0), ("d", 4), Reason.GOODPUT, OFF,
                                                 _arm("d", 4, 440.0))), DEFAULT_BUCKET_BOUNDS)
    assert "  d K=4 -> off  " in changed, changed


def test_the_log_holds_changes_of_arm_only() -> None:
    """Events exist for a changed (draft, K) only: a refreshed estimate, reason or probe share
    moves the policy version (the engines need it) but is no decision a person watches for."""
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    core.connect_engine(HELLO, now=0.0)
    lines: dict[int, str] = {}
    _run(core, 1, 29, HIGH, lines)
    _run(core, 30, 89, LOW, lines)  # off at batch 32, probing the model draft
    probes = {d.probe_rate for d in core.snapshot(89.0).class_view("chat").decisions}
    assert any(p > 0 for p in probes)
    for e in core.snapshot(89.0).log:
        assert e.previous is None or e.previous.arm != e.decision.arm, e
