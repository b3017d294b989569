"""ControllerCore: hello checks, atomic report validation, class folding, versions, overrides."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from specpilot.contract.pricing import StepPricing
from specpilot.contract.records import (
    ALL_CLASSES,
    OTHER_CLASS,
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    ImplausibleInput,
    Override,
    OverrideScope,
    Reason,
    ReportRejected,
    RequestSummaryRecord,
    StepProfile,
    StepTimingRecord,
)
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.cost_model import StepShape
from specpilot.controller.core.engines import EngineRegistry
from specpilot.controller.core.goodput import expected_tokens_curve
from specpilot.controller.core.snapshot import CoreSnapshot
from specpilot.controller.server.explain import explanation_text
from specpilot.controller.settings import core_config, load_settings

HELLO = EngineHello(
    engine_id="e1", model="m", target_vocab_hash="v1",
    drafts=(DraftSpec("d", DraftKind.MODEL, 6, "v1"), DraftSpec("ngram", DraftKind.NGRAM, 4)),
    max_k=6,
)


def _core(**settings: Any) -> ControllerCore:
    core = ControllerCore(core_config(load_settings(**settings)), np.random.default_rng(0))
    core.connect_engine(HELLO, now=0.0)
    return core


def _good(seq: int = 1, cls: str = "code") -> EngineReport:
    return EngineReport(
        sequence=seq, interval_seconds=1.0, policy_version=0,
        acceptance=(AcceptanceRecord(cls, "d", 3, (10, 20, 30, 40)),),
        finished=(RequestSummaryRecord(cls, "d", 10, 20, 30, 12, 0.5),),
        step_timings=(StepTimingRecord(0, "d", 3, 100, 100, 400, 300, 3.0),),
    )


def _snapshot(core: ControllerCore) -> tuple[CoreSnapshot, StepPricing]:
    """The whole read model at one instant, and the cost model's fit."""
    return core.snapshot(10.0), core.cost_fit()


BAD_REPORTS = {
    "accepted > drafted": replace(_good(), finished=(RequestSummaryRecord(
        "code", "d", 10, 20, 5, 6, 0.5),)),
    "negative count": replace(_good(), acceptance=(AcceptanceRecord(
        "code", "d", 3, (10, -1, 30, 40)),)),
    "K above the engine max": replace(_good(), acceptance=(AcceptanceRecord(
        "code", "d", 7, (1,) * 8),)),
    "unknown draft": replace(_good(), acceptance=(AcceptanceRecord(
        "code", "eagle", 3, (1, 1, 1, 1)),)),
    "histogram length": replace(_good(), acceptance=(AcceptanceRecord(
        "code", "d", 3, (1, 1, 1)),)),
    "bad class name": replace(_good(), acceptance=(AcceptanceRecord(
        "bad class!", "d", 3, (1, 1, 1, 1)),)),
    "drafted histogram length": replace(_good(), acceptance=(AcceptanceRecord(
        "code", "d", 3, (1, 1, 1, 1), steps_by_drafted=(0, 4)),)),
    "drafted steps not the accepted ones": replace(_good(), acceptance=(AcceptanceRecord(
        "code", "d", 3, (1, 1, 1, 1), steps_by_drafted=(1, 1, 1, 2)),)),
    "drafts fewer than accepted ones": replace(_good(), acceptance=(AcceptanceRecord(
        "code", "d", 3, (1, 1, 1, 1), steps_by_drafted=(1, 2, 1, 0)),)),
    "negative drafted count": replace(_good(), acceptance=(AcceptanceRecord(
        "code", "d", 3, (1, 1, 1, 1), steps_by_drafted=(5, -1, 0, 0)),)),
    "bucket out of range": replace(_good(), step_timings=(StepTimingRecord(
        99, "d", 3, 1, 1, 4, 3, 0.1),)),
    "nan seconds": replace(_good(), step_timings=(StepTimingRecord(
        0, "d", 3, 1, 1, 4, 3, float("nan")),)),
    "fewer verified tokens than sequences": replace(_good(), step_timings=(StepTimingRecord(
        0, "d", 3, 1, 10, 4, 3, 0.1),)),
    # Well-formed, physically impossible (ImplausibleInput): what a rogue or a bug sends.
    "a step of 1e308 s (it turned the cost model to NaN)": replace(_good(), step_timings=(
        StepTimingRecord(0, "d", 3, 100, 100, 400, 300, 1e308),)),
    "a step of 1e7 s (it sent K to 8)": replace(_good(), step_timings=(StepTimingRecord(
        0, "d", 3, 100, 100, 400, 300, 1e9),)),
    "more draft tokens than sequences x K": replace(_good(), step_timings=(StepTimingRecord(
        0, "d", 3, 100, 100, 400, 10**9, 3.0),)),
    "more verified tokens than sequences x (1 + K)": replace(_good(), step_timings=(
        StepTimingRecord(0, "d", 3, 100, 100, 10**6, 300, 3.0),)),
    "sums without steps": replace(_good(), step_timings=(StepTimingRecord(
        0, "d", 3, 0, 100, 400, 300, 3.0),)),
    "interval 0": replace(_good(), interval_seconds=0.0),
    "records dropped 2^64-1": replace(_good(), records_dropped=2**64 - 1),
    "nan context": replace(_good(), step_timings=(StepTimingRecord(
        0, "d", 3, 100, 100, 400, 300, 3.0, float("nan")),)),  # type: ignore[arg-type]
    "negative context": replace(_good(), step_timings=(StepTimingRecord(
        0, "d", 3, 100, 100, 400, 300, 3.0, -5),)),
    "more context than sequences x the longest window": replace(_good(), step_timings=(
        StepTimingRecord(0, "d", 3, 100, 100, 400, 300, 3.0, 100 * 2**24 + 1),)),
    "negative prefill": replace(_good(), step_timings=(StepTimingRecord(
        0, "d", 3, 100, 100, 400, 300, 3.0, 0, -1),)),
    "more prefill than steps x the longest window": replace(_good(), step_timings=(
        StepTimingRecord(0, "d", 3, 100, 100, 400, 300, 3.0, 0, 100 * 2**24 + 1),)),
}

