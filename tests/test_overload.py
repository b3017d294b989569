"""ReportBudget: the loop time reports may take per window, on a clock the test moves."""

from __future__ import annotations

import pytest

from specpilot.controller.server.overload import WINDOW_SECONDS, ReportBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reports_within_the_share_are_taken_and_the_rest_of_the_window_shed() -> None:
    clock = Clock()
    budget = ReportBudget(0.5, clock)
    taken = 0
    while budget.admit():
        budget.spend(0.01)  # a 10 ms report
        taken += 1
    assert taken == 50  # 0.5 s of the 1 s window
    assert budget.retry_after_seconds() == pytest.approx(WINDOW_SECONDS)
    clock.now += 0.6
    assert not budget.admit()
    assert budget.retry_after_seconds() == pytest.approx(0.4)
    clock.now += 0.4  # a new window
    assert budget.admit()


def test_work_beyond_a_window_is_carried_into_the_next() -> None:
    clock = Clock()
    budget = ReportBudget(0.5, clock)
    budget.spend(1.7)  # one long round: 1.2 s over this window's 0.5 s
    clock.now += 1.0
    assert not budget.admit()  # 1.2 s left over: still above the next window's 0.5 s
    assert budget.retry_after_seconds() == pytest.approx(WINDOW_SECONDS + 1.4)
    clock.now += 1.0
    assert not budget.admit()  # 0.7 s carried
    clock.now += 1.0
    assert budget.admit()  # 0.2 s carried: below 0.5 s


def test_the_pause_asked_of_a_shed_report_is_capped() -> None:
    # A long round (a 1 MiB report, a saturated loop) must not tell engines to wait past the
    # silence timeout: they would be dropped as silent for obeying.
    clock = Clock()
    budget = ReportBudget(0.5, clock, max_retry_after=15.0)
    budget.spend(40.0)  # 79 windows of work carried
    assert not budget.admit()
    assert budget.retry_after_seconds() == pytest.approx(15.0)
    uncapped = ReportBudget(0.5, clock, max_retry_after=1000.0)
    uncapped.spend(40.0)
    assert uncapped.retry_after_seconds() == pytest.approx(WINDOW_SECONDS + 79.0)  # the control


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="share"):
        ReportBudget(share)
