"""Batch-size buckets: inclusive upper bounds, strictly increasing, and one open bucket after the
last. One definition for the controller (settings, core) and the engine plugin, which uses these
defaults until the controller's HelloAck announces its bounds."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

# Default ``batch_bucket_upper_bounds`` (``CoreConfig`` in controller/core/config.py).
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


def bucket_lower_size(bounds: tuple[int, ...], bucket: int) -> int:
    """The smallest batch size of a bucket."""
    return bounds[bucket - 1] + 1 if bucket > 0 else 1


def bucket_upper_size(bounds: tuple[int, ...], bucket: int) -> int:
    """The largest batch size of a bucket: its upper bound (twice the last bound for the open
    bucket)."""
    return bounds[bucket] if bucket < len(bounds) else 2 * bounds[-1]


def batch_range(bounds: tuple[int, ...], bucket: int) -> str:
    """A bucket as people read and type it, its batch sizes: "1", "3-4", "129+" (the open one).
    The one name of a batch range in the CLI, the metrics, the dashboard and the logs."""
    lower = bucket_lower_size(bounds, bucket)
    if bucket >= len(bounds):
        return f"{lower}+"
    upper = bounds[bucket]
    return str(upper) if upper == lower else f"{lower}-{upper}"


def parse_batch(bounds: tuple[int, ...], text: str) -> int:
    """The bucket of a batch size ("24") or of a batch range as ``batch_range`` names it
    ("17-32", "129+"); ValueError naming the ranges otherwise."""
    ranges = [batch_range(bounds, b) for b in range(len(bounds) + 1)]
    value = text.strip()
    if value in ranges:
        return ranges.index(value)
    if value.isdigit() and int(value) >= 1:
        return bucket_of(bounds, int(value))
    raise ValueError(f"batch {text!r}: give a batch size (e.g. 24) or one of the batch ranges "
                     f"{', '.join(ranges)}")


class BucketLoads:
    """The batch size each bucket really runs at: decayed, steps-weighted means of the decode
    steps the engines timed in it.

    Why: a bucket spans a range (33-64 sequences by default), and where speculation stops paying
    moves inside it. Pricing every bucket at its upper bound made a load of 36 run as if it were
    64, where K=1 no longer pays: specpilot switched speculation off there and finished at 0.94
    of static K=1. A bucket never seen keeps the upper bound (the cautious end: larger batches
    speculate less).

    And the context they run at: the decayed mean KV length per sequence of the timed steps
    that carried one (``context_per_sequence``; 0 where none did), so a bucket's arms are priced
    at the contexts its steps read.
    """

    def __init__(self, bounds: tuple[int, ...], half_life_seconds: float) -> None:
        self._bounds = bounds
        self._half_life = half_life_seconds
        self._steps: dict[int, float] = {}
        self._batch_sum: dict[int, float] = {}
        # Sequence-steps that carried their context, and that context's sum (decayed alike).
        self._context_batch: dict[int, float] = {}
        self._context_sum: dict[int, float] = {}
        self._at: dict[int, float] = {}

    def observe(self, bucket: int, steps: float, sum_batch_size: float, now: float,
                sum_context_tokens: float = 0.0) -> None:
        """``steps`` decode steps in ``bucket`` whose batch sizes sum to ``sum_batch_size`` and
        whose sequences' contexts sum to ``sum_context_tokens`` (0: unknown, left out of the
        mean context)."""
        if steps <= 0:
            return
        at = self._at.get(bucket)
        f = 1.0 if at is None or now <= at else float(2.0 ** (-(now - at) / self._half_life))
        self._steps[bucket] = self._steps.get(bucket, 0.0) * f + steps
        self._batch_sum[bucket] = self._batch_sum.get(bucket, 0.0) * f + sum_batch_size
        known = sum_batch_size if sum_context_tokens > 0 else 0.0
        self._context_batch[bucket] = self._context_batch.get(bucket, 0.0) * f + known
        self._context_sum[bucket] = (self._context_sum.get(bucket, 0.0) * f
                                     + max(sum_context_tokens, 0.0))
        self._at[bucket] = now if at is None else max(at, now)

    def context_per_sequence(self, bucket: int) -> float:
        """The bucket's mean context per sequence, tokens (0: no step carried one)."""
        known = self._context_batch.get(bucket, 0.0)
        return self._context_sum[bucket] / known if known > 0 else 0.0

    def context_at(self, batch_size: float) -> float:
        """``context_per_sequence`` of the bucket of ``batch_size``."""
        return self.context_per_sequence(bucket_of(self._bounds, max(1, round(batch_size))))

    def steps(self, bucket: int) -> float:
        """The decode steps timed in ``bucket``, decayed (0: none yet)."""
        return self._steps.get(bucket, 0.0)

    def measured(self) -> tuple[int, ...]:
        """The buckets in which a decode step was timed, ascending."""
        return tuple(sorted(b for b, steps in self._steps.items() if steps > 0))

    def batch_size(self, bucket: int) -> int:
        """The bucket's mean observed batch size, rounded and kept inside the bucket; its upper
        bound before any step was seen there."""
        steps = self._steps.get(bucket, 0.0)
        if steps <= 0:
            return bucket_upper_size(self._bounds, bucket)
        lower = bucket_lower_size(self._bounds, bucket)
        upper = self._bounds[bucket] if bucket < len(self._bounds) else None
        size = max(round(self._batch_sum[bucket] / steps), lower)
        return size if upper is None else min(size, upper)
