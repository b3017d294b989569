"""Checks on engine input before anything of it is applied. Every failure names the field."""

from __future__ import annotations

import math
import re

from controller.core.types import DraftSpec, EngineHello, EngineReport, ReportRejected

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


def valid_class_name(name: object) -> bool:
    """Whether ``name`` is a class name the controller accepts (the engine plugin uses it too)."""
    return (isinstance(name, str) and len(name) <= MAX_CLASS_NAME_LENGTH
            and CLASS_NAME_PATTERN.match(name) is not None)


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


def check_hello(hello: EngineHello) -> None:
    if not hello.engine_id:
        raise ReportRejected("hello.engine_id: must not be empty")
    if hello.max_k < 0:
        raise ReportRejected(f"hello.max_k: must be >= 0, got {hello.max_k}")
    names = [d.name for d in hello.drafts]
    if len(set(names)) != len(names):
        raise ReportRejected(f"hello.drafts: duplicate names in {names}")
    for i, d in enumerate(hello.drafts):
        if not d.name:
            raise ReportRejected(f"hello.drafts[{i}].name: must not be empty")
        if d.max_k < 1:
            raise ReportRejected(f"hello.drafts[{i}].max_k: must be >= 1, got {d.max_k}")
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


_SUMMARY_COUNTS = ("prompt_tokens", "output_tokens", "drafted_tokens", "accepted_tokens")
_TIMING_COUNTS = ("steps", "sum_batch_size", "sum_verified_tokens", "sum_draft_tokens")


def check_report(
    report: EngineReport,
    drafts: dict[str, DraftSpec],
    engine_max_k: int,
    n_buckets: int,
    last_sequence: int | None,
) -> None:
    """Raise ReportRejected naming the first bad field; return normally if all is well."""
    if last_sequence is not None and report.sequence <= last_sequence:
        raise ReportRejected(
            f"sequence: {report.sequence} is not after the last applied {last_sequence} "
            "(duplicate or reordered report)"
        )
    _finite_non_negative(report.interval_seconds, "interval_seconds")
    for i, rec in enumerate(report.acceptance):
        where = f"acceptance[{i}]"
        if not valid_class_name(rec.traffic_class):
            check_class_name(rec.traffic_class, f"{where}.traffic_class")
        spec = drafts.get(rec.draft)
        if spec is None:
            raise ReportRejected(f"{where}.draft: unknown draft {rec.draft!r}")
        limit = min(engine_max_k, spec.max_k)
        if not 1 <= rec.k <= limit:
            raise ReportRejected(f"{where}.k: {rec.k} outside 1..{limit} for draft {rec.draft!r}")
        if len(rec.steps_by_accepted) != rec.k + 1:
            raise ReportRejected(
                f"{where}.steps_by_accepted: {len(rec.steps_by_accepted)} entries, "
                f"expected k+1 = {rec.k + 1}"
            )
        _counts(rec.steps_by_accepted, f"{where}.steps_by_accepted")
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
