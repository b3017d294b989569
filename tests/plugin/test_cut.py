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
from specpilot.engine_plugin.policy.cut import CutTable, cut_length
from specpilot.engine_plugin.policy.view import PolicyView


def rows(per_position: list[float], cls: str = "a", transformed: bool = False,
         by_bucket: dict[int, float] | None = None) -> CalibrationRows:
    """Acceptance ``per_position`` in every bucket (``by_bucket`` overriding some buckets)."""
    accept = [by_bucket.get(b, p) if by_bucket else p
              for p in per_position for b in range(N_CONFIDENCE_BUCKETS)]
    return CalibrationRows(cls, "d", transformed, len(per_position), tuple(accept))


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
    with pytest.raises(ValueError, match="values for"):
        CutTable(TokenCut((0.1,), (CalibrationRows("a", "d", False, 2, (0.5,) * 3),)))
    with pytest.raises(ValueError, match="values for"):
        CutTable(TokenCut((0.1,), (rows([1.5]),)))
    with pytest.raises(ValueError, match="min_survival"):
        CutTable(TokenCut((float("nan"),), (rows([0.5]),)))


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
