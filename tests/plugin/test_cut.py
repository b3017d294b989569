"""The token cut on the engine side: how many drafts a request verifies, from the drafter's
confidences, the class's calibration and the bucket's min_survival; the policy view's lookup;
the pilot cutting a request's drafts."""

from __future__ import annotations

import pytest

from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS, confidence_bucket
from specpilot.contract.records import (
    CalibrationRows,
    EngineDecision,
    PolicyUpdate,
    TokenCut,
)
from specpilot.engine_plugin.policy.cut import CutTable, DrafterStop, cut_length
from specpilot.engine_plugin.policy.view import PolicyView


def rows(per_position: list[float], cls: str = "a", transformed: bool = False,
         by_bucket: dict[int, float] | None = None,
         mean: list[float] | None = None) -> CalibrationRows:
    """Acceptance ``per_position`` in every bucket (``by_bucket`` overriding some buckets);
    ``mean``: the class's mean acceptance by position (default ``per_position``)."""
    accept = [by_bucket.get(b, p) if by_bucket else p
              for p in per_position for b in range(N_CONFIDENCE_BUCKETS)]
    return CalibrationRows(cls, "d", transformed, len(per_position), tuple(accept),
                           tuple(per_position if mean is None else mean))


def test_drafts_are_cut_before_the_first_token_whose_survival_falls_short() -> None:
    r = rows([0.9, 0.8, 0.5, 0.9])
    # Survival 0.9, 0.72, 0.36, 0.324.
    assert cut_length([0.5] * 4, r, 0.0) == 4  # free verification: nothing cut
    assert cut_length([0.5] * 4, r, 0.3) == 4
    assert cut_length([0.5] * 4, r, 0.4) == 2
    assert cut_length([0.5] * 4, r, 0.95) == 0
    assert cut_length([0.5] * 2, r, 0.4) == 2  # only shortens what the decision kept
    # Positions beyond the calibration are kept as the decision allows.
    assert cut_length([0.5] * 6, rows([0.9, 0.9]), 0.5) == 6


def test_the_tokens_own_confidence_decides_by_its_bucket() -> None:
    top = confidence_bucket(0.99)
    r = rows([0.2, 0.2, 0.2], by_bucket={top: 0.95})
    assert cut_length([0.99, 0.99, 0.99], r, 0.5) == 3  # 0.95, 0.90, 0.86
    assert cut_length([0.99, 0.3, 0.99], r, 0.5) == 1  # the unsure second token stops it


def test_a_malformed_cut_is_refused_whole() -> None:
    with pytest.raises(ValueError, match="3 values and 0 means for 2 positions"):
        CutTable(TokenCut((0.1,), (CalibrationRows("a", "d", False, 2, (0.5,) * 3),)))
    with pytest.raises(ValueError, match="each a probability"):
        CutTable(TokenCut((0.1,), (rows([1.5]),)))
    with pytest.raises(ValueError, match="each a probability"):
        CutTable(TokenCut((0.1,), (rows([0.5], mean=[1.5]),)))
    with pytest.raises(ValueError, match="1 means for 2 positions"):
        CutTable(TokenCut((0.1,), (rows([0.5, 0.5], mean=[0.5]),)))
    with pytest.raises(ValueError, match="min_survival"):
        CutTable(TokenCut((float("nan"),), (rows([0.5]),)))
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="pass_tokens"):
            CutTable(TokenCut((0.1,), (rows([0.5]),), (bad,)))


def _view(cut: TokenCut | None) -> PolicyView:
    view = PolicyView(static_k=4, static_draft="d", fail_static_timeout_seconds=30.0, max_k=4)
    view.apply(PolicyUpdate(1, tuple(EngineDecision(c, b, "d", 4) for c in ("a", "other")
                                     for b in range(len(view.bucket_bounds) + 1)),
                            fail_static_timeout_seconds=30.0, cut=cut))
    return view


def test_the_view_answers_a_requests_cut_in_its_bucket() -> None:
    view = _view(TokenCut(tuple(0.1 * i for i in range(9)),
                          (rows([0.5], "a"), rows([0.4], "a", transformed=True),
                           rows([0.3], "other"))))
    lookup = view.lookup(1)
    assert lookup.cuts()
    got = lookup.cut("a", "d", False)
    assert got is not None and got[0].accept[0] == 0.5 and got[1] == 0.0
    assert lookup.cut("a", "d", True)[0].accept[0] == 0.4  # type: ignore[index]
    assert lookup.cut("b", "d", False) is None  # nothing counted for it: never cut
    assert view.lookup(32).cut("a", "d", False)[1] == pytest.approx(  # type: ignore[index]
        0.1 * view.lookup(32)._bucket)
    view.set_folded_classes(["b"])
    assert view.lookup(1).cut("b", "d", False)[0].traffic_class == "other"  # type: ignore[index]


