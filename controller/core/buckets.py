"""Batch-size buckets: inclusive upper bounds, strictly increasing, and one open bucket after the
last. One definition for the controller (settings, core) and the engine plugin, which uses these
defaults until the controller's HelloAck announces its bounds."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

# Default ``batch_bucket_upper_bounds`` (``CoreConfig`` in controller/core/controller.py).
DEFAULT_BUCKET_BOUNDS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)


def check_bucket_bounds(bounds: Iterable[int]) -> tuple[int, ...]:
    """The bounds as a tuple; ValueError unless they are positive, strictly increasing integers."""
    out = tuple(bounds)
    if not out:
        raise ValueError("batch bucket bounds: must not be empty")
    for i, b in enumerate(out):
        if type(b) is not int or b < 1:
            raise ValueError(f"batch bucket bounds[{i}]: expected an integer >= 1, got {b!r}")
        if i and b <= out[i - 1]:
            raise ValueError(f"batch bucket bounds[{i}]: {b} is not above {out[i - 1]} "
                             "(must be strictly increasing)")
    return out


def bucket_of(bounds: tuple[int, ...], batch_size: int) -> int:
    """Index of the first bucket whose upper bound is >= batch_size (len(bounds) if none)."""
    return bisect_left(bounds, batch_size)
