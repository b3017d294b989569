"""Per-interval aggregates of what the engine measured, for one report.

The scheduler records, per request and step, how many of the k verified drafts were accepted
(``record_verification``), per step the batch size, tokens and wall time (``record_step``), and per
finished request a summary (``record_finished``). ``snapshot`` returns the interval's aggregates as
a plain frozen ``ReportPayload`` and starts a new interval; ``payload_to_report`` turns a payload
into the wire message on the sender thread, so no protobuf is built in the scheduler loop.

The hot-path methods cost a dict lookup and a few integer additions. Input that the controller
would reject (k out of range, accepted > k, an unknown draft, an invalid class name, negative
counts, NaN times) is counted in ``ignored_records`` and left out, never raised: one bad record
must not cost the whole report (the controller rejects a report with any bad field).

Step sums are kept per exact batch size, also in the payload, and put into batch-size buckets
only when the report is built (``ReportPayload.step_timings(bounds)``, ``payload_to_report``). A
payload queued while the engine was disconnected may be sent to a controller whose bucket bounds
differ from the ones in force when it was recorded; bucketing at send time keeps its steps in the
right buckets (and a bucket index the controller does not have, which would get the whole report
rejected, cannot happen).

Threading: call every method except ``set_bucket_bounds`` from one thread, the scheduler's;
``set_bucket_bounds`` may come from the sender thread (it swaps an immutable tuple).
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from controller.core.buckets import DEFAULT_BUCKET_BOUNDS, bucket_of, check_bucket_bounds

# The wire's records as plain dataclasses: the same ones the controller's core ingests.
from controller.core.types import RequestSummaryRecord, StepTimingRecord
from controller.core.validation import valid_class_name
from specpilot.v1 import engine_pb2

log = logging.getLogger(__name__)

_INF = math.inf


@dataclass(frozen=True)
class AcceptanceHistogram:
    """Verification steps of one (class, draft, K, counterfactual) by number of accepted drafts:
    ``steps_by_accepted[a]`` for a = 0..k."""

    traffic_class: str
    draft: str
    k: int
    counterfactual: bool
    steps_by_accepted: tuple[int, ...]


@dataclass(frozen=True)
class BatchStepSums:
    """Steps of one (exact batch size, draft, K) as sums. ``draft`` is empty when k == 0."""

    batch_size: int
    draft: str
    k: int
    steps: int
    sum_verified_tokens: int
    sum_draft_tokens: int
    sum_step_seconds: float


@dataclass(frozen=True)
class ReportPayload:
    """One interval's aggregates, in a deterministic order."""

    acceptance: tuple[AcceptanceHistogram, ...]
    step_sums: tuple[BatchStepSums, ...]
    finished: tuple[RequestSummaryRecord, ...]
    # Sequences running when the snapshot was taken.
    running_requests: int
    # Length of the interval, seconds.
    interval_seconds: float
    # Records left out because a value was invalid.
    ignored_records: int = 0
    # Finished summaries left out because the interval held more than ``max_finished``.
    dropped_records: int = 0
    # The aggregator's bucket bounds at snapshot time (the default for ``step_timings``).
    bucket_bounds: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS

    @property
    def is_empty(self) -> bool:
        return not (self.acceptance or self.step_sums or self.finished)

    @property
    def record_count(self) -> int:
        """Records in this payload (histograms, step sums, finished summaries): what dropping
        it loses."""
        return len(self.acceptance) + len(self.step_sums) + len(self.finished)

    def step_timings(
        self, bucket_bounds: Iterable[int] | None = None
    ) -> tuple[StepTimingRecord, ...]:
        """Step sums per (batch bucket, draft, K) under ``bucket_bounds`` (default: the
        payload's own), ordered by bucket, draft, K."""
        bounds = self.bucket_bounds if bucket_bounds is None else tuple(bucket_bounds)
        merged: dict[tuple[int, str, int], list[float]] = {}
        for s in self.step_sums:
            m = merged.setdefault((bucket_of(bounds, s.batch_size), s.draft, s.k),
                                  [0, 0, 0, 0, 0.0])
            m[0] += s.steps
            m[1] += s.steps * s.batch_size
            m[2] += s.sum_verified_tokens
            m[3] += s.sum_draft_tokens
            m[4] += s.sum_step_seconds
        return tuple(
            StepTimingRecord(bucket, draft, k, int(m[0]), int(m[1]), int(m[2]), int(m[3]),
                             float(m[4]))
            for (bucket, draft, k), m in sorted(merged.items())
        )

    def histogram(self, traffic_class: str, draft: str, k: int,
                  counterfactual: bool = False) -> tuple[int, ...] | None:
        for h in self.acceptance:
            if (h.traffic_class, h.draft, h.k, h.counterfactual) == (
                    traffic_class, draft, k, counterfactual):
                return h.steps_by_accepted
        return None


