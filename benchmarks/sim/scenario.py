"""The scenario format of ``specpilot simulate``: what traffic an engine serves, how well each draft
predicts each class, what a step costs, and how load and acceptance move over time.

One pydantic model is the single source: it validates YAML files (every error names its field, as
``classes.1.acceptance``), and ``scenario_json_schema()`` is the JSON schema shipped next to the
suite (``benchmarks/scenarios/scenario.schema.json``, kept equal by a test). Units are in the
field names: ``_ms`` milliseconds, ``_seconds`` seconds, ``_tokens`` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specpilot.contract.validation import valid_class_name

Rate = Annotated[float, Field(ge=0.0, le=1.0)]
# A measured time as a share of the true one.
Scale = Annotated[float, Field(gt=0.0, le=10.0)]
# Per-position conditional acceptance: one number for every position, or a list whose last value
# repeats for the positions beyond it.
Acceptance = Rate | Annotated[list[Rate], Field(min_length=1)]
TokenRange = Annotated[int, Field(ge=1)] | Annotated[list[Annotated[int, Field(ge=1)]],
                                                      Field(min_length=2, max_length=2)]


class ScenarioError(ValueError):
    """An invalid scenario; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSpec(_Strict):
    max_k: int = Field(8, ge=1, le=16, description="Largest K the engine is configured for.")
    max_batch: int = Field(64, ge=1, description="Most sequences in one step (max_num_seqs).")
    max_batched_tokens: int = Field(
        8192, ge=16, description="Token budget of one step; prefill chunks fill what decode "
        "leaves (max_num_batched_tokens).")
    report_interval_seconds: float = Field(
        1.0, gt=0, description="How often the engine plugin reports to the controller, seconds.")
    profile_scale: tuple[Scale, Scale] = Field(
        (1.0, 1.0), description="The start-up step profile's times as shares of the true step "
        "times, [without speculation, with], each in (0, 10]: 1 is exact; a real profile times "
        "the forward passes only (on the CPU engine about [0.84, 0.78]).")


class CostSpec(_Strict):
    """True target step time: memory-bound below ``ridge_tokens`` tokens per step, compute-bound
    above, plus a per-sequence term (KV-cache reads)."""

    base_ms: float = Field(gt=0, description="Fixed time of one target step, ms.")
    per_sequence_ms: float = Field(0.0, ge=0, description="Added per sequence in the step, ms.")
    per_token_ms: float = Field(ge=0, description="Added per token verified or prefilled, ms.")
    ridge_tokens: int = Field(ge=1, description="Tokens per step where compute starts to bind.")
    per_token_above_ridge_ms: float = Field(
        ge=0, description="Extra per token beyond the ridge, ms.")
    per_context_token_ms: float = Field(
        0.0, ge=0, description="Added per context token a token of the step attends to, ms: "
        "each verified or prefilled token reads its sequence's KV cache as it was before the "
        "step (prompt plus generated tokens), so a sequence verifying 1 + K tokens over L of "
        "context adds (1 + K) x L times this. 0: context is free.")
    noise: float = Field(0.03, ge=0, le=1, description="Log-normal sigma of step-time noise.")


class DraftSpec(_Strict):
    name: str = Field(min_length=1, description="Draft name, as the engine reports it.")
    kind: Literal["model", "ngram"] = Field(description="A draft model or n-gram lookup.")
    per_pass_ms: float = Field(0.0, ge=0, description="One sequential draft pass, ms.")
    per_token_ms: float = Field(0.0, ge=0, description="Per proposed token of a pass, ms.")

    @model_validator(mode="after")
    def _ngram_free(self) -> DraftSpec:
        if self.kind == "ngram" and (self.per_pass_ms or self.per_token_ms):
            raise ValueError("n-gram drafts cost nothing measurable: drop per_pass_ms/per_token_ms")
        return self