EXPECTED_FIELD = {
    "accepted > drafted": "finished[0].accepted_tokens",
    "negative count": "acceptance[0].steps_by_accepted[1]",
    "K above the engine max": "acceptance[0].k",
    "unknown draft": "acceptance[0].draft",
    "histogram length": "acceptance[0].steps_by_accepted",
    "bad class name": "acceptance[0].traffic_class",
    "drafted histogram length": "acceptance[0].steps_by_drafted: 2 entries",
    "drafted steps not the accepted ones": "acceptance[0].steps_by_drafted: 5 steps",
    "drafts fewer than accepted ones": "acceptance[0]: 1 steps accepted 3 or more",
    "negative drafted count": "acceptance[0].steps_by_drafted[1]",
    "bucket out of range": "step_timings[0].batch_bucket",
    "nan seconds": "step_timings[0].sum_step_seconds",
    "fewer verified tokens than sequences": "step_timings[0].sum_verified_tokens",
    "a step of 1e308 s (it turned the cost model to NaN)": "step_timings[0].sum_step_seconds",
    "a step of 1e7 s (it sent K to 8)": "step_timings[0].sum_step_seconds",
    "more draft tokens than sequences x K": "step_timings[0].sum_draft_tokens",
    "more verified tokens than sequences x (1 + K)": "step_timings[0].sum_verified_tokens",
    "sums without steps": "step_timings[0]: sums without steps",
    "interval 0": "interval_seconds",
    "records dropped 2^64-1": "records_dropped",
    "nan context": "step_timings[0].sum_context_tokens: must be a finite",
    "negative context": "step_timings[0].sum_context_tokens: must be a whole number",
    "more context than sequences x the longest window": "step_timings[0].sum_context_tokens",
    "negative prefill": "step_timings[0].sum_prefill_tokens: must be a whole number",
    "more prefill than steps x the longest window": "step_timings[0].sum_prefill_tokens",
}
IMPLAUSIBLE = {k for k in BAD_REPORTS if k.startswith(("a step", "more", "sums", "interval",
                                                         "records"))}


@pytest.mark.parametrize("kind", sorted(BAD_REPORTS))
def test_bad_report_is_rejected_naming_the_field_and_changes_nothing(kind: str) -> None:
    core = _core()
    core.ingest("e1", _good(1), now=1.0)
    before = _snapshot(core)
    with pytest.raises(ReportRejected, match=EXPECTED_FIELD[kind].replace("[", r"\[")) as err:
        core.ingest("e1", replace(BAD_REPORTS[kind], sequence=2), now=2.0)
    assert isinstance(err.value, ImplausibleInput) is (kind in IMPLAUSIBLE)
    assert _snapshot(core) == before
    core.ingest("e1", _good(3), now=3.0)  # the engine carries on


def test_sequence_numbers_start_at_one_and_never_jump_by_millions() -> None:
    core = _core()
    with pytest.raises(ReportRejected, match="sequence: must be >= 1"):
        core.ingest("e1", _good(0), now=1.0)
    core.ingest("e1", _good(1), now=1.0)
    # 2^64-1 once accepted refused every later report on the stream; now it is refused itself.
    with pytest.raises(ImplausibleInput, match=r"sequence: .* jumps"):
        core.ingest("e1", _good(2**64 - 1), now=2.0)
    core.ingest("e1", _good(2), now=3.0)  # the engine carries on
    # An idle link's heartbeat (no records) covers no interval: fine.
    core.ingest("e1", EngineReport(sequence=3, interval_seconds=0.0, policy_version=0), now=4.0)


def test_a_hello_beyond_any_engine_is_refused() -> None:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    many = tuple(DraftSpec(f"d{i}", DraftKind.NGRAM, 4) for i in range(100_000))
    started = time.perf_counter()
    for hello, field in ((replace(HELLO, drafts=many), "hello.drafts"),
                         (replace(HELLO, max_k=2**32 - 1), "hello.max_k"),
                         (replace(HELLO, max_batch_size=2**32 - 1), "hello.max_batch_size"),
                         (replace(HELLO, engine_id="e" * 10_000), "hello.engine_id")):
        with pytest.raises(ReportRejected, match=field.replace(".", r"\.")):
            core.connect_engine(hello, now=0.0)
    assert time.perf_counter() - started < 0.5  # 100,000 drafts are refused, not processed
    assert core.snapshot(0.0).engines == ()
    # A plain engine (no drafts: the fleet's plain pool) is an engine.
    core.connect_engine(replace(HELLO, drafts=(), max_k=0), now=0.0)


def test_a_cost_that_is_not_finite_never_reaches_a_decision() -> None:
    """The last guard: a cost model broken anyway (here by a NaN in its prior, which the core
    trusts as it trusts all its config) prices arms NaN; those arms never win and no decision
    carries a number that is not finite."""
    config = core_config(load_settings())
    core = ControllerCore(replace(config, cost_prior=replace(
        config.cost_prior, seconds_per_token=float("nan"))), np.random.default_rng(0))
    core.connect_engine(HELLO, now=0.0)
    core.ingest("e1", _good(1), now=1.0)
    assert math.isnan(core.predicted_step_seconds(1, "d", 3))  # broken, past every check
    events = core.decide(now=2.0)
    assert events  # decided, not skipped
    decisions = [e.decision for e in events] + [
        d for c in core.snapshot(2.0).classes for d in c.decisions]
    assert all(math.isfinite(d.expected_speedup) and math.isfinite(d.probe_rate)
               for d in decisions)


def test_duplicate_sequence_and_report_before_hello_are_rejected() -> None:
    core = _core()
    core.ingest("e1", _good(5), now=1.0)
    with pytest.raises(ReportRejected, match="sequence"):
        core.ingest("e1", _good(5), now=2.0)
    with pytest.raises(ReportRejected, match="before hello"):
        core.ingest("nobody", _good(1), now=2.0)


def test_classes_beyond_the_limit_fold_into_other() -> None:
    core = _core(max_classes=3)  # "default" + two more
    result = core.ingest("e1", replace(_good(1), acceptance=tuple(
        AcceptanceRecord(c, "d", 1, (1, 1)) for c in ("a", "b", "c", "d2")), finished=()),
        now=1.0)
    assert set(result.folded_classes) == {"c", "d2"}
    assert {c.name for c in core.snapshot(1.0).classes} == {"default", "a", "b", OTHER_CLASS}
    assert core.estimate(OTHER_CLASS, "d", 1.0).effective_tries[0] == 4


