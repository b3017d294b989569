"""Checks on engine input before anything of it is applied. Every failure names the field."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
from specpilot.contract.records import (
    AcceptanceRecord,
    BeyondRate,
    ConfidenceRecord,
    DraftSpec,
    EngineHello,
    EngineReport,
    ImplausibleInput,
    ReportRejected,
    StepProfile,
)

MAX_CLASS_NAME_LENGTH = 64
CLASS_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")
# A single report covering more steps than this is a plugin bug, not traffic.
MAX_STEPS_PER_RECORD = 10**12
# A start-up profile is a few dozen timed shapes; more is a plugin bug.
MAX_PROFILE_POINTS = 256
# A profiled step slower than this is not a decode step.
MAX_PROFILE_SECONDS = 60.0
# A hardware name is a device, its count and a dtype; it becomes part of a stored record.
MAX_HARDWARE_CHARS = 200
# --- physical plausibility (ImplausibleInput): what an engine can do, with room to spare -------
# An engine offers its model drafter and a few deterministic ones; more is not an engine.
MAX_DRAFTS = 16
# Draft tokens per step: vLLM's proposers are practical to about 10; 64 leaves room.
MAX_K = 64
# Sequences in one step (vLLM's max_num_seqs): 65,536 is far above any GPU's.
MAX_BATCH_SIZE = 65_536
# Mean wall time of one decode step, seconds: (1 us, 60 s]; a profile point has the same bound.
MIN_STEP_SECONDS = 1e-6
MAX_STEP_SECONDS = MAX_PROFILE_SECONDS
# Sequence numbers advance by at most this much per report (an engine's reports never skip
# millions; a jump to 2^64-1 would refuse every later one).
MAX_SEQUENCE_STEP = 1_000_000
# Tokens one sequence's KV cache holds: 2^24 (16.8M) is above any model's context window.
MAX_CONTEXT_TOKENS = 1 << 24
# What one report may count beyond what its engine can run in the interval it covers: its max
# batch at its fastest profiled step rate, times this. (The fastest profiled step is a small
# batch's, so a full batch at that rate is already far above what an engine runs.)
RATE_HEADROOM = 4.0
# Identifiers and versions: short strings (they are echoed into logs, metrics and the store).
MAX_ID_CHARS = 256


def valid_class_name(name: object) -> bool:
    """Whether ``name`` is a class name the controller accepts (the engine plugin uses it too).
    In full: ``$`` also matches before a final newline, and "chat\\n" was taken as a class."""
    return (isinstance(name, str) and len(name) <= MAX_CLASS_NAME_LENGTH
            and CLASS_NAME_PATTERN.fullmatch(name) is not None)


def check_class_name(name: str, where: str) -> None:
    if not valid_class_name(name):
        raise ReportRejected(
            f"{where}: class name {name[:80]!r} must match {CLASS_NAME_PATTERN.pattern} and be "
            f"at most {MAX_CLASS_NAME_LENGTH} characters"
        )


def _finite_non_negative(value: float, where: str) -> None:
    if not math.isfinite(value) or value < 0:
        raise ReportRejected(f"{where}: must be a finite number >= 0, got {value!r}")


def _non_negative(value: int, where: str) -> None:
    if value < 0:
        raise ReportRejected(f"{where}: must be >= 0, got {value}")
    if value > MAX_STEPS_PER_RECORD:
        raise ReportRejected(f"{where}: {value} exceeds {MAX_STEPS_PER_RECORD}")


def _counts(values: tuple[int, ...], where: str, names: tuple[str, ...] | None = None) -> None:
    """Every value in 0..MAX_STEPS_PER_RECORD; the message names the first that is not, as
    ``where[i]`` or ``where.<name>``. (Checked in bulk first: a report holds hundreds of
    counts, and formatting a field name for each good one was a third of ingesting it.)"""
    if values and (min(values) < 0 or max(values) > MAX_STEPS_PER_RECORD):
        for i, v in enumerate(values):
            _non_negative(v, f"{where}[{i}]" if names is None else f"{where}.{names[i]}")


def _check_drafted(rec: AcceptanceRecord, where: str) -> None:
    """The same steps by drafts verified: K+1 counts, as many steps, and never fewer drafts
    than accepted ones (at each position, the steps that verified it at least as many as
    those that accepted it)."""
    drafted, accepted = rec.steps_by_drafted, rec.steps_by_accepted
    if len(drafted) != rec.k + 1:
        raise ReportRejected(f"{where}.steps_by_drafted: {len(drafted)} entries, expected "
                             f"k+1 = {rec.k + 1} (or none)")
    _counts(drafted, f"{where}.steps_by_drafted")
    if sum(drafted) != sum(accepted):
        raise ReportRejected(f"{where}.steps_by_drafted: {sum(drafted)} steps, but "
                             f"steps_by_accepted has {sum(accepted)}")
    verified = accepted_here = 0
    for i in range(rec.k, 0, -1):
        verified += drafted[i]
        accepted_here += accepted[i]
        if accepted_here > verified:
            raise ReportRejected(f"{where}: {accepted_here} steps accepted {i} or more drafts "
                                 f"but only {verified} verified that many")


def _max_k_of(traffic_class: str, draft: str, where: str, drafts: dict[str, DraftSpec],
              engine_max_k: int) -> int:
    """Check a record's class name and draft; the largest K the record may name."""
    if not valid_class_name(traffic_class):
        check_class_name(traffic_class, f"{where}.traffic_class")
    spec = drafts.get(draft)
    if spec is None:
        raise ReportRejected(f"{where}.draft: unknown draft {draft!r}")
    return min(engine_max_k, spec.max_k)


