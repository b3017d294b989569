"""The calibration reliability benchmark's pure parts: the prompt split, the counting of the
plugin's confidence records and the per-bucket comparison with its expected calibration error."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.reliability import CellCounts, reliability, split
from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS, bucket_midpoints
from specpilot.contract.records import ConfidenceRecord


def test_the_split_is_disjoint_fixed_and_refuses_too_few() -> None:
    items = list(range(20))
    train, held = split(items, 8, 10)
    assert (len(train), len(held)) == (8, 10) and not set(train) & set(held)
    assert split(items, 8, 10) == (train, held)
    assert train != items[:8]  # shuffled, not the data set's order
    with pytest.raises(ValueError, match="ask for fewer"):
        split(items, 12, 10)
    with pytest.raises(ValueError):
        split(items, 0, 5)


def _record(position: int, tried: dict[int, int], accepted: dict[int, int], cls: str = "a",
            draft: str = "d", transformed: bool = False) -> ConfidenceRecord:
    row = [0] * N_CONFIDENCE_BUCKETS
    acc = [0] * N_CONFIDENCE_BUCKETS
    for b, n in tried.items():
        row[b] = n
    for b, n in accepted.items():
        acc[b] = n
    return ConfidenceRecord(cls, draft, position, tuple(row), tuple(acc), transformed)


def test_counts_keep_only_the_plain_records_of_the_class_and_draft() -> None:
    counts = CellCounts.empty(2)
    counts.add([_record(1, {3: 10}, {3: 7}), _record(1, {3: 5}, {3: 5}),
                _record(2, {0: 4}, {0: 1}),
                _record(1, {3: 99}, {3: 99}, cls="b"), _record(1, {3: 99}, {3: 0}, draft="x"),
                _record(1, {3: 99}, {3: 0}, transformed=True),
                _record(3, {3: 99}, {3: 0})],  # beyond the positions counted
               "a", "d")
    assert counts.tries[0, 3] == 15 and counts.accepts[0, 3] == 12
    assert counts.tries[1, 0] == 4 and counts.accepts[1, 0] == 1
    assert counts.tries.sum() == 19


def test_a_calibration_that_predicts_the_observed_rates_has_no_error() -> None:
    held = CellCounts.empty(2)
    held.add([_record(1, {1: 10, 6: 30}, {1: 2, 6: 27}), _record(2, {6: 20}, {6: 10})], "a", "d")
    exact = np.zeros((2, N_CONFIDENCE_BUCKETS))
    exact[0, 1], exact[0, 6], exact[1, 6] = 0.2, 0.9, 0.5
    rel = reliability(exact, held)
    assert rel.ece == pytest.approx(0.0)
    # Bucket 6 pools positions 1 and 2, each weighted by its tokens: (27 + 10) / 50.
    assert rel.tokens[6] == 50 and rel.observed[6] == pytest.approx(37 / 50)
    assert rel.predicted[6] == pytest.approx((30 * 0.9 + 20 * 0.5) / 50)
    assert np.isnan(rel.predicted[0]) and np.isnan(rel.observed[0])  # no tokens there
    raw = bucket_midpoints()
    expected_raw = (10 * abs(raw[1] - 0.2) + 30 * abs(raw[6] - 0.9) + 20 * abs(raw[6] - 0.5)) / 60
    assert rel.ece_raw_confidence == pytest.approx(expected_raw)


def test_the_error_is_the_token_weighted_gap() -> None:
    held = CellCounts.empty(1)
    held.add([_record(1, {2: 30, 7: 10}, {2: 15, 7: 10})], "a", "d")
    off = np.full((1, N_CONFIDENCE_BUCKETS), 0.7)  # 0.2 too high at bucket 2, 0.3 too low at 7
    assert reliability(off, held).ece == pytest.approx((30 * 0.2 + 10 * 0.3) / 40)


def test_nothing_to_compare_or_a_broken_prediction_is_refused() -> None:
    with pytest.raises(ValueError, match="no held-out tokens"):
        reliability(np.zeros((1, N_CONFIDENCE_BUCKETS)), CellCounts.empty(1))
    held = CellCounts.empty(1)
    held.add([_record(1, {2: 3}, {2: 1})], "a", "d")
    with pytest.raises(ValueError, match="finite"):
        reliability(np.full((1, N_CONFIDENCE_BUCKETS), np.nan), held)
    with pytest.raises(ValueError, match="finite"):
        reliability(np.zeros((2, N_CONFIDENCE_BUCKETS)), held)
