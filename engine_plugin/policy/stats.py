"""Per-interval aggregates of what the engine measured, for one report.

The scheduler records, per request and step, how many of the k verified drafts were accepted
(``record_verification``) and, where the drafter says how confident it was in each token, the
verified tokens by confidence bucket (``record_confidences``), per step the batch size, tokens
and wall time (``record_step``), and per finished request a summary (``record_finished``).
``drain`` returns the interval's aggregates as a plain frozen ``ReportPayload`` and starts a
new interval; ``ReportPayload.report`` turns a payload into the core's ``EngineReport`` record on
the sender thread, where the link makes the message of it, so no protobuf is built in the
scheduler loop.

The hot-path methods cost a dict lookup and a few integer additions. Input that the controller
would reject (k out of range, accepted > k, an unknown draft, an invalid class name, negative
counts, NaN times) is counted in ``ignored_records`` and left out, never raised: one bad record
must not cost the whole report (the controller rejects a report with any bad field).

Step sums are kept per exact batch size, also in the payload, and put into batch-size buckets
only when the report is built, under the bounds in force then (the controller's, which the
``PolicyView`` holds). A payload queued while the engine was disconnected may be sent to a
controller whose bucket bounds differ from the ones in force when it was recorded; bucketing at
send time keeps its steps in the right buckets (and a bucket index the controller does not have,
which would get the whole report rejected, cannot happen).

Threading: call every ``StatsAggregator`` method from one thread, the scheduler's. A
``ReportPayload`` is immutable and may be read from any thread.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from specpilot.contract.buckets import bucket_of
from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS, confidence_bucket

# The wire's records as plain dataclasses: the same ones the controller's core ingests.
from specpilot.contract.records import (
    AcceptanceRecord,
    ConfidenceRecord,
    EngineReport,
    RequestSummaryRecord,
    StepTimingRecord,
)
from specpilot.contract.validation import valid_class_name

_INF = math.inf
_MAX_UINT32 = 2**32 - 1


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
    sum_context_tokens: int | None = None  # None: some step's context was unknown
    sum_prefill_tokens: int = 0  # prompt tokens prefilled beside the decoding


@dataclass(frozen=True)
class ReportPayload:
    """One interval's aggregates, in a deterministic order."""

    acceptance: tuple[AcceptanceRecord, ...]
    step_sums: tuple[BatchStepSums, ...]
    finished: tuple[RequestSummaryRecord, ...]
    # Sequences running when the interval was drained.
    running_requests: int
    # Length of the interval, seconds.
    interval_seconds: float
    # Records left out because a value was invalid.
    ignored_records: int = 0
    # Finished summaries left out because the interval held more than ``max_finished``.
    dropped_records: int = 0
    confidence: tuple[ConfidenceRecord, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.acceptance or self.step_sums or self.finished or self.confidence)

    @property
    def record_count(self) -> int:
        """Records in this payload (histograms, step sums, finished summaries, confidence
        counts): what dropping it loses."""
        return (len(self.acceptance) + len(self.step_sums) + len(self.finished)
                + len(self.confidence))

    def step_timings(self, bucket_bounds: tuple[int, ...]) -> tuple[StepTimingRecord, ...]:
        """Step sums per (batch bucket, draft, K) under ``bucket_bounds``, ordered by bucket,
        draft, K."""
        merged: dict[tuple[int, str, int], list[float]] = {}
        for s in self.step_sums:
            m = merged.setdefault((bucket_of(bucket_bounds, s.batch_size), s.draft, s.k),
                                  [0, 0, 0, 0, 0.0, 0, 0, 0])
            m[0] += s.steps
            m[1] += s.steps * s.batch_size
            m[2] += s.sum_verified_tokens
            m[3] += s.sum_draft_tokens
            m[4] += s.sum_step_seconds
            m[5] += s.sum_context_tokens or 0
            m[6] += s.sum_context_tokens is None  # sums with a step of unknown context
            m[7] += s.sum_prefill_tokens
        # A bucket's context is known only if every one of its steps' was: a sum that left
        # some out would read as shorter contexts than ran. On the wire 0 says unknown.
        return tuple(
            StepTimingRecord(bucket, draft, k, int(m[0]), int(m[1]), int(m[2]), int(m[3]),
                             float(m[4]), 0 if m[6] else int(m[5]), int(m[7]))
            for (bucket, draft, k), m in sorted(merged.items())
        )

    def report(self, sequence: int, policy_version: int, records_dropped: int,
               bucket_bounds: tuple[int, ...]) -> EngineReport:
        """The report of this payload. ``records_dropped`` counts what the sender dropped since
        the previous report; the payload's own dropped finished summaries are added to it.
        Steps go into the buckets of ``bucket_bounds`` (the controller's)."""
        return EngineReport(
            sequence=sequence,
            interval_seconds=self.interval_seconds,
            policy_version=policy_version,
            acceptance=self.acceptance,
            finished=self.finished,
            step_timings=self.step_timings(bucket_bounds),
            records_dropped=records_dropped + self.dropped_records,
            # A uint32 on the wire.
            running_requests=min(max(self.running_requests, 0), _MAX_UINT32),
            confidence=self.confidence,
        )

    def histogram(self, traffic_class: str, draft: str, k: int,
                  counterfactual: bool = False) -> tuple[int, ...] | None:
        for h in self.acceptance:
            if (h.traffic_class, h.draft, h.k, h.counterfactual) == (
                    traffic_class, draft, k, counterfactual):
                return h.steps_by_accepted
        return None

    @classmethod
    def heartbeat(cls, running_requests: int) -> ReportPayload:
        """An empty payload: what an idle link sends to keep the stream (and the policy) alive."""
        return cls((), (), (), running_requests, 0.0)


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
        *,
        max_k: int = 32,
        drafts: Collection[str] | None = None,
        max_finished: int = 1024,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_k = max_k
        self.drafts = frozenset(drafts) if drafts is not None else None
        self.max_finished = max_finished
        self.max_keys = max_keys
        self._clock = clock
        self._valid_classes: set[str] = set()
        self._acc: dict[tuple[str, str, int, bool], list[int]] = {}
        # (class, draft, position, transformed) -> tried per bucket, then accepted per bucket
        self._conf: dict[tuple[str, str, int, bool], list[int]] = {}
        # (batch size, draft, k) -> [steps, sum verified tokens, sum draft tokens, sum seconds,
        # sum context tokens, steps of unknown context, sum prefill tokens]
        self._steps: dict[tuple[int, str, int], list[float]] = {}
        self._finished: list[RequestSummaryRecord] = []
        self._ignored = 0
        self._dropped = 0
        self._since = clock()

    # --- hot path ------------------------------------------------------------------------------
    def record_verification(self, traffic_class: str, draft: str, k: int, accepted: int,
                            counterfactual: bool = False, drafted: int | None = None) -> None:
        """One request in one step scored as K = ``k`` drafts, ``accepted`` of them accepted;
        ``drafted``: how many it verified (a deterministic drafter asked for ``k`` may propose
        fewer; None: not counted, taken as ``k``)."""
        try:
            hist = self._acc.get((traffic_class, draft, k, counterfactual))
            if hist is None:
                hist = self._new_histogram(traffic_class, draft, k, counterfactual)
                if hist is None:
                    self._ignored += 1
                    return
            if drafted is None:
                drafted = k
            else:
                hist[-1] += 1  # the key's steps were counted by drafts verified
            if 0 <= accepted <= drafted <= k:
                hist[accepted] += 1
                hist[k + 1 + drafted] += 1
            else:
                self._ignored += 1
        except Exception:
            self._ignored += 1

    def record_confidences(self, traffic_class: str, draft: str, confidences: Sequence[float],
                           accepted: int, transformed: bool = False) -> None:
        """One request in one step: the draft's confidence in each token it proposed (position
        1 first) and how many of them the target accepted. Positions up to the first rejected
        one were verified; the rest never were and are not counted (censored). ``transformed``:
        the request's sampling is transformed by the target (penalties, logit bias, structured
        output)."""
        try:
            if not 0 <= accepted <= len(confidences) or len(confidences) > self.max_k:
                self._ignored += 1
                return
            buckets = [confidence_bucket(q) for q in confidences[:accepted + 1]]
            for position, bucket in enumerate(buckets, start=1):
                key = (traffic_class, draft, position, bool(transformed))
                counts = self._conf.get(key)
                if counts is None:
                    counts = self._new_confidence(key)
                    if counts is None:
                        self._ignored += 1
                        return
                counts[bucket] += 1
                if position <= accepted:
                    counts[N_CONFIDENCE_BUCKETS + bucket] += 1
        except Exception:
            self._ignored += 1

    def record_step(self, batch_size: int, verified_tokens: int, draft_tokens: int, draft: str,
                    k: int, seconds: float, context_tokens: int | None = None,
                    prefill_tokens: int = 0) -> None:
        """One engine step: ``batch_size`` sequences, ``verified_tokens`` tokens verified by the
        target (one per sequence plus its drafts), ``draft_tokens`` proposed by the drafter, the
        largest K scheduled, the step's wall time including drafting, seconds, the tokens its
        sequences' KV caches held before it, summed (None: unknown), and the prompt tokens it
        prefilled beside its decoding."""
        try:
            sums = self._steps.get((batch_size, draft, k))
            if sums is None:
                sums = self._new_step(batch_size, draft, k)
                if sums is None:
                    self._ignored += 1
                    return
            if (verified_tokens >= batch_size and draft_tokens >= 0 and 0.0 <= seconds < _INF
                    and (context_tokens is None
                         or (type(context_tokens) is int and context_tokens >= 0))
                    and type(prefill_tokens) is int and prefill_tokens >= 0):
                sums[0] += 1
                sums[1] += verified_tokens
                sums[2] += draft_tokens
                sums[3] += seconds
                sums[4] += context_tokens or 0
                sums[5] += context_tokens is None
                sums[6] += prefill_tokens
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
    def drain(self, running_requests: int) -> ReportPayload:
        """The interval's aggregates; the counts start again from zero."""
        now = self._clock()
        acc, self._acc = self._acc, {}
        conf, self._conf = self._conf, {}
        steps, self._steps = self._steps, {}
        finished, self._finished = self._finished, []
        ignored, self._ignored = self._ignored, 0
        dropped, self._dropped = self._dropped, 0
        interval = max(0.0, now - self._since)
        self._since = now

        # Each histogram: steps by accepted drafts, by drafts verified, and how many of them
        # said how many they verified (none: the second is not reported).
        acceptance = tuple(
            AcceptanceRecord(cls, draft, k, tuple(hist[:k + 1]), cf,
                             tuple(hist[k + 1:-1]) if hist[-1] else ())
            for (cls, draft, k, cf), hist in sorted(acc.items()) if any(hist[:k + 1])
        )
        # With k = 0 no draft runs, whatever the caller named: merge those keys.
        merged: dict[tuple[int, str, int], list[float]] = {}
        for (batch, draft, k), (n, verified, drafted, seconds, context, unknown,
                                prefill) in steps.items():
            if n:
                m = merged.setdefault((batch, draft if k else "", k), [0, 0, 0, 0.0, 0, 0, 0])
                m[0] += n
                m[1] += verified
                m[2] += drafted
                m[3] += seconds
                m[4] += context
                m[5] += unknown
                m[6] += prefill
        sums = tuple(
            BatchStepSums(batch, draft, k, int(m[0]), int(m[1]), int(m[2]), float(m[3]),
                          None if m[5] else int(m[4]), int(m[6]))
            for (batch, draft, k), m in sorted(merged.items())
        )
        try:
            running = max(0, operator.index(running_requests))
        except TypeError:
            running = 0
        confidence = tuple(
            ConfidenceRecord(cls, draft, position, tuple(counts[:N_CONFIDENCE_BUCKETS]),
                             tuple(counts[N_CONFIDENCE_BUCKETS:]), transformed)
            for (cls, draft, position, transformed), counts in sorted(conf.items())
        )
        return ReportPayload(acceptance, sums, tuple(finished), running, interval, ignored,
                             dropped, confidence)

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
        hist = [0] * (2 * k + 3)  # by accepted (k+1), by drafted (k+1), steps counted so
        self._acc[(traffic_class, draft, k, bool(counterfactual))] = hist
        return hist

    def _new_confidence(self, key: tuple[str, str, int, bool]) -> list[int] | None:
        traffic_class, draft, _, _ = key
        if (not self._class_ok(traffic_class) or not self._draft_ok(draft, allow_empty=False)
                or len(self._conf) >= self.max_keys):
            return None
        counts = [0] * (2 * N_CONFIDENCE_BUCKETS)
        self._conf[key] = counts
        return counts

    def _new_step(self, batch_size: int, draft: str, k: int) -> list[float] | None:
        batch_size, k = operator.index(batch_size), operator.index(k)
        if (batch_size < 1 or not 0 <= k <= self.max_k
                or not self._draft_ok(draft, allow_empty=True)
                or len(self._steps) >= self.max_keys):
            return None
        # steps, verified, drafted, seconds, context, steps of unknown context, prefill
        sums: list[float] = [0, 0, 0, 0.0, 0, 0, 0]
        self._steps[(batch_size, draft, k)] = sums
        return sums