def _check_confidence(rec: ConfidenceRecord, where: str, drafts: dict[str, DraftSpec],
                      engine_max_k: int) -> None:
    limit = _max_k_of(rec.traffic_class, rec.draft, where, drafts, engine_max_k)
    if not 1 <= rec.position <= limit:
        raise ReportRejected(f"{where}.position: {rec.position} outside 1..{limit} for draft "
                             f"{rec.draft!r}")
    for name in ("tried_by_bucket", "accepted_by_bucket"):
        counts = getattr(rec, name)
        if len(counts) != N_CONFIDENCE_BUCKETS:
            raise ReportRejected(f"{where}.{name}: {len(counts)} entries, expected one per "
                                 f"confidence bucket ({N_CONFIDENCE_BUCKETS})")
        _counts(counts, f"{where}.{name}")
    for b, (tried, accepted) in enumerate(zip(rec.tried_by_bucket, rec.accepted_by_bucket,
                                              strict=True)):
        if accepted > tried:
            raise ReportRejected(f"{where}.accepted_by_bucket[{b}]: {accepted} accepted of "
                                 f"{tried} tried")


def check_hello(hello: EngineHello) -> None:
    if not hello.engine_id:
        raise ReportRejected("hello.engine_id: must not be empty")
    for name in ("engine_id", "model", "target_vocab_hash", "engine_version", "plugin_version"):
        if len(getattr(hello, name)) > MAX_ID_CHARS:
            raise ReportRejected(f"hello.{name}: longer than {MAX_ID_CHARS} characters")
    if hello.max_k < 0:
        raise ReportRejected(f"hello.max_k: must be >= 0, got {hello.max_k}")
    if hello.max_k > MAX_K:
        raise ImplausibleInput(f"hello.max_k: {hello.max_k} above the most draft tokens per "
                               f"step specpilot accepts, {MAX_K}")
    if not 0 <= hello.max_batch_size <= MAX_BATCH_SIZE:
        raise ImplausibleInput(f"hello.max_batch_size: {hello.max_batch_size} outside "
                               f"0..{MAX_BATCH_SIZE}")
    if len(hello.drafts) > MAX_DRAFTS:
        raise ImplausibleInput(f"hello.drafts: {len(hello.drafts)} drafts, at most "
                               f"{MAX_DRAFTS} (an engine runs one drafter and a few "
                               "deterministic ones)")
    names = [d.name for d in hello.drafts]
    if len(set(names)) != len(names):
        raise ReportRejected(f"hello.drafts: duplicate names in {names}")
    for i, d in enumerate(hello.drafts):
        if not d.name:
            raise ReportRejected(f"hello.drafts[{i}].name: must not be empty")
        if d.max_k < 1:
            raise ReportRejected(f"hello.drafts[{i}].max_k: must be >= 1, got {d.max_k}")
        if d.max_k > MAX_K or len(d.name) > MAX_ID_CHARS or len(d.vocab_hash) > MAX_ID_CHARS:
            raise ImplausibleInput(f"hello.drafts[{i}]: max_k at most {MAX_K}, name and "
                                   f"vocab_hash at most {MAX_ID_CHARS} characters")
    if len(hello.hardware) > MAX_HARDWARE_CHARS or not hello.hardware.isprintable():
        raise ReportRejected(f"hello.hardware: must be printable and at most "
                             f"{MAX_HARDWARE_CHARS} characters, got {hello.hardware[:40]!r}")
    if len(hello.step_profile) > MAX_PROFILE_POINTS:
        raise ReportRejected(f"hello.step_profile: {len(hello.step_profile)} points exceed "
                             f"{MAX_PROFILE_POINTS}")
    for i, p in enumerate(hello.step_profile):
        where = f"hello.step_profile[{i}]"
        if p.batch_size < 1 or p.verified_tokens < p.batch_size:
            raise ReportRejected(f"{where}: needs batch_size >= 1 and verified_tokens >= "
                                 f"batch_size, got {p.batch_size} and {p.verified_tokens}")
        if p.draft_passes < 0 or (p.draft_passes > 0) != bool(p.draft):
            raise ReportRejected(f"{where}: draft_passes {p.draft_passes} with draft "
                                 f"{p.draft!r} (passes need a draft and a draft needs passes)")
        if not (math.isfinite(p.seconds) and 0 < p.seconds <= MAX_PROFILE_SECONDS):
            raise ReportRejected(f"{where}.seconds: must be in (0, {MAX_PROFILE_SECONDS}], got "
                                 f"{p.seconds!r}")
        # A shape the engine can run, as the timing groups of reports: 2^32-1 verified tokens
        # made the cost model's precision matrix singular, and every decide round failed after.
        batch_limit = hello.max_batch_size or MAX_BATCH_SIZE
        if (p.batch_size > batch_limit or p.draft_passes > hello.max_k
                or p.verified_tokens > p.batch_size * (1 + hello.max_k)):
            raise ImplausibleInput(
                f"{where}: batch_size {p.batch_size}, verified_tokens {p.verified_tokens}, "
                f"draft_passes {p.draft_passes}: at most the engine's max batch size "
                f"{batch_limit}, batch_size x (1 + max K {hello.max_k}) and max K")
        _token_sum(p.context_tokens, 1, f"{where}.context_tokens")
        _token_sum(p.prefill_tokens, 1, f"{where}.prefill_tokens", "steps")