def test_mismatched_draft_vocabulary_is_refused() -> None:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    hello = replace(HELLO, drafts=(DraftSpec("d", DraftKind.MODEL, 6, "other-vocab"),))
    outcome = core.connect_engine(hello, now=0.0)
    assert outcome.accepted_drafts == ()
    assert "vocabulary" in outcome.rejected_drafts[0][1]
    with pytest.raises(ReportRejected, match="unknown draft"):
        core.ingest("e1", _good(1), now=1.0)


def test_version_moves_only_with_material_changes() -> None:
    # Only the model draft: an untried n-gram draft would (rightly) be explored first.
    core = ControllerCore(core_config(load_settings(dwell_seconds=0.0)),
                          np.random.default_rng(0))
    core.connect_engine(replace(HELLO, drafts=HELLO.drafts[:1]), now=0.0)
    events = core.decide(now=1.0)
    assert core.version == 1 and all(e.decision.reason is Reason.WARMUP for e in events)
    assert core.decide(now=1.0) == [] and core.version == 1
    core.ingest("e1", replace(_good(1), acceptance=(
        AcceptanceRecord("code", "d", 1, (100_000, 0)),), step_timings=()), now=2.0)
    events = core.decide(now=2.0)
    assert core.version == 2
    assert any(e.decision.traffic_class == "code" and e.decision.k == 0 for e in events)
    assert list(core.snapshot(2.0).log)[-len(events):] == events


def test_overrides_for_one_class_and_for_all() -> None:
    core = _core()
    core.decide(now=1.0)
    core.set_override(Override("code", pin_k=4))
    assert core.decision("code", 0) is None  # in force from the next decide
    core.decide(now=2.0)
    assert core.decision("code", 0).k == 4  # type: ignore[union-attr]
    core.set_override(Override(ALL_CLASSES, force_off=True))
    core.decide(now=3.0)
    assert core.decision("default", 0).k == 0  # type: ignore[union-attr]
    assert core.decision("code", 0).k == 4  # type: ignore[union-attr]  # class beats "*"
    assert core.clear_override("code")
    core.decide(now=4.0)
    assert core.decision("code", 0).k == 0  # type: ignore[union-attr]
    assert core.clear_override("code") is False
    with pytest.raises(ValueError, match="exactly one"):
        Override("code", pin_k=1, force_off=True)


def test_pod_overrides_beat_fleet_ones_at_each_level_and_the_fleet_layer_is_replaced() -> None:
    core = _core(max_classes=3)
    core.decide(now=1.0)
    refused = core.set_fleet_overrides([Override("code", pin_k=2, set_by="sidecar-b"),
                                        Override(ALL_CLASSES, pin_k=1)])
    assert refused == []
    core.decide(now=2.0)
    assert (core.decision("code", 0).k, core.decision("default", 0).k) == (2, 1)  # type: ignore[union-attr]
    core.set_override(Override(ALL_CLASSES, pin_k=3))  # pod "*" beats fleet "*" ...
    core.decide(now=3.0)
    assert (core.decision("code", 0).k, core.decision("default", 0).k) == (2, 3)  # type: ignore[union-attr]
    # ... but not the fleet's override of the class itself; a pod one of the class beats it.
    core.set_override(Override("code", pin_k=4))
    core.decide(now=4.0)
    assert core.decision("code", 0).k == 4  # type: ignore[union-attr]
    covering = core.snapshot(4.0).class_view("code").overrides
    assert [(o.pin_k, o.scope) for o in covering] == [
        (4, OverrideScope.POD), (2, OverrideScope.FLEET), (3, OverrideScope.POD),
        (1, OverrideScope.FLEET)]
    assert covering[1].set_by == "sidecar-b"
    # Clearing the fleet layer is replacing it; clearing a pod override leaves the fleet's.
    core.set_fleet_overrides([])
    assert core.clear_override("code") and not core.clear_override("code", OverrideScope.FLEET)
    core.decide(now=5.0)
    assert core.decision("code", 0).k == 3  # type: ignore[union-attr]  # the pod's "*" now
    # A fleet override of a class this controller cannot track is refused with the reason,
    # and the others still apply.
    refused = core.set_fleet_overrides([Override("chat", pin_k=1), Override("new", pin_k=1)])
    assert [(o.traffic_class, "class limit" in why) for o, why in refused] == [("new", True)]
    assert [o.traffic_class for o in core.fleet_overrides()] == ["chat"]


def test_override_of_a_class_beyond_the_limit_is_refused() -> None:
    core = _core(max_classes=2)  # "default" + one more
    core.set_override(Override("code", force_off=True))
    before = core.snapshot(2.0)
    with pytest.raises(ValueError, match="folded into 'other'"):
        core.set_override(Override("chat", force_off=True))
    assert core.snapshot(2.0) == before
    assert "chat" not in {c.name for c in before.classes}
    core.set_override(Override(OTHER_CLASS, pin_k=1))
    core.decide(now=3.0)
    assert core.decision(OTHER_CLASS, 0).k == 1  # type: ignore[union-attr]


def test_explain_names_the_choice_and_the_numbers() -> None:
    core = _core()
    core.ingest("e1", _good(1), now=1.0)
    core.decide(now=1.0)
    exp = core.explain("code", 0, now=1.0)
    assert exp.decision is not None and "class 'code' at batch 1" in explanation_text(exp)
    assert {(a.draft, a.k) for a in exp.arms} >= {("", 0), ("d", 6), ("ngram", 4)}
    with pytest.raises(KeyError):
        core.explain("nope", 0, now=1.0)


def _arm_seconds(core: ControllerCore, batch_size: int) -> dict[tuple[str, int], float]:
    """Each arm's step seconds as the policy prices it at ``batch_size`` (a bucket's upper
    bound: no steps seen yet), by the explanation of class "default"."""
    exp = core.explain("default", core.config.bucket_of(batch_size), now=0.0)
    assert exp.batch_size == batch_size
    return {(a.draft, a.k): a.step_seconds for a in exp.arms}