class ConfidenceSpec(_Strict):
    """How each drafted token's confidence relates to its true acceptance: the token's acceptance
    probability p is drawn around its position's rate (a Beta with that mean, so the rates above
    are kept), and the draft's confidence in it is logit(q) = logit(p) + bias + noise x N(0, 1)."""

    concentration: float = Field(
        2.0, gt=0, le=1000, description="Beta concentration of a token's acceptance probability "
        "around its position's rate: low, tokens differ a lot and confidence tells them apart; "
        "high, every token of a position is alike.")
    bias: float = Field(
        0.0, ge=-10, le=10, description="Logit of the draft's confidence minus that of the true "
        "acceptance: above 0 the draft is over-confident, as for requests whose sampling the "
        "target transforms (penalties, logit bias, structured output).")
    noise: float = Field(
        0.5, ge=0, le=10, description="Standard deviation of the logit noise between the "
        "draft's confidence and the true acceptance.")
    transformed: bool = Field(
        False, description="The target transforms the class's sampling (penalties, logit bias, "
        "structured output): an engine plugin sees it on each request and counts and cuts its "
        "confidences apart from untransformed requests'. Changes no token's acceptance or "
        "confidence (that is bias's part).")


class ClassSpec(_Strict):
    name: str = Field(description="Traffic class name.")
    share: float = Field(gt=0, description="Relative share of new requests.")
    prompt_tokens: TokenRange = Field(
        description="Prompt length, tokens: a number or an inclusive [min, max] range.")
    output_tokens: TokenRange = Field(
        description="Output length, tokens: a number or an inclusive [min, max] range.")
    spread: float = Field(
        0.5, ge=0, le=5, description="Per-request difficulty: standard deviation of a logit "
        "offset added to every position's acceptance.")
    offline: bool = Field(False, description="Batch work the operator marks offline.")
    acceptance: dict[str, Acceptance] = Field(
        description="Per draft: conditional acceptance by position (number or list).")
    confidence: ConfidenceSpec = Field(
        default_factory=ConfidenceSpec, description="Per-token confidence of the model drafts "
        "(the engine's first draft), around the acceptance above.")

    @model_validator(mode="after")
    def _name(self) -> ClassSpec:
        if not valid_class_name(self.name):
            raise ValueError(f"class name {self.name!r} is not a valid traffic class name")
        for field in (self.prompt_tokens, self.output_tokens):
            if isinstance(field, list) and field[0] > field[1]:
                raise ValueError(f"token range {field} has min > max")
        return self


class Phase(_Strict):
    duration_seconds: float = Field(gt=0, description="Length of the phase, seconds.")
    concurrency: int | None = Field(
        None, ge=1, description="Closed loop: requests in the system at all times.")
    arrival_rate_per_second: float | None = Field(
        None, gt=0, description="Open loop: Poisson arrivals per second.")
    shares: dict[str, float] | None = Field(
        None, description="Class shares during this phase (default: the classes' own).")
    name: str = Field("", description="Label in the per-phase breakdown.")

    @model_validator(mode="after")
    def _one_load(self) -> Phase:
        if (self.concurrency is None) == (self.arrival_rate_per_second is None):
            raise ValueError("set exactly one of concurrency and arrival_rate_per_second")
        return self


class Drift(_Strict):
    at_seconds: float = Field(ge=0, description="When the change happens, seconds.")
    traffic_class: str = Field(alias="class", description="The class whose acceptance changes.")
    draft: str = Field(description="The draft whose acceptance changes.")
    acceptance: Acceptance = Field(description="The new acceptance (number or list).")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Baselines(_Strict):
    batch_table: list[Annotated[list[Annotated[int, Field(ge=0)]],
                                Field(min_length=3, max_length=3)]] | None = Field(
        None, description="Static batch-size table [[start, end, K], ...] (inclusive); default: "
        "tuned offline on the scenario's traffic mix at t=0.")
    acceptance_threshold: float = Field(
        0.3, ge=0, le=1, description="TensorRT-LLM-style policy: turn off below this rate.")
    acceptance_window: int = Field(
        128, ge=1, description="TensorRT-LLM-style policy: rolling window, speculative steps.")