def _token_sum(value: object, sequences: int, where: str,
                    units: str = "sequence-steps") -> None:
    """A sum of tokens over ``sequences`` ``units``: a whole number, at most
    ``MAX_CONTEXT_TOKENS`` each (a context window's; 0 = unknown for a context)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ReportRejected(f"{where}: must be a finite count of tokens, got {value!r}")
    if not (isinstance(value, int | float) and value == int(value) and value >= 0):
        raise ReportRejected(f"{where}: must be a whole number of tokens >= 0, got {value!r}")
    if value > sequences * MAX_CONTEXT_TOKENS:
        raise ImplausibleInput(f"{where}: {int(value)} tokens over {sequences} {units}, "
                               f"above {MAX_CONTEXT_TOKENS} each")


_SUMMARY_COUNTS = ("prompt_tokens", "output_tokens", "drafted_tokens", "accepted_tokens")
_TIMING_COUNTS = ("steps", "sum_batch_size", "sum_verified_tokens", "sum_draft_tokens")


def check_report(
    report: EngineReport,
    drafts: dict[str, DraftSpec],
    engine_max_k: int,
    n_buckets: int,
    last_sequence: int | None,
    max_batch_size: int = 0,
    fastest_step_seconds: float = MIN_STEP_SECONDS,
) -> None:
    """Raise ReportRejected naming the first bad field (ImplausibleInput where the report is
    well-formed but beyond what the engine can do, BeyondRate where it counts more than the
    engine can run in its interval); return normally if all is well.
    ``max_batch_size``: the engine's announced max_num_seqs (0: unknown, MAX_BATCH_SIZE).
    ``fastest_step_seconds``: its fastest profiled decode step (``fastest_decode_seconds``)."""
    batch_limit = max_batch_size or MAX_BATCH_SIZE
    if report.sequence < 1:
        raise ReportRejected(f"sequence: must be >= 1, got {report.sequence}")
    if last_sequence is not None and report.sequence <= last_sequence:
        raise ReportRejected(
            f"sequence: {report.sequence} is not after the last applied {last_sequence} "
            "(duplicate or reordered report)"
        )
    since = report.sequence - (last_sequence or 0)
    if since > MAX_SEQUENCE_STEP:
        raise ImplausibleInput(f"sequence: {report.sequence} jumps {since} past the last "
                               f"applied {last_sequence or 0} (at most {MAX_SEQUENCE_STEP})")
    # An idle link's heartbeat (no records) covers no interval; a report with data covers one
    # (of any length: an engine idle for hours reports its first step after them).
    carries = bool(report.acceptance or report.finished or report.step_timings
                   or report.confidence)
    if not (math.isfinite(report.interval_seconds)
            and (report.interval_seconds > 0 if carries else report.interval_seconds >= 0)):
        raise ImplausibleInput(f"interval_seconds: must be finite and "
                               f"{'> 0 for a report with' if carries else '>= 0 for one without'}"
                               f" records, got {report.interval_seconds!r}")
    if not 0 <= report.running_requests <= batch_limit:
        raise ImplausibleInput(f"running_requests: {report.running_requests} outside "
                               f"0..{batch_limit} (the engine's max batch size)")
    if not 0 <= report.records_dropped <= MAX_STEPS_PER_RECORD:
        raise ImplausibleInput(f"records_dropped: {report.records_dropped} outside "
                               f"0..{MAX_STEPS_PER_RECORD}")
    for i, rec in enumerate(report.acceptance):
        where = f"acceptance[{i}]"
        limit = _max_k_of(rec.traffic_class, rec.draft, where, drafts, engine_max_k)
        if not 1 <= rec.k <= limit:
            raise ReportRejected(f"{where}.k: {rec.k} outside 1..{limit} for draft {rec.draft!r}")
        if len(rec.steps_by_accepted) != rec.k + 1:
            raise ReportRejected(
                f"{where}.steps_by_accepted: {len(rec.steps_by_accepted)} entries, "
                f"expected k+1 = {rec.k + 1}"
            )
        _counts(rec.steps_by_accepted, f"{where}.steps_by_accepted")
        if rec.steps_by_drafted:
            _check_drafted(rec, where)
    for i, conf in enumerate(report.confidence):
        _check_confidence(conf, f"confidence[{i}]", drafts, engine_max_k)
    for i, req in enumerate(report.finished):
        if not valid_class_name(req.traffic_class):
            check_class_name(req.traffic_class, f"finished[{i}].traffic_class")
        if req.draft and req.draft not in drafts:
            raise ReportRejected(f"finished[{i}].draft: unknown draft {req.draft!r}")
        _counts((req.prompt_tokens, req.output_tokens, req.drafted_tokens, req.accepted_tokens),
                f"finished[{i}]", _SUMMARY_COUNTS)
        if req.accepted_tokens > req.drafted_tokens:
            raise ReportRejected(
                f"finished[{i}].accepted_tokens: {req.accepted_tokens} > drafted_tokens "
                f"{req.drafted_tokens}"
            )
        if not (math.isfinite(req.latency_seconds) and req.latency_seconds >= 0):
            _finite_non_negative(req.latency_seconds, f"finished[{i}].latency_seconds")
    for i, st in enumerate(report.step_timings):
        where = f"step_timings[{i}]"
        if st.batch_bucket >= n_buckets:
            raise ReportRejected(f"{where}.batch_bucket: {st.batch_bucket} >= {n_buckets}")
        if st.draft and st.draft not in drafts:
            raise ReportRejected(f"{where}.draft: unknown draft {st.draft!r}")
        if st.k > engine_max_k:
            raise ReportRejected(f"{where}.k: {st.k} above the engine's max K {engine_max_k}")
        _counts((st.steps, st.sum_batch_size, st.sum_verified_tokens, st.sum_draft_tokens),
                where, _TIMING_COUNTS)
        _finite_non_negative(st.sum_step_seconds, f"{where}.sum_step_seconds")
        if st.sum_verified_tokens < st.sum_batch_size:
            raise ReportRejected(
                f"{where}.sum_verified_tokens: {st.sum_verified_tokens} < sum_batch_size "
                f"{st.sum_batch_size} (every sequence verifies at least one token)"
            )
        _plausible_timing(st.steps, st.sum_batch_size, st.sum_verified_tokens,
                          st.sum_draft_tokens, st.sum_step_seconds, engine_max_k, batch_limit,
                          where)
        _token_sum(st.sum_context_tokens, st.sum_batch_size, f"{where}.sum_context_tokens")
        _token_sum(st.sum_prefill_tokens, st.steps, f"{where}.sum_prefill_tokens", "steps")
    _plausible_interval(report, interval_bound(report.interval_seconds, batch_limit,
                                               fastest_step_seconds))


def fastest_decode_seconds(profile: Iterable[StepProfile]) -> float:
    """A start-up profile's fastest decode step, seconds: what bounds the steps an engine's
    report may count (``interval_bound``). A step that prefills is no bound on a decode step
    (on a slow CPU it takes seconds where decoding one token takes milliseconds); a profile
    without a decode step bounds nothing (MIN_STEP_SECONDS)."""
    return min((p.seconds for p in profile if not p.prefill_tokens), default=MIN_STEP_SECONDS)


def interval_bound(interval_seconds: float, batch_limit: int,
                   fastest_step_seconds: float) -> tuple[float, float]:
    """(engine steps, request-steps) an engine can run in ``interval_seconds`` at most:
    ``RATE_HEADROOM`` x the interval at its fastest step, each step running its whole batch."""
    steps = RATE_HEADROOM * interval_seconds / max(fastest_step_seconds, MIN_STEP_SECONDS)
    return steps, steps * batch_limit


def _plausible_interval(report: EngineReport, bound: tuple[float, float]) -> None:
    """What the report counts fits its interval (``interval_bound``): per draft, its
    acceptance records' verification steps (a request-step verifies one proposal of a draft,
    scored or counterfactual) and its confidence records' tried tokens per position; the step
    timings' steps. Each count alone is bounded by MAX_STEPS_PER_RECORD; this bounds what they
    add up to in one interval, so that one report cannot outweigh hours of honest evidence."""
    max_steps, max_request_steps = bound
    per_draft: dict[str, int] = {}
    for rec in report.acceptance:
        per_draft[rec.draft] = per_draft.get(rec.draft, 0) + sum(rec.steps_by_accepted)
    tried: dict[tuple[str, int], int] = {}
    for conf in report.confidence:
        key = (conf.draft, conf.position)
        tried[key] = tried.get(key, 0) + sum(conf.tried_by_bucket)
    over = ([f"acceptance: {n} verification steps of draft {d!r}" for d, n in per_draft.items()
             if n > max_request_steps]
            + [f"confidence: {n} tried tokens of draft {d!r} at position {p}"
               for (d, p), n in tried.items() if n > max_request_steps])
    if over:
        raise BeyondRate(f"{over[0]} in interval_seconds {report.interval_seconds:g}, above the "
                         f"{max_request_steps:.4g} its engine can verify in it (max batch x "
                         f"fastest profiled decode step rate x {RATE_HEADROOM:g})")
    steps = sum(st.steps for st in report.step_timings)
    if steps > max_steps:
        raise BeyondRate(f"step_timings: {steps} steps in interval_seconds "
                         f"{report.interval_seconds:g}, above the {max_steps:.4g} its engine can "
                         f"run in it (fastest profiled decode step rate x {RATE_HEADROOM:g})")


def _plausible_timing(steps: int, batch: int, verified: int, drafted: int, seconds: float,
                      k: int, batch_limit: int, where: str) -> None:
    """A timing group an engine can have produced: each of ``steps`` steps runs 1..batch_limit
    sequences, each verifying at most 1 + K tokens and drafting at most K (K: the engine's max
    K; a group's own k is its model drafter's passes, and substituted deterministic drafts of
    other requests may be longer), in MIN..MAX step seconds on average (nothing at all for zero
    steps)."""
    if steps == 0:
        if batch or verified or drafted or seconds:
            raise ImplausibleInput(f"{where}: sums without steps")
        return
    if not steps <= batch <= steps * batch_limit:
        raise ImplausibleInput(f"{where}.sum_batch_size: {batch} outside steps..steps x "
                               f"{batch_limit} = {steps}..{steps * batch_limit}")
    if verified > batch * (1 + k):
        raise ImplausibleInput(f"{where}.sum_verified_tokens: {verified} above sum_batch_size "
                               f"x (1 + max K) = {batch * (1 + k)}")
    if drafted > batch * k:
        raise ImplausibleInput(f"{where}.sum_draft_tokens: {drafted} above sum_batch_size x "
                               f"max K = {batch * k}")
    mean = seconds / steps
    if not MIN_STEP_SECONDS <= mean <= MAX_STEP_SECONDS:
        raise ImplausibleInput(f"{where}.sum_step_seconds: {mean!r} s per step, outside "
                               f"[{MIN_STEP_SECONDS}, {MAX_STEP_SECONDS}]")