def test_per_request_engines_pay_the_drafter_whatever_k() -> None:
    """In per-request mode the drafter drafts the configured K and the plugin cuts afterwards:
    every arm, off included, carries the drafter's cost; batch-wide engines draft only K."""
    for batch_wide, off_pays_drafter in ((False, True), (True, False)):
        core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
        core.connect_engine(replace(HELLO, batch_wide_k=batch_wide), now=0.0)
        plain = _arm_seconds(core, 8)[("", 0)]
        bare = core.predicted_seconds(StepShape.for_arm(8, 0, "", False))
        assert (plain > 1.01 * bare) is off_pays_drafter


def test_substituted_ngram_pays_the_model_drafters_passes_only_under_one_k_per_step() -> None:
    """Next to a model draft, n-gram drafts are substituted into the drafter's proposals. With
    one K for the whole step (batch_wide) an n-gram K runs the drafter's K passes, so it is
    priced like the model draft; with per-request K after a batch-max draft (batch_max) the
    plugin skips those passes, so n-gram K costs verification only."""
    for per_request, carrier in ((False, "d"), (True, "")):
        core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
        core.connect_engine(replace(HELLO, batch_wide_k=True, per_request_k=per_request),
                            now=0.0)
        specs = {d.name: d for d in core.drafts()}
        assert specs["ngram"].carrier == carrier and specs["d"].pass_draft == "d"
        seconds = _arm_seconds(core, 8)
        if carrier:
            assert seconds[("ngram", 3)] == pytest.approx(seconds[("d", 3)])
        else:
            assert seconds[("ngram", 3)] < seconds[("d", 3)]


def test_batch_mix_counts_verification_steps_and_finished_requests_of_silent_classes() -> None:
    core = _core()
    # Batch-wide K: the drafter drafts only the K asked (per-request engines draft max K for all,
    # so there the homogeneous view is exact and no joint search runs).
    core.connect_engine(replace(HELLO, batch_wide_k=True), now=0.0)
    report = EngineReport(
        sequence=1, interval_seconds=1.0, policy_version=0,
        acceptance=(AcceptanceRecord("code", "d", 3, (10, 20, 30, 40)),  # 100 steps
                    AcceptanceRecord("code", "ngram", 4, (50, 0, 0, 0, 0), counterfactual=True)),
        finished=(RequestSummaryRecord("code", "d", 10, 200, 150, 90, 1.0),  # counted above
                  RequestSummaryRecord("chat", "", 10, 301, 0, 0, 1.0)),  # off: 301 steps
    )
    core.ingest("e1", report, now=1.0)
    shares = {c.name: c.share for c in core.snapshot(1.0).classes if c.share is not None}
    assert shares == pytest.approx({"code": 100 / 401, "chat": 301 / 401})
    # The joint search needs two classes with data; it refreshes two stale buckets per round
    # (batch size 1 has no others), so four rounds cover the eight buckets above batch 1.
    core.decide(now=1.0)
    assert core.joint_arms() == {}
    core.ingest("e1", EngineReport(sequence=2, interval_seconds=1.0, policy_version=0,
                                   acceptance=(AcceptanceRecord("chat", "d", 2, (5, 5, 10)),)),
                now=2.0)
    for t in range(2, 6):
        core.decide(now=float(t))
    wanted = {b for b in range(core.config.n_buckets) if core.config.bucket_batch_size(b) > 1}
    joint = core.joint_arms()
    assert set(joint) == wanted
    assert all(set(arms) == {"code", "chat"} for arms in joint.values())


# This CPU, roughly: 2 ms a step plus 0.4 ms per verified token, 2 ms per draft pass.
def _cpu_seconds(batch: int, k: int) -> float:
    return 0.002 + 4e-4 * batch * (1 + k) + 0.002 * k


# Batch-wide K: a step drafts only the K chosen (per-request engines pay max K passes always).
WIDE = replace(HELLO, per_request_k=False, batch_wide_k=True)
CPU_PROFILE = tuple(StepProfile(b, b * (1 + k), "d" if k else "", k, _cpu_seconds(b, k))
                    for b in (1, 16, 32) for k in (0, 1, 2, 4))


def test_the_start_up_profile_centres_the_prices_of_shapes_it_did_not_time() -> None:
    """Default settings: the profile's points also centre the cost prior
    (``cost_prior_profile_center_steps``), so batch sizes and K between and beyond the profiled
    ones are priced from this hardware; at 0 (the control) only the light points move them."""
    def errors(**overrides: Any) -> list[float]:
        core = ControllerCore(core_config(load_settings(**overrides)), np.random.default_rng(0))
        core.connect_engine(replace(WIDE, step_profile=CPU_PROFILE), now=0.0)
        return [abs(core.predicted_step_seconds(b, "d", k) / _cpu_seconds(b, k) - 1)
                for b, k in ((8, 3), (24, 1), (4, 0), (16, 3))]

    centred, light = errors(), errors(cost_prior_profile_center_steps=0.0)
    assert max(centred) < 0.1, centred
    assert all(c < 0.5 * o for c, o in zip(centred, light, strict=True)), (centred, light)


def test_the_start_up_profile_seeds_the_cost_model_toward_this_hardware() -> None:
    bare = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    bare.connect_engine(WIDE, now=0.0)
    seeded = ControllerCore(core_config(load_settings(cost_prior_profile_weight_steps=100.0)),
                            np.random.default_rng(0))
    seeded.connect_engine(replace(WIDE, step_profile=CPU_PROFILE), now=0.0)
    prior_errors, seeded_errors = [], []
    for b, k in ((1, 0), (16, 0), (16, 2), (32, 4)):
        want = _cpu_seconds(b, k)
        prior_error = abs(bare.predicted_step_seconds(b, "d", k) - want)
        seeded_error = abs(seeded.predicted_step_seconds(b, "d", k) - want)
        prior_errors.append(prior_error)
        seeded_errors.append(seeded_error)
        assert seeded_error < prior_error, (b, k)
        # Batch 1 (2.4 ms) keeps some of the prior's pull (20 ms base): the points lend the
        # cost model their shape, and its level before any live step is the prior's centre
        # (the generic prior and the profile together): ~24% here.
        assert seeded_error < (0.3 if b == 1 else 0.1) * want, (b, k)
    assert sum(seeded_errors) < 0.25 * sum(prior_errors), (seeded_errors, prior_errors)
    # Live timings still take over: steps that disagree with the profile move the prediction.
    before = seeded.predicted_step_seconds(16, "d", 2)
    seeded.ingest("e1", replace(_good(), step_timings=(
        StepTimingRecord(4, "d", 2, 1000, 16000, 48000, 32000, 1000 * 2 * before),)), now=1.0)
    assert seeded.predicted_step_seconds(16, "d", 2) > 1.5 * before