def test_without_a_usable_cut_nothing_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    assert not _view(None).lookup(1).cuts()
    bad = _view(TokenCut((0.1,), (CalibrationRows("a", "d", False, 2, (0.5,)),)))
    assert not bad.lookup(1).cuts() and bad.lookup(1).cut("a", "d", False) is None
    assert "token cut is unusable" in caplog.text


def _passes(stop: DrafterStop, confidences: list[list[float]]) -> int:
    """Run the drafter's passes as a worker would (``confidences``: per pass, each request's
    token's), stopping where ``stop`` says; the passes run."""
    for row in confidences:
        if not stop.after_pass(row):
            break
    return stop.passes


def test_the_drafter_stops_where_no_request_pays_for_another_pass() -> None:
    sure, unsure = 0.99, 0.1
    r = rows([0.7] * 4, by_bucket={confidence_bucket(sure): 0.95,
                                   confidence_bucket(unsure): 0.05})
    # A batch of one whose second token is unlikely: a third pass is not worth its price.
    assert _passes(DrafterStop([(r, 4)], 0.0, 0.3), [[sure], [unsure], [sure], [sure]]) == 2
    # Its tokens likely: the drafter runs every pass its K asks for, never more.
    assert _passes(DrafterStop([(r, 4)], 0.0, 0.3), [[sure]] * 6) == 4
    # The same unlikely token beside a likely request: the pass pays for the other one.
    assert _passes(DrafterStop([(r, 4), (r, 4)], 0.0, 0.3),
                   [[sure, sure], [unsure, sure], [sure, sure], [sure, sure]]) == 4
    # A free pass is always run; a request cut by min_survival wants nothing more.
    assert _passes(DrafterStop([(r, 4)], 0.0, 0.0), [[sure], [unsure], [sure], [sure]]) == 4
    assert _passes(DrafterStop([(r, 4)], 0.5, 0.0), [[unsure], [sure], [sure], [sure]]) == 1


def test_tokens_as_likely_as_the_class_keep_the_k_its_decision_paid_for() -> None:
    # The pass is priced above what the class's mean tokens gain from it: the decision chose
    # K=3 anyway, so mean tokens run it, and only tokens below the mean stop it.
    r = rows([0.6] * 3, by_bucket={confidence_bucket(0.1): 0.1, confidence_bucket(0.99): 0.9},
             mean=[0.6] * 3)
    middling = 0.65  # a bucket left at the class's 0.6
    assert _passes(DrafterStop([(r, 3)], 0.0, 5.0), [[middling]] * 3) == 3
    assert _passes(DrafterStop([(r, 3)], 0.0, 5.0), [[0.1]] * 3) == 1
    # Within a few percent of the mean (a calibration's own error: cells near their prior, as
    # a cold controller's are) is the mean; well below it is not.
    near = rows([0.6] * 3, by_bucket={confidence_bucket(0.65): 0.59}, mean=[0.6] * 3)
    assert _passes(DrafterStop([(near, 3)], 0.0, 5.0), [[middling]] * 3) == 3
    below = rows([0.6] * 3, by_bucket={confidence_bucket(0.65): 0.5}, mean=[0.6] * 3)
    assert _passes(DrafterStop([(below, 3)], 0.0, 5.0), [[middling]] * 3) == 1


def test_requests_the_cut_does_not_cover_keep_every_pass() -> None:
    without_mean = CalibrationRows("a", "d", False, 1, (0.01,) * N_CONFIDENCE_BUCKETS)
    for covered in (None, without_mean):
        assert _passes(DrafterStop([(covered, 3)], 0.0, 100.0), [[0.1]] * 3) == 3
    # A request past its calibration's positions keeps drafting up to its K as well.
    assert _passes(DrafterStop([(rows([0.9]), 3)], 0.0, 100.0), [[0.99]] * 3) == 3


def test_every_requests_survival_counts_every_pass_whoever_paid_for_it() -> None:
    # r0 (not covered, K=2) pays for pass 2 alone; r1's second token still counts: its
    # survival 0.5, 0.25, then 0.125 below 0.2 at its third, where the drafter stops (the cut
    # would drop that token anyway) instead of drafting up to r1's K.
    r = rows([0.5] * 4, mean=[0.9] * 4)
    stop = DrafterStop([(None, 2), (r, 4)], 0.2, 0.0)
    assert _passes(stop, [[0.5, 0.5]] * 4) == 3
    assert cut_length([0.5] * 3, r, 0.2) == 2


def test_the_view_answers_the_drafters_price_in_its_bucket() -> None:
    bounds = len(PolicyView(static_k=4, static_draft="d", fail_static_timeout_seconds=30.0,
                            max_k=4).bucket_bounds) + 1
    view = _view(TokenCut(tuple(0.1 * i for i in range(bounds)), (rows([0.5]),),
                          tuple(float(i) for i in range(bounds))))
    lookup = view.lookup(32)
    assert lookup.drafter_stop() == pytest.approx((0.1 * lookup._bucket, lookup._bucket))
    assert _view(TokenCut((0.1,) * bounds, (rows([0.5]),))).lookup(1).drafter_stop() is None
    assert _view(None).lookup(1).drafter_stop() is None
