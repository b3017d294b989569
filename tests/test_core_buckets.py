"""Batch buckets: the batch size each bucket really runs at (what its decisions are priced at)."""

from __future__ import annotations

import pytest

from specpilot.contract.buckets import DEFAULT_BUCKET_BOUNDS, BucketLoads, bucket_of

BOUNDS = DEFAULT_BUCKET_BOUNDS  # 1, 2, 4, 8, 16, 32, 64, 128, then the open bucket


def test_a_bucket_runs_at_its_observed_mean_batch_size() -> None:
    loads = BucketLoads(BOUNDS, half_life_seconds=30.0)
    b = bucket_of(BOUNDS, 36)
    assert loads.batch_size(b) == 64  # never seen: its upper bound
    loads.observe(b, steps=100, sum_batch_size=3600, now=0.0)
    assert loads.batch_size(b) == 36
    assert loads.batch_size(b - 1) == 32  # other buckets are untouched
    assert loads.batch_size(len(BOUNDS)) == 256  # the open bucket: twice the last bound


def test_older_steps_fade_with_the_half_life() -> None:
    loads = BucketLoads(BOUNDS, half_life_seconds=30.0)
    b = bucket_of(BOUNDS, 36)
    loads.observe(b, steps=100, sum_batch_size=100 * 36, now=0.0)
    # One half-life later the old steps weigh 50, the new 100 at 60: (50*36 + 100*60) / 150.
    loads.observe(b, steps=100, sum_batch_size=100 * 60, now=30.0)
    assert loads.batch_size(b) == round((50 * 36 + 100 * 60) / 150)
    # The control: with no decay (a very long half-life) the plain mean, 48.
    flat = BucketLoads(BOUNDS, half_life_seconds=1e12)
    flat.observe(b, steps=100, sum_batch_size=100 * 36, now=0.0)
    flat.observe(b, steps=100, sum_batch_size=100 * 60, now=30.0)
    assert flat.batch_size(b) == 48


@pytest.mark.parametrize(("mean", "expected"), [(5.0, 33), (99.0, 64)])
def test_the_batch_size_stays_inside_its_bucket(mean: float, expected: int) -> None:
    """Sums from another bucket's bounds (an engine on older bounds) cannot price a bucket
    outside its range."""
    loads = BucketLoads(BOUNDS, half_life_seconds=30.0)
    b = bucket_of(BOUNDS, 36)
    loads.observe(b, steps=10, sum_batch_size=10 * mean, now=0.0)
    assert loads.batch_size(b) == expected


def test_empty_observations_change_nothing() -> None:
    loads = BucketLoads(BOUNDS, half_life_seconds=30.0)
    loads.observe(3, steps=0, sum_batch_size=0, now=0.0)
    assert loads.batch_size(3) == 8