@pytest.mark.parametrize("bad", [
    StepProfile(0, 1, "", 0, 0.01),         # no sequences
    StepProfile(8, 4, "", 0, 0.01),         # fewer verified tokens than sequences
    StepProfile(8, 8, "", 2, 0.01),         # passes without a draft
    StepProfile(8, 8, "", 0, float("nan")),
    StepProfile(8, 8, "", 0, 0.0),
    StepProfile(8, 8, "", 0, 1e6),
])
def test_a_bad_start_up_profile_is_rejected(bad: StepProfile) -> None:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    with pytest.raises(ReportRejected, match=r"hello\.step_profile\[1\]"):
        core.connect_engine(replace(HELLO, step_profile=(CPU_PROFILE[0], bad)), now=0.0)
    too_many = replace(HELLO, step_profile=CPU_PROFILE * 30)
    with pytest.raises(ReportRejected, match="exceed"):
        core.connect_engine(too_many, now=0.0)


@pytest.mark.parametrize("hardware", ["x" * 201, "line\nbreak"])
def test_a_hardware_name_that_is_too_long_or_not_printable_is_rejected(hardware: str) -> None:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    with pytest.raises(ReportRejected, match=r"hello\.hardware"):
        core.connect_engine(replace(HELLO, hardware=hardware), now=0.0)
    core.connect_engine(replace(HELLO, hardware="x" * 200), now=0.0)  # the bound itself is fine


def test_a_profile_learnt_is_not_kept() -> None:
    """Up to 0.3 MiB an engine: the registry holds the rest of the hello."""
    engines = EngineRegistry()
    engines.register(replace(WIDE, step_profile=CPU_PROFILE), {}, now=0.0)
    held = engines.get("e1")
    assert held is not None and held.hello == replace(WIDE, step_profile=())


def test_older_plugins_without_a_profile_keep_the_prior() -> None:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    core.connect_engine(WIDE, now=0.0)
    assert core.predicted_step_seconds(1, "", 0) == pytest.approx(0.02 + 2e-5, rel=0.01)
    # A per-request engine's drafter runs its max K passes even at K=0.
    assert _core().predicted_step_seconds(1, "", 0) > core.predicted_step_seconds(1, "", 0)


def test_each_timing_record_is_priced_before_it_is_learnt() -> None:
    core = _core()
    # 100 steps at batch 1, K=3 with draft d (the shape of _good's record), 30 ms each.
    before = core.predicted_seconds(StepShape(1, 4, "d", 3, 3))  # the record's shape
    first = core.ingest("e1", _good(1), now=1.0).step_predictions
    assert [(p.batch_bucket, p.k, p.steps) for p in first] == [(0, 3, 100)]
    assert first[0].predicted_seconds == pytest.approx(before)
    assert first[0].measured_seconds == pytest.approx(0.03)
    # The next identical record is priced by a model that has learnt the first.
    second = core.ingest("e1", _good(2), now=2.0).step_predictions
    assert abs(second[0].predicted_seconds - 0.03) < abs(first[0].predicted_seconds - 0.03) / 2


def _near_tie_report(seq: int, bucket: int) -> EngineReport:
    """Acceptance 0.5 per position (every K close to the next) and steps in ``bucket`` only."""
    return EngineReport(
        sequence=seq, interval_seconds=1.0, policy_version=0,
        acceptance=(AcceptanceRecord("code", "d", 4, (8, 4, 2, 1, 1)),),
        finished=(), step_timings=(StepTimingRecord(bucket, "d", 4, 50, 50, 250, 200, 1.0),))


def test_a_bucket_without_new_evidence_keeps_its_decision() -> None:
    """Evidence arrives only from bucket 0: every other bucket of the class is decided once and
    then holds, round after round, while bucket 0 keeps re-deciding on its fresh draws. The
    control: the same rounds with steps in every bucket change the other buckets too."""
    def changes(buckets: list[int]) -> dict[int, int]:
        core = _core(seed=0)
        changed = dict.fromkeys(range(core.config.n_buckets), 0)
        for seq in range(1, 60):
            report = _near_tie_report(seq, buckets[0])
            report = replace(report, step_timings=tuple(
                StepTimingRecord(b, "d", 4, 5, 5 * core.config.bucket_batch_size(b),
                                 25 * core.config.bucket_batch_size(b), 20, 0.1)
                for b in buckets))
            core.ingest("e1", report, now=float(seq))
            for event in core.decide(float(seq)):
                if event.previous is not None and event.decision.traffic_class == "code":
                    changed[event.decision.bucket] += 1
        return changed

    idle = changes([0])
    assert idle[0] > 0 and all(idle[b] == 0 for b in idle if b != 0)  # 10 and 0 measured
    busy = changes(list(range(len(idle))))
    assert all(busy[b] > 0 for b in busy)  # 9 each measured


def test_a_bucket_is_priced_at_the_batch_size_it_runs_at() -> None:
    """Steps at batch 36 land in the 33-64 bucket: its arms are priced at 36, not at 64 (where
    a load of 36 was switched off as if it were 64). The control: a bucket without steps keeps
    its upper bound."""
    core = _core()
    b = core.config.bucket_of(36)
    report = replace(_good(1), step_timings=(StepTimingRecord(b, "d", 3, 50, 50 * 36,
                                                              50 * 36 * 4, 50 * 36 * 3, 2.0),))
    core.ingest("e1", report, now=1.0)
    core.decide(now=1.0)
    priced = core.explain("code", b, now=1.0)
    assert priced.batch_size == 36
    arm = next(a for a in priced.arms if (a.draft, a.k) == ("d", 2))
    assert arm.step_seconds == pytest.approx(core.predicted_step_seconds(36, "d", 2))
    assert core.explain("code", b - 1, now=1.0).batch_size == 32