class StatsAggregator:
    """Counts for the current report interval.

    ``max_k``: largest K recorded (the engine's num_speculative_tokens); larger values are ignored.
    ``drafts``: draft names the engine announced; records naming another are ignored (None: any
    non-empty name). ``max_finished``: finished summaries kept per interval; more are dropped and
    counted. ``max_keys``: distinct keys per table per interval, a bound on memory whatever the
    input.
    """

    def __init__(
        self,
        bucket_bounds: Iterable[int] = DEFAULT_BUCKET_BOUNDS,
        *,
        max_k: int = 32,
        drafts: Collection[str] | None = None,
        max_finished: int = 1024,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bounds = check_bucket_bounds(bucket_bounds)
        self.max_k = max_k
        self.drafts = frozenset(drafts) if drafts is not None else None
        self.max_finished = max_finished
        self.max_keys = max_keys
        self._clock = clock
        self._valid_classes: set[str] = set()
        self._acc: dict[tuple[str, str, int, bool], list[int]] = {}
        # (batch size, draft, k) -> [steps, sum verified tokens, sum draft tokens, sum seconds]
        self._steps: dict[tuple[int, str, int], list[float]] = {}
        self._finished: list[RequestSummaryRecord] = []
        self._ignored = 0
        self._dropped = 0
        self._since = clock()

    # --- configuration ---------------------------------------------------------------------
    @property
    def bucket_bounds(self) -> tuple[int, ...]:
        return self._bounds

    def set_bucket_bounds(self, bounds: Iterable[int]) -> None:
        """New bucket bounds for this and later snapshots; ValueError (and no change) if bad."""
        self._bounds = check_bucket_bounds(bounds)

    # --- hot path ------------------------------------------------------------------------------
    def record_verification(self, traffic_class: str, draft: str, k: int, accepted: int,
                            counterfactual: bool = False) -> None:
        """One request in one step: k drafts verified, ``accepted`` of them accepted."""
        try:
            hist = self._acc.get((traffic_class, draft, k, counterfactual))
            if hist is None:
                hist = self._new_histogram(traffic_class, draft, k, counterfactual)
                if hist is None:
                    self._ignored += 1
                    return
            if 0 <= accepted <= k:
                hist[accepted] += 1
            else:
                self._ignored += 1
        except Exception:
            self._ignored += 1

    def record_step(self, batch_size: int, verified_tokens: int, draft_tokens: int, draft: str,
                    k: int, seconds: float) -> None:
        """One engine step: ``batch_size`` sequences, ``verified_tokens`` tokens verified by the
        target (one per sequence plus its drafts), ``draft_tokens`` proposed by the drafter, the
        largest K scheduled, and the step's wall time including drafting, seconds."""
        try:
            sums = self._steps.get((batch_size, draft, k))
            if sums is None:
                sums = self._new_step(batch_size, draft, k)
                if sums is None:
                    self._ignored += 1
                    return
            if verified_tokens >= batch_size and draft_tokens >= 0 and 0.0 <= seconds < _INF:
                sums[0] += 1
                sums[1] += verified_tokens
                sums[2] += draft_tokens
                sums[3] += seconds
            else:
                self._ignored += 1
        except Exception:
            self._ignored += 1

    def record_finished(self, traffic_class: str, draft: str, prompt_tokens: int,
                        output_tokens: int, drafted_tokens: int, accepted_tokens: int,
                        latency_seconds: float) -> None:
        """One finished request. ``draft`` may be empty (served without speculation)."""
        try:
            counts = (prompt_tokens, output_tokens, drafted_tokens, accepted_tokens)
            if (not self._class_ok(traffic_class) or not self._draft_ok(draft, allow_empty=True)
                    or any(type(n) is not int or n < 0 for n in counts)
                    or accepted_tokens > drafted_tokens
                    or not 0.0 <= latency_seconds < _INF):
                self._ignored += 1
                return
            if len(self._finished) >= self.max_finished:
                self._dropped += 1
                return
            self._finished.append(RequestSummaryRecord(
                traffic_class, draft, prompt_tokens, output_tokens, drafted_tokens,
                accepted_tokens, float(latency_seconds)))
        except Exception:
            self._ignored += 1

    # --- interval --------------------------------------------------------------------------
    def snapshot(self, running_requests: int) -> ReportPayload:
        """The interval's aggregates; the counts start again from zero."""
        now = self._clock()
        acc, self._acc = self._acc, {}
        steps, self._steps = self._steps, {}
        finished, self._finished = self._finished, []
        ignored, self._ignored = self._ignored, 0
        dropped, self._dropped = self._dropped, 0
        interval = max(0.0, now - self._since)
        self._since = now

        acceptance = tuple(
            AcceptanceHistogram(cls, draft, k, cf, tuple(hist))
            for (cls, draft, k, cf), hist in sorted(acc.items()) if any(hist)
        )
        # With k = 0 no draft runs, whatever the caller named: merge those keys.
        merged: dict[tuple[int, str, int], list[float]] = {}
        for (batch, draft, k), (n, verified, drafted, seconds) in steps.items():
            if n:
                m = merged.setdefault((batch, draft if k else "", k), [0, 0, 0, 0.0])
                m[0] += n
                m[1] += verified
                m[2] += drafted
                m[3] += seconds
        sums = tuple(
            BatchStepSums(batch, draft, k, int(m[0]), int(m[1]), int(m[2]), float(m[3]))
            for (batch, draft, k), m in sorted(merged.items())
        )
        try:
            running = max(0, operator.index(running_requests))
        except TypeError:
            running = 0
        return ReportPayload(acceptance, sums, tuple(finished), running, interval, ignored,
                             dropped, self._bounds)

    # --- first sight of a key (validation happens here, once per key and interval) -----------
    def _class_ok(self, name: str) -> bool:
        if name in self._valid_classes:
            return True
        if not valid_class_name(name) or len(self._valid_classes) >= self.max_keys:
            return False
        self._valid_classes.add(name)
        return True

    def _draft_ok(self, draft: str, allow_empty: bool) -> bool:
        if not isinstance(draft, str):
            return False
        if not draft:
            return allow_empty
        return self.drafts is None or draft in self.drafts

    def _new_histogram(self, traffic_class: str, draft: str, k: int,
                       counterfactual: bool) -> list[int] | None:
        k = operator.index(k)
        if (not 1 <= k <= self.max_k or not self._class_ok(traffic_class)
                or not self._draft_ok(draft, allow_empty=False)
                or len(self._acc) >= self.max_keys):
            return None
        hist = [0] * (k + 1)
        self._acc[(traffic_class, draft, k, bool(counterfactual))] = hist
        return hist

    def _new_step(self, batch_size: int, draft: str, k: int) -> list[float] | None:
        batch_size, k = operator.index(batch_size), operator.index(k)
        if (batch_size < 1 or not 0 <= k <= self.max_k
                or not self._draft_ok(draft, allow_empty=True)
                or len(self._steps) >= self.max_keys):
            return None
        sums: list[float] = [0, 0, 0, 0.0]
        self._steps[(batch_size, draft, k)] = sums
        return sums


def payload_to_report(payload: ReportPayload, sequence: int, policy_version: int,
                      records_dropped: int,
                      bucket_bounds: Iterable[int] | None = None) -> engine_pb2.EngineReport:
    """The wire message for one payload. ``records_dropped`` counts what the sender dropped since
    the previous report; the payload's own dropped finished summaries are added to it. Steps go
    into the buckets of ``bucket_bounds`` (the controller's; default: the payload's own)."""
    return engine_pb2.EngineReport(
        sequence=sequence,
        interval_seconds=payload.interval_seconds,
        policy_version=policy_version,
        acceptance=[
            engine_pb2.AcceptanceCounts(
                traffic_class=h.traffic_class, draft=h.draft, k=h.k,
                steps_by_accepted=h.steps_by_accepted, counterfactual=h.counterfactual)
            for h in payload.acceptance
        ],
        finished=[
            engine_pb2.RequestSummary(
                traffic_class=f.traffic_class, draft=f.draft, prompt_tokens=f.prompt_tokens,
                output_tokens=f.output_tokens, drafted_tokens=f.drafted_tokens,
                accepted_tokens=f.accepted_tokens, latency_seconds=f.latency_seconds)
            for f in payload.finished
        ],
        step_timings=[
            engine_pb2.StepTiming(
                batch_bucket=s.batch_bucket, draft=s.draft, k=s.k, steps=s.steps,
                sum_batch_size=s.sum_batch_size, sum_verified_tokens=s.sum_verified_tokens,
                sum_draft_tokens=s.sum_draft_tokens, sum_step_seconds=s.sum_step_seconds)
            for s in payload.step_timings(bucket_bounds)
        ],
        records_dropped=records_dropped + payload.dropped_records,
        running_requests=min(payload.running_requests, 2**32 - 1),
    )