class Scenario(_Strict):
    name: str = Field(description="Scenario name (file stem if omitted).", default="")
    description: str = Field("", description="What the scenario shows.")
    kind: Literal["stationary", "shifting", "no_gain"] = Field(
        "stationary", description="Which target applies: stationary (>= 0.97 of oracle), "
        "shifting load or acceptance (>= 0.93), or no_gain (speculation does not pay: >= 0.98 "
        "of off).")
    seed: int = Field(0, description="Seed of traffic and acceptance draws.")
    engine: EngineSpec = Field(default_factory=EngineSpec)
    cost: CostSpec
    drafts: list[DraftSpec] = Field(min_length=1)
    classes: list[ClassSpec] = Field(min_length=1)
    load: list[Phase] = Field(min_length=1, description="Load phases, in order.")
    drift: list[Drift] = Field(default_factory=list)
    baselines: Baselines = Field(default_factory=Baselines)
    specpilot: dict[str, Any] = Field(
        default_factory=dict, description="Controller settings for the specpilot policy "
        "(names as in docs/configuration.md); offline classes are added from the classes.")
    policies: list[str] | None = Field(
        None, description="Policies to run by default (see `specpilot simulate --help`).")
    timeline_seconds: float = Field(5.0, gt=0, description="Bin width of the K timeline, s.")

    @model_validator(mode="after")
    def _references(self) -> Scenario:
        drafts = [d.name for d in self.drafts]
        classes = [c.name for c in self.classes]
        for names, what in ((drafts, "drafts"), (classes, "classes")):
            if len(set(names)) != len(names):
                raise ValueError(f"{what}: duplicate names in {names}")
        for c in self.classes:
            if sorted(c.acceptance) != sorted(drafts):
                raise ValueError(f"classes: class {c.name!r} gives acceptance for "
                                 f"{sorted(c.acceptance)}; every draft needs one: {drafts}")
        for i, p in enumerate(self.load):
            unknown = set(p.shares or {}) - set(classes)
            if unknown:
                raise ValueError(f"load.{i}.shares: unknown classes {sorted(unknown)}")
            if p.shares is not None and sum(p.shares.values()) <= 0:
                raise ValueError(f"load.{i}.shares: shares must add up to more than 0")
        for i, d in enumerate(self.drift):
            if d.traffic_class not in classes:
                raise ValueError(f"drift.{i}.class: unknown class {d.traffic_class!r}")
            if d.draft not in drafts:
                raise ValueError(f"drift.{i}.draft: unknown draft {d.draft!r}")
        return self

    @property
    def duration_seconds(self) -> float:
        return sum(p.duration_seconds for p in self.load)

    def phase_starts(self) -> list[float]:
        starts, t = [], 0.0
        for p in self.load:
            starts.append(t)
            t += p.duration_seconds
        return starts

    def phase_label(self, i: int) -> str:
        p = self.load[i]
        if p.name:
            return p.name
        load = (f"c={p.concurrency}" if p.concurrency is not None
                else f"{p.arrival_rate_per_second:g}/s")
        return f"{i + 1}:{load}"


def _error_text(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: a scenario is a mapping, got {type(data).__name__}")
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{source}: {_error_text(exc)}") from None
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a YAML scenario; the name defaults to the file stem."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{p}: not valid YAML: {exc}") from None
    scenario = parse_scenario(data, str(p))
    return scenario if scenario.name else scenario.model_copy(update={"name": p.stem})


def scenario_json_schema() -> str:
    """The JSON schema of the format, as shipped in benchmarks/scenarios/scenario.schema.json."""
    schema = Scenario.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "specpilot simulate scenario"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"