def test_the_batch_mix_follows_a_switch_of_traffic_within_a_minute() -> None:
    """A minute of chat only, then a minute of code only: the mix the joint search and the
    mixed arm tables use has turned to code: the chat minute weighs a quarter after two
    half-lives of 30 s, so code's share is 1 / (1 + 1/4). The
    control: at the acceptance estimator's 300 s half-life the mix would be about even."""
    def code_share(half_life: float) -> float:
        core = _core(traffic_half_life_seconds=half_life)
        for t in range(1, 121):
            cls = "chat" if t <= 60 else "code"
            core.ingest("e1", EngineReport(
                sequence=t, interval_seconds=1.0, policy_version=0,
                acceptance=(AcceptanceRecord(cls, "d", 3, (10, 20, 30, 40)),)), now=float(t))
        shares = {c.name: c.share for c in core.snapshot(120.0).classes}
        return float(shares["code"] or 0.0)

    assert code_share(30.0) == pytest.approx(0.8, abs=1e-9)
    assert code_share(300.0) < 0.6  # 0.53: the chat minute still weighs 0.87


def test_the_measured_speedup_prices_served_steps_by_the_cost_model() -> None:
    core = _core()
    t0, t2 = core.predicted_step_seconds(1, "", 0), core.predicted_step_seconds(1, "d", 2)
    served = AcceptanceRecord("code", "d", 2, (0, 0, 100))  # 3 tokens every step
    scored = AcceptanceRecord("code", "ngram", 2, (100, 0, 0), counterfactual=True)  # not run
    core.ingest("e1", EngineReport(sequence=1, interval_seconds=1.0, policy_version=0,
                                   acceptance=(served, scored), running_requests=1), now=1.0)
    view = core.snapshot(1.0).class_view("code")
    assert view.measured_tokens_per_step == pytest.approx(3.0)
    assert view.measured_speedup == pytest.approx(3.0 * t0 / t2)


def test_policy_versions_carry_the_epoch_and_engines_count_versions_of_this_epoch() -> None:
    from specpilot.controller.core.published import EPOCH_SHIFT, epoch_at

    earlier, later = epoch_at(1_800_000_000.0), epoch_at(1_800_000_000.1)
    assert later == earlier + 1
    first = ControllerCore(core_config(load_settings()), np.random.default_rng(0), epoch=earlier)
    first.connect_engine(HELLO, now=0.0)
    assert first.version == earlier << EPOCH_SHIFT
    for t in range(1, 40):  # many rounds of a busy controller
        first.ingest("e1", _good(t), now=float(t))
        first.decide(float(t))
    assert first.version > earlier << EPOCH_SHIFT
    # A restart a tenth of a second later starts above everything the first one sent.
    second = ControllerCore(core_config(load_settings()), np.random.default_rng(0), epoch=later)
    assert second.version > first.version
    # Behind: the versions of this epoch not applied yet; an engine on its static configuration
    # (0) or on the previous controller's policy is behind by all of them.
    second.connect_engine(HELLO, now=0.0)
    second.decide(1.0)
    for applied, behind in ((0, second.version - (later << EPOCH_SHIFT) + 1),
                            (first.version, second.version - (later << EPOCH_SHIFT) + 1),
                            (second.version, 0)):
        second.ingest("e1", replace(_good(1), policy_version=applied), now=2.0)
        assert second.snapshot(2.0).engines[0].versions_behind == behind
        second.connect_engine(HELLO, now=2.0)  # a new stream: sequences start again
    with pytest.raises(ValueError, match="epoch"):
        ControllerCore(core_config(load_settings()), np.random.default_rng(0), epoch=-1)


def _classes(core: ControllerCore, now: float = 0.0) -> set[str]:
    return {c.name for c in core.snapshot(now).classes}


def _names(*names: str, seq: int = 1) -> EngineReport:
    """A report whose acceptance records name each of ``names`` once."""
    return replace(_good(seq), acceptance=tuple(
        AcceptanceRecord(n, "d", 3, (1, 1, 1, 1)) for n in names), finished=())


def test_an_engine_cannot_take_every_class_slot_while_another_is_connected() -> None:
    core = _core(max_classes=16)  # e1 connected; 14 slots beside "default" and "other"
    core.ingest("e1", _names("chat"), now=1.0)
    core.connect_engine(replace(HELLO, engine_id="rogue"), now=1.0)
    junk = [f"junk-{i}" for i in range(21)]
    result = core.ingest("rogue", _names(*junk), now=2.0)
    # Its share: 14 slots over two engines.
    assert len(_classes(core) & set(junk)) == 7 and len(result.folded_classes) == 14
    # The real engine still brings new classes.
    assert not core.ingest("e1", _names("code", seq=2), now=3.0).folded_classes
    assert {"chat", "code"} <= _classes(core)
    # Alone, an engine may use every slot.
    solo = _core(max_classes=16)
    solo.ingest("e1", _names(*junk), now=1.0)
    assert len(_classes(solo) & set(junk)) == 15


def test_a_departed_engines_classes_give_their_slots_to_new_ones() -> None:
    core = _core(max_classes=5, declared_classes=["known"])  # default, known, other + 2
    core.connect_engine(replace(HELLO, engine_id="gone"), now=0.0)
    core.ingest("gone", _names("g1", "g2"), now=1.0)  # share: 2 over 2 engines = 1 each
    assert _classes(core) == {"default", "known", "g1", OTHER_CLASS}
    core.ingest("e1", _names("chat"), now=2.0)
    assert "chat" in _classes(core)
    # The table is full; a new class of e1 folds while g1's engine is connected...
    assert core.ingest("e1", _names("code", seq=2), now=3.0).folded_classes == ("code",)
    core.disconnect_engine("gone")
    # ...and takes g1's slot once it has left (e1 is alone now: its share is both slots).
    assert not core.ingest("e1", _names("code", seq=3), now=4.0).folded_classes
    assert _classes(core) == {"default", "known", "chat", "code", OTHER_CLASS}
    assert not core.estimate("g1", "d", 4.0).has_evidence  # forgotten with its slot


