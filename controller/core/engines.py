"""The engines connected to this controller and the drafts it accepted from each.

Admission (``admit_drafts``) is decided before anything changes: a model draft whose tokenizer
differs from the target's is refused (acceptance would be meaningless), as are drafts of an
engine without speculation, model drafts the step-cost model has no room to price
(``CoreConfig.max_model_drafts``) and drafts substituted into a refused one's proposals.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from specpilot.contract.records import DraftKind, DraftSpec, EngineHello, EngineReport
from specpilot.contract.validation import MIN_STEP_SECONDS, fastest_decode_seconds
from specpilot.controller.core.cost_model import SunkDraft


@dataclass(frozen=True)
class HelloOutcome:
    accepted_drafts: tuple[str, ...]
    rejected_drafts: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class DraftAdmission:
    """What a hello's drafts come to: the drafts accepted (capped at the engine's max K), the
    refused ones with the reason, and the held model drafts that give their cost columns (and
    estimates) to new ones."""

    accepted: dict[str, DraftSpec]
    rejected: tuple[tuple[str, str], ...]
    forget: tuple[str, ...]

    @property
    def model_drafts(self) -> list[str]:
        return [n for n, d in self.accepted.items() if d.kind is DraftKind.MODEL]


def admit_drafts(hello: EngineHello, held: Sequence[str], in_use: set[str],
                 max_model_drafts: int) -> DraftAdmission:
    """The admission of ``hello``'s drafts, given the model drafts the cost model prices now
    (``held``, the longest-held first) and the drafts other connected engines announce
    (``in_use``). A new model draft takes a free column, else the column of a held draft no
    engine announces (the longest-held first); one that still finds none is refused."""
    accepted: dict[str, DraftSpec] = {}
    rejected: list[tuple[str, str]] = []
    for d in hello.drafts:
        if d.kind is DraftKind.MODEL and d.vocab_hash != hello.target_vocab_hash:
            rejected.append((d.name, (
                f"tokenizer vocabulary hash {d.vocab_hash[:16] or '(none)'} differs from the "
                f"target's {hello.target_vocab_hash[:16] or '(none)'}: acceptance would be "
                "meaningless, draft refused")))
            continue
        if hello.max_k < 1:
            rejected.append((d.name, "engine max_k is 0: speculation not configured"))
            continue
        accepted[d.name] = DraftSpec(d.name, d.kind, min(d.max_k, hello.max_k), d.vocab_hash)
    new = [n for n, d in accepted.items() if d.kind is DraftKind.MODEL and n not in held]
    room = max_model_drafts - len(held)
    forget: list[str] = []
    no_room: list[tuple[str, str]] = []
    if len(new) > room:
        free = [d for d in held if d not in in_use and d not in accepted]
        forget = free[:len(new) - room]
        room += len(forget)
        for name in new[room:]:
            del accepted[name]
            no_room.append((name, f"the controller prices at most {max_model_drafts} model "
                                  "drafts at once (max_model_drafts) and connected engines use "
                                  "them all: draft refused"))
    rejected.extend(no_room)
    # vLLM runs one drafter: next to a model draft, an n-gram draft is substituted into its
    # proposals. With one K for the whole step (batch-wide, not per request) the n-gram
    # requests' K sets the drafter's passes too, so it costs that model's passes.
    models = [n for n, d in accepted.items() if d.kind is DraftKind.MODEL]
    if hello.batch_wide_k and not hello.per_request_k:
        if models:
            accepted = {n: (replace(d, carrier=models[0]) if d.kind is not DraftKind.MODEL
                            else d)
                        for n, d in accepted.items()}
        elif no_room:  # their drafter found no cost column: they cannot be priced
            carrier = no_room[0][0]
            rejected.extend((n, f"substituted into model draft {carrier}'s proposals "
                                "(one K per step), which was refused: its passes cannot "
                                "be priced, draft refused") for n in accepted)
            accepted = {}
    return DraftAdmission(accepted, tuple(rejected), tuple(forget))


@dataclass
class EngineState:
    hello: EngineHello
    drafts: dict[str, DraftSpec]
    last_report_at: float
    last_sequence: int | None = None
    running_requests: int = 0
    policy_version_applied: int = 0
    # Its fastest profiled decode step, seconds: what bounds the steps one report may count.
    fastest_step_seconds: float = MIN_STEP_SECONDS


class EngineRegistry:
    """Connected engines by id, as of their hello and their last report."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineState] = {}
        self._drafts: tuple[DraftSpec, ...] | None = None  # drafts(), cached
        # The model and hardware of the last engine that named them, kept after it left: the
        # evidence it brought is still theirs to share.
        self._served = ("", "")

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[tuple[str, EngineState]]:
        """(engine id, state), by engine id."""
        return iter(sorted(self._engines.items()))

    def get(self, engine_id: str) -> EngineState | None:
        return self._engines.get(engine_id)

    def register(self, hello: EngineHello, accepted: dict[str, DraftSpec], now: float) -> None:
        """Hold ``hello``'s engine with its ``accepted`` drafts (replacing an earlier stream)."""
        self._drafts = None
        self._served = (hello.model or self._served[0], hello.hardware or self._served[1])
        # The profile is learnt by now; kept, it would cost up to 0.3 MiB an engine for nothing.
        self._engines[hello.engine_id] = EngineState(
            replace(hello, step_profile=()), accepted, last_report_at=now,
            fastest_step_seconds=fastest_decode_seconds(hello.step_profile))

    def remove(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)
        self._drafts = None

    def heard_from(self, engine_id: str, now: float) -> None:
        engine = self._engines.get(engine_id)
        if engine is not None:
            engine.last_report_at = max(engine.last_report_at, now)

    def reported(self, engine: EngineState, report: EngineReport, now: float) -> None:
        """``engine`` sent ``report`` (applied)."""
        engine.last_sequence = report.sequence
        engine.running_requests = report.running_requests
        engine.last_report_at = now
        engine.policy_version_applied = report.policy_version

    def drafts(self) -> tuple[DraftSpec, ...]:
        """Drafts every connected engine accepted (union; first-seen order). Kept until an
        engine connects or leaves: decisions ask for it per bucket, and a controller of
        hundreds of engines spent most of its decide rounds merging them again."""
        if self._drafts is None:
            merged: dict[str, DraftSpec] = {}
            for engine in self._engines.values():
                for name, spec in engine.drafts.items():
                    merged.setdefault(name, spec)
            self._drafts = tuple(merged.values())
        return self._drafts

    def drafts_in_use(self, besides: str) -> set[str]:
        """The drafts of the connected engines other than ``besides``."""
        return {n for e_id, e in self._engines.items() if e_id != besides for n in e.drafts}

    def sunk_draft(self) -> SunkDraft | None:
        """The model drafter that runs every step whatever K is chosen, if any: engines in
        per-request K mode draft the configured K and only then cut. (With several engines the
        first such one stands for all.) Batch-wide engines draft only the K chosen."""
        for engine in self._engines.values():
            if engine.hello.batch_wide_k:
                continue
            for spec in engine.drafts.values():
                if spec.kind is DraftKind.MODEL:
                    return (spec.name, spec.max_k)
        return None

    def any_step_composition(self) -> bool:
        """Whether some connected engine re-picks arms per step (``Composition``)."""
        return any(e.hello.step_composition for e in self._engines.values())

    def model(self) -> str:
        """The model of the first connected engine that names one; with none connected, of the
        last that did ("" before any)."""
        return next((e.hello.model for e in self._engines.values() if e.hello.model),
                    self._served[0])

    def hardware(self) -> str:
        """What the first connected engine runs on; with none connected, the last engine that
        named it ("" before any)."""
        return next((e.hello.hardware for e in self._engines.values() if e.hello.hardware),
                    self._served[1])

    def mean_running(self) -> float:
        """Mean running requests over the connected engines (at least one)."""
        return sum(e.running_requests for e in self._engines.values()) / len(self._engines)

    def report_ages(self, now: float) -> dict[str, float]:
        """Seconds since each engine's last report (or its hello), by engine id."""
        return {engine_id: now - e.last_report_at for engine_id, e in self}