def test_idle_classes_age_out_except_declared_and_overridden_ones() -> None:
    core = _core(max_classes=8, declared_classes=["known"], class_idle_seconds=100.0)
    core.ingest("e1", _names("old", "pinned", "busy"), now=1.0)
    core.set_override(Override("pinned", pin_k=1))
    core.decide(1.0)
    version = core.version
    assert core.forget_idle_classes(50.0) == ()
    core.ingest("e1", _names("busy", seq=2), now=60.0)
    assert core.forget_idle_classes(150.0) == ("old",)
    assert _classes(core, 150.0) == {"default", "known", "pinned", "busy"}
    assert not core.estimate("old", "d", 150.0).has_evidence
    core.decide(150.0)
    assert core.version > version  # engines hear the class is gone
    # An engine that stays connected but stopped naming a class lets it age out too.
    assert core.forget_idle_classes(161.0) == ("busy",)
    # Overrides only for classes that exist or are declared.
    core.check_operator_override(Override("known", force_off=True))
    with pytest.raises(ValueError, match=r"override\.traffic_class"):
        core.check_operator_override(Override("old", force_off=True))


def test_a_class_the_report_names_is_never_evicted_for_another_it_names() -> None:
    core = _core(max_classes=5)  # default, other + 3 slots
    core.connect_engine(replace(HELLO, engine_id="a"), now=0.0)
    core.ingest("a", _names("chat", "code", "batch"), now=1.0)
    core.disconnect_engine("a")
    # "x" needs a vacant slot; "batch" (vacant, and named here too) must not be the one.
    result = core.ingest("e1", _names("x", "batch"), now=2.0)
    assert not result.folded_classes
    assert {"x", "batch"} <= _classes(core) and "chat" not in _classes(core)


def test_an_engine_ahead_of_this_controllers_versions_is_not_behind() -> None:
    core = _core()
    core.decide(1.0)
    core.ingest("e1", replace(_good(1), policy_version=core.version + 1000), now=2.0)
    assert core.snapshot(2.0).engines[0].versions_behind == 0


def test_a_draft_longer_than_the_controllers_max_k_shows_only_the_positions_tracked() -> None:
    # Found by benchmarks/scale.py overload: an engine whose draft announces K=6 beside a
    # controller of max_k 4 made every GetPolicy fail (IndexError: position 5 of 4 tracked).
    from specpilot.controller.wire import estimate_to_proto

    core = _core(max_k=4)
    core.ingest("e1", _good(), now=1.0)
    core.decide(now=1.0)
    shown = {e.draft: e for c in core.snapshot(1.0).classes for e in c.estimates}
    assert shown["d"].positions == 4 and len(shown["d"].mean) == 4
    assert [p.position for p in estimate_to_proto(shown["d"], 0.9).positions] == [1, 2, 3, 4]
    # The control: the draft's own K, unclamped, is beyond what is tracked.
    assert HELLO.drafts[0].max_k > len(core.estimate("code", "d", 1.0).alpha)


def test_the_drafts_follow_engines_connecting_and_leaving() -> None:
    # drafts() is kept between calls: it must still follow every connect and departure.
    core = _core()
    assert [d.name for d in core.drafts()] == ["d", "ngram"]
    other = replace(HELLO, engine_id="e2", drafts=(DraftSpec("eagle", DraftKind.MODEL, 4, "v1"),))
    core.connect_engine(other, now=1.0)
    assert [d.name for d in core.drafts()] == ["d", "ngram", "eagle"]
    core.disconnect_engine("e1")
    assert [d.name for d in core.drafts()] == ["eagle"]
    core.disconnect_engine("e2")
    assert core.drafts() == ()


def _model_drafts(engine_id: str, names: list[str]) -> EngineHello:
    return replace(HELLO, engine_id=engine_id,
                   drafts=tuple(DraftSpec(n, DraftKind.MODEL, 4, "v1") for n in names))


def test_model_drafts_are_bounded_across_engines_and_reconnects() -> None:
    # An engine that reconnects under new draft names each time must not grow the cost model
    # (3 columns a draft, a prior of their square) without bound: drafts nobody announces any
    # more give their columns back, the longest-held first.
    core = _core(max_model_drafts=4)
    core.ingest("e1", _good(), now=1.0)

    def has_data(draft: str, now: float) -> bool:
        return core.estimate("code", draft, now).has_evidence

    assert has_data("d", 1.0)
    for round_ in range(5):
        names = [f"r{round_}-{i}" for i in range(3)]
        outcome = core.connect_engine(_model_drafts("rogue", names), now=2.0 + round_)
        assert outcome.accepted_drafts == tuple(names) and outcome.rejected_drafts == ()
        held = core.priced_drafts()
        assert len(held) <= 4 and "d" in held  # e1's draft is in use: kept
        assert set(names) <= set(held)
        rogue = EngineReport(
            sequence=1, interval_seconds=1.0, policy_version=0,
            acceptance=(AcceptanceRecord("code", names[0], 3, (1, 2, 3, 4)),))
        core.ingest("rogue", rogue, now=2.5 + round_)
        assert has_data(names[0], 2.5 + round_)
    assert has_data("d", 7.0) and not has_data("r0-0", 7.0)
    # Every column in use by connected engines: a new draft is refused, with the reason.
    outcome = core.connect_engine(_model_drafts("e3", ["new"]), now=10.0)
    assert outcome.accepted_drafts == ()
    assert outcome.rejected_drafts and "max_model_drafts" in outcome.rejected_drafts[0][1]
    assert "new" not in core.priced_drafts()
    # Once an engine leaves, its drafts' columns can be taken.
    core.disconnect_engine("rogue")
    outcome = core.connect_engine(_model_drafts("e3", ["new"]), now=11.0)
    assert outcome.accepted_drafts == ("new",) and "new" in core.priced_drafts()
    snap = core.snapshot(12.0)
    assert snap.version >= 0 and core.decide(12.0) is not None  # decisions still priced


def test_without_the_bound_the_columns_grow_with_every_new_name() -> None:
    """The control: at the bound's ceiling the same churn keeps every name."""
    core = _core(max_model_drafts=64)
    for round_ in range(5):
        core.connect_engine(_model_drafts("rogue", [f"r{round_}-{i}" for i in range(3)]),
                            now=2.0 + round_)
    assert len(core.priced_drafts()) == 16


def test_drafts_carried_by_a_model_draft_refused_for_room_are_refused_too() -> None:
    # In a batch-wide engine an n-gram draft runs its model drafter's passes: with that model
    # refused (no cost column left), they would be priced as free drafting.
    core = _core(max_model_drafts=1)  # e1's "d" holds the only column
    wide = replace(HELLO, engine_id="e2", batch_wide_k=True, per_request_k=False, drafts=(
        DraftSpec("other", DraftKind.MODEL, 4, "v1"), DraftSpec("ngram", DraftKind.NGRAM, 4)))
    outcome = core.connect_engine(wide, now=1.0)
    assert outcome.accepted_drafts == ()
    reasons = dict(outcome.rejected_drafts)
    assert "max_model_drafts" in reasons["other"] and "other" in reasons["ngram"]
    # The control: with room, both are taken and the n-gram draft is priced by its carrier.
    roomy = _core(max_model_drafts=2)
    assert roomy.connect_engine(wide, now=1.0).accepted_drafts == ("other", "ngram")
    per_request = replace(wide, engine_id="e3", batch_wide_k=False, per_request_k=True)
    assert core.connect_engine(per_request, now=2.0).accepted_drafts == ("ngram",)


def test_an_engine_back_with_a_smaller_max_k_does_not_break_the_joint_search() -> None:
    # Found by the fuzzer: a class's decision at K=5 stayed while the engine reconnected with
    # max_k 2, and the joint search, started from that arm, failed every decide round with
    # ValueError ("(draft, K) is not in list"), so no hello was answered.
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    core.connect_engine(WIDE, now=0.0)
    for seq, cls in enumerate(("code", "chat", "code", "chat"), start=1):
        core.ingest("e1", replace(_good(seq, cls), running_requests=16), now=float(seq))
    core.set_override(Override("code", pin_k=5))
    core.decide(5.0)
    assert {d.k for d in core.snapshot(5.0).class_view("code").decisions} == {5}
    core.clear_override("code")
    core.connect_engine(replace(WIDE, max_k=2, drafts=(
        DraftSpec("d", DraftKind.MODEL, 2, "v1"), DraftSpec("ngram", DraftKind.NGRAM, 2))),
        now=6.0)
    core.decide(20.0)  # a joint search is due: it must start from arms the engine runs
    assert all(d.k <= 2 for c in core.snapshot(20.0).classes for d in c.decisions)


def test_the_composition_goes_to_engines_that_repick_and_moves_with_the_evidence() -> None:
    """An engine announcing step_composition gets, with the policy, the cost model's mean
    weights and the E(K) curves of the classes per draft they have evidence for; a new version
    carries a new composition only when one moved by more than the tolerance. Engines that
    cannot use it (older plugins; a per-request engine, whose drafter runs anyway) get none."""
    batch_max = replace(HELLO, per_request_k=True, batch_wide_k=True, step_composition=True)
    core = ControllerCore(core_config(load_settings(dwell_seconds=0.0)),
                          np.random.default_rng(0))
    core.connect_engine(batch_max, now=0.0)
    core.decide(now=1.0)
    empty = core.snapshot(1.0).composition
    assert empty is not None and not empty.expected_tokens  # no evidence yet: no curves
    core.ingest("e1", _good(1), now=2.0)
    core.decide(now=2.0)
    comp = core.snapshot(2.0).composition
    assert comp is not None and set(comp.expected_tokens) == {("code", "d")}
    posterior = core.estimate("code", "d", 2.0)
    mean = np.array(posterior.alpha) / (np.array(posterior.alpha) + np.array(posterior.beta))
    assert np.allclose(comp.expected_tokens[("code", "d")],
                       expected_tokens_curve(mean)[: 7])
    assert comp.pricing == core.cost_fit()  # the fit it was built from
    version = core.version
    core.decide(now=2.5)  # nothing new: the same policy, the same composition
    assert core.version == version and core.snapshot(2.5).composition is comp
    core.ingest("e1", replace(_good(2), acceptance=(
        AcceptanceRecord("code", "d", 3, (4000, 0, 0, 0)),)), now=3.0)
    core.decide(now=3.0)
    assert core.version > version and core.snapshot(3.0).composition is not comp
    for hello in (HELLO, replace(batch_max, batch_wide_k=False)):  # older plugin, per request
        other = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
        other.connect_engine(hello, now=0.0)
        other.ingest("e1", _good(1), now=1.0)
        other.decide(now=1.0)
        assert other.snapshot(1.0).composition is None


def test_a_bucket_takes_a_shorter_k_when_its_contexts_grow_long() -> None:
    """Under a cost whose context term is large (attention over 2,000 tokens a sequence costs
    each verified token ~2 ms here), long contexts make the verified tokens of K=4 cost more
    than its accepted drafts give: the bucket the steps ran in goes to a shorter K. The
    control: the same evidence at 50 tokens a sequence keeps a long K (4 or more)."""
    def decided_k(context: int) -> int:
        core = _core(cost_prior_seconds_per_context_token=1e-6, cost_prior_sample_scale=0.0)
        b = core.config.bucket_of(16)
        for seq in range(1, 21):
            report = EngineReport(
                sequence=seq, interval_seconds=1.0, policy_version=0,
                acceptance=(AcceptanceRecord("code", "d", 4, (5, 5, 10, 20, 160)),),
                # One step: it sets the bucket's context and barely moves the fit.
                step_timings=(StepTimingRecord(b, "d", 4, 1, 16, 16 * 5, 16 * 4,
                                               core.predicted_step_seconds(16, "d", 4),
                                               16 * context),))
            core.ingest("e1", report, now=float(seq))
            core.decide(now=float(seq))
        decision = core.decision("code", b)
        assert decision is not None
        return decision.k

    assert decided_k(50) >= 4
    assert decided_k(2000) < 4
