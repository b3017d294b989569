from specpilot.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConnectRequest(_message.Message):
    __slots__ = ("hello", "report")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    hello: EngineHello
    report: EngineReport
    def __init__(self, hello: _Optional[_Union[EngineHello, _Mapping]] = ..., report: _Optional[_Union[EngineReport, _Mapping]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("hello_ack", "report_result", "policy")
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    REPORT_RESULT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    hello_ack: HelloAck
    report_result: ReportResult
    policy: PolicyUpdate
    def __init__(self, hello_ack: _Optional[_Union[HelloAck, _Mapping]] = ..., report_result: _Optional[_Union[ReportResult, _Mapping]] = ..., policy: _Optional[_Union[PolicyUpdate, _Mapping]] = ...) -> None: ...

class EngineCapabilities(_message.Message):
    __slots__ = ("per_request_k", "batch_wide_k", "ngram_substitution", "ngram_counterfactual", "step_probes", "step_composition")
    PER_REQUEST_K_FIELD_NUMBER: _ClassVar[int]
    BATCH_WIDE_K_FIELD_NUMBER: _ClassVar[int]
    NGRAM_SUBSTITUTION_FIELD_NUMBER: _ClassVar[int]
    NGRAM_COUNTERFACTUAL_FIELD_NUMBER: _ClassVar[int]
    STEP_PROBES_FIELD_NUMBER: _ClassVar[int]
    STEP_COMPOSITION_FIELD_NUMBER: _ClassVar[int]
    per_request_k: bool
    batch_wide_k: bool
    ngram_substitution: bool
    ngram_counterfactual: bool
    step_probes: bool
    step_composition: bool
    def __init__(self, per_request_k: _Optional[bool] = ..., batch_wide_k: _Optional[bool] = ..., ngram_substitution: _Optional[bool] = ..., ngram_counterfactual: _Optional[bool] = ..., step_probes: _Optional[bool] = ..., step_composition: _Optional[bool] = ...) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("name", "kind", "vocab_hash", "max_k")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: _common_pb2.DraftKind
    vocab_hash: str
    max_k: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.DraftKind, str]] = ..., vocab_hash: _Optional[str] = ..., max_k: _Optional[int] = ...) -> None: ...

class EngineHello(_message.Message):
    __slots__ = ("engine_id", "model", "target_vocab_hash", "drafts", "max_k", "capabilities", "engine_version", "plugin_version", "max_batch_size", "step_profile", "hardware")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_PROFILE_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    target_vocab_hash: str
    drafts: _containers.RepeatedCompositeFieldContainer[DraftInfo]
    max_k: int
    capabilities: EngineCapabilities
    engine_version: str
    plugin_version: str
    max_batch_size: int
    step_profile: _containers.RepeatedCompositeFieldContainer[StepProfile]
    hardware: str
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., target_vocab_hash: _Optional[str] = ..., drafts: _Optional[_Iterable[_Union[DraftInfo, _Mapping]]] = ..., max_k: _Optional[int] = ..., capabilities: _Optional[_Union[EngineCapabilities, _Mapping]] = ..., engine_version: _Optional[str] = ..., plugin_version: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., step_profile: _Optional[_Iterable[_Union[StepProfile, _Mapping]]] = ..., hardware: _Optional[str] = ...) -> None: ...

class StepProfile(_message.Message):
    __slots__ = ("batch_size", "verified_tokens", "draft", "draft_passes", "seconds", "context_tokens", "prefill_tokens")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PASSES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    verified_tokens: int
    draft: str
    draft_passes: int
    seconds: float
    context_tokens: int
    prefill_tokens: int
    def __init__(self, batch_size: _Optional[int] = ..., verified_tokens: _Optional[int] = ..., draft: _Optional[str] = ..., draft_passes: _Optional[int] = ..., seconds: _Optional[float] = ..., context_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class HelloAck(_message.Message):
    __slots__ = ("controller_version", "accepted_drafts", "rejected_drafts", "report_interval_seconds", "batch_bucket_upper_bounds", "max_classes", "policy_epoch")
    CONTROLLER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_BUCKET_UPPER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CLASSES_FIELD_NUMBER: _ClassVar[int]
    POLICY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    controller_version: str
    accepted_drafts: _containers.RepeatedScalarFieldContainer[str]
    rejected_drafts: _containers.RepeatedCompositeFieldContainer[RejectedDraft]
    report_interval_seconds: float
    batch_bucket_upper_bounds: _containers.RepeatedScalarFieldContainer[int]
    max_classes: int
    policy_epoch: int
    def __init__(self, controller_version: _Optional[str] = ..., accepted_drafts: _Optional[_Iterable[str]] = ..., rejected_drafts: _Optional[_Iterable[_Union[RejectedDraft, _Mapping]]] = ..., report_interval_seconds: _Optional[float] = ..., batch_bucket_upper_bounds: _Optional[_Iterable[int]] = ..., max_classes: _Optional[int] = ..., policy_epoch: _Optional[int] = ...) -> None: ...

class RejectedDraft(_message.Message):
    __slots__ = ("name", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AcceptanceCounts(_message.Message):
    __slots__ = ("traffic_class", "draft", "k", "steps_by_accepted", "counterfactual", "steps_by_drafted")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COUNTERFACTUAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    draft: str
    k: int
    steps_by_accepted: _containers.RepeatedScalarFieldContainer[int]
    counterfactual: bool
    steps_by_drafted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, traffic_class: _Optional[str] = ..., draft: _Optional[str] = ..., k: _Optional[int] = ..., steps_by_accepted: _Optional[_Iterable[int]] = ..., counterfactual: _Optional[bool] = ..., steps_by_drafted: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestSummary(_message.Message):
    __slots__ = ("traffic_class", "draft", "prompt_tokens", "output_tokens", "drafted_tokens", "accepted_tokens", "latency_seconds")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    draft: str
    prompt_tokens: int
    output_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    latency_seconds: float
    def __init__(self, traffic_class: _Optional[str] = ..., draft: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., latency_seconds: _Optional[float] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("batch_bucket", "draft", "k", "steps", "sum_batch_size", "sum_verified_tokens", "sum_draft_tokens", "sum_step_seconds", "sum_context_tokens", "sum_prefill_tokens")
    BATCH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SUM_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUM_VERIFIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUM_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch_bucket: int
    draft: str
    k: int
    steps: int
    sum_batch_size: int
    sum_verified_tokens: int
    sum_draft_tokens: int
    sum_step_seconds: float
    sum_context_tokens: int
    sum_prefill_tokens: int
    def __init__(self, batch_bucket: _Optional[int] = ..., draft: _Optional[str] = ..., k: _Optional[int] = ..., steps: _Optional[int] = ..., sum_batch_size: _Optional[int] = ..., sum_verified_tokens: _Optional[int] = ..., sum_draft_tokens: _Optional[int] = ..., sum_step_seconds: _Optional[float] = ..., sum_context_tokens: _Optional[int] = ..., sum_prefill_tokens: _Optional[int] = ...) -> None: ...

class EngineReport(_message.Message):
    __slots__ = ("sequence", "interval_seconds", "policy_version", "acceptance", "finished", "step_timings", "records_dropped", "running_requests", "confidence")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    interval_seconds: float
    policy_version: int
    acceptance: _containers.RepeatedCompositeFieldContainer[AcceptanceCounts]
    finished: _containers.RepeatedCompositeFieldContainer[RequestSummary]
    step_timings: _containers.RepeatedCompositeFieldContainer[StepTiming]
    records_dropped: int
    running_requests: int
    confidence: _containers.RepeatedCompositeFieldContainer[ConfidenceCounts]
    def __init__(self, sequence: _Optional[int] = ..., interval_seconds: _Optional[float] = ..., policy_version: _Optional[int] = ..., acceptance: _Optional[_Iterable[_Union[AcceptanceCounts, _Mapping]]] = ..., finished: _Optional[_Iterable[_Union[RequestSummary, _Mapping]]] = ..., step_timings: _Optional[_Iterable[_Union[StepTiming, _Mapping]]] = ..., records_dropped: _Optional[int] = ..., running_requests: _Optional[int] = ..., confidence: _Optional[_Iterable[_Union[ConfidenceCounts, _Mapping]]] = ...) -> None: ...

class ConfidenceCounts(_message.Message):
    __slots__ = ("traffic_class", "draft", "position", "tried_by_bucket", "accepted_by_bucket", "transformed")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TRIED_BY_BUCKET_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_BUCKET_FIELD_NUMBER: _ClassVar[int]
    TRANSFORMED_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    draft: str
    position: int
    tried_by_bucket: _containers.RepeatedScalarFieldContainer[int]
    accepted_by_bucket: _containers.RepeatedScalarFieldContainer[int]
    transformed: bool
    def __init__(self, traffic_class: _Optional[str] = ..., draft: _Optional[str] = ..., position: _Optional[int] = ..., tried_by_bucket: _Optional[_Iterable[int]] = ..., accepted_by_bucket: _Optional[_Iterable[int]] = ..., transformed: _Optional[bool] = ...) -> None: ...

class ReportResult(_message.Message):
    __slots__ = ("sequence", "accepted", "code", "reason", "folded_classes", "retry_after_seconds")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FOLDED_CLASSES_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    accepted: bool
    code: int
    reason: str
    folded_classes: _containers.RepeatedScalarFieldContainer[str]
    retry_after_seconds: float
    def __init__(self, sequence: _Optional[int] = ..., accepted: _Optional[bool] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ..., folded_classes: _Optional[_Iterable[str]] = ..., retry_after_seconds: _Optional[float] = ...) -> None: ...

class PolicyUpdate(_message.Message):
    __slots__ = ("version", "decisions", "default_decisions", "fail_static_timeout_seconds", "composition", "cut")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    FAIL_STATIC_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPOSITION_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    version: int
    decisions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Decision]
    default_decisions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Decision]
    fail_static_timeout_seconds: float
    composition: Composition
    cut: TokenCut
    def __init__(self, version: _Optional[int] = ..., decisions: _Optional[_Iterable[_Union[_common_pb2.Decision, _Mapping]]] = ..., default_decisions: _Optional[_Iterable[_Union[_common_pb2.Decision, _Mapping]]] = ..., fail_static_timeout_seconds: _Optional[float] = ..., composition: _Optional[_Union[Composition, _Mapping]] = ..., cut: _Optional[_Union[TokenCut, _Mapping]] = ...) -> None: ...

class TokenCut(_message.Message):
    __slots__ = ("min_survival", "calibrations", "pass_tokens")
    MIN_SURVIVAL_FIELD_NUMBER: _ClassVar[int]
    CALIBRATIONS_FIELD_NUMBER: _ClassVar[int]
    PASS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    min_survival: _containers.RepeatedScalarFieldContainer[float]
    calibrations: _containers.RepeatedCompositeFieldContainer[CalibrationRows]
    pass_tokens: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, min_survival: _Optional[_Iterable[float]] = ..., calibrations: _Optional[_Iterable[_Union[CalibrationRows, _Mapping]]] = ..., pass_tokens: _Optional[_Iterable[float]] = ...) -> None: ...

class CalibrationRows(_message.Message):
    __slots__ = ("traffic_class", "draft", "transformed", "positions", "accept", "mean_accept")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TRANSFORMED_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    draft: str
    transformed: bool
    positions: int
    accept: _containers.RepeatedScalarFieldContainer[float]
    mean_accept: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, traffic_class: _Optional[str] = ..., draft: _Optional[str] = ..., transformed: _Optional[bool] = ..., positions: _Optional[int] = ..., accept: _Optional[_Iterable[float]] = ..., mean_accept: _Optional[_Iterable[float]] = ...) -> None: ...

class Composition(_message.Message):
    __slots__ = ("pricing", "expected_tokens", "margin")
    PRICING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MARGIN_FIELD_NUMBER: _ClassVar[int]
    pricing: StepPricing
    expected_tokens: _containers.RepeatedCompositeFieldContainer[ExpectedTokens]
    margin: float
    def __init__(self, pricing: _Optional[_Union[StepPricing, _Mapping]] = ..., expected_tokens: _Optional[_Iterable[_Union[ExpectedTokens, _Mapping]]] = ..., margin: _Optional[float] = ...) -> None: ...

class StepPricing(_message.Message):
    __slots__ = ("base_seconds", "seconds_per_sequence", "seconds_per_token", "knot_tokens", "seconds_per_token_above", "drafts", "seconds_per_context_token", "seconds_per_speculating_sequence", "seconds_per_prefill_token")
    BASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KNOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_TOKEN_ABOVE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_CONTEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_SPECULATING_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_PREFILL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    base_seconds: float
    seconds_per_sequence: float
    seconds_per_token: float
    knot_tokens: _containers.RepeatedScalarFieldContainer[int]
    seconds_per_token_above: _containers.RepeatedScalarFieldContainer[float]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftPricing]
    seconds_per_context_token: float
    seconds_per_speculating_sequence: float
    seconds_per_prefill_token: float
    def __init__(self, base_seconds: _Optional[float] = ..., seconds_per_sequence: _Optional[float] = ..., seconds_per_token: _Optional[float] = ..., knot_tokens: _Optional[_Iterable[int]] = ..., seconds_per_token_above: _Optional[_Iterable[float]] = ..., drafts: _Optional[_Iterable[_Union[DraftPricing, _Mapping]]] = ..., seconds_per_context_token: _Optional[float] = ..., seconds_per_speculating_sequence: _Optional[float] = ..., seconds_per_prefill_token: _Optional[float] = ...) -> None: ...

class DraftPricing(_message.Message):
    __slots__ = ("draft", "fixed_seconds", "seconds_per_pass", "seconds_per_token")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    FIXED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_PASS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    draft: str
    fixed_seconds: float
    seconds_per_pass: float
    seconds_per_token: float
    def __init__(self, draft: _Optional[str] = ..., fixed_seconds: _Optional[float] = ..., seconds_per_pass: _Optional[float] = ..., seconds_per_token: _Optional[float] = ...) -> None: ...

class ExpectedTokens(_message.Message):
    __slots__ = ("traffic_class", "draft", "by_k")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    BY_K_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    draft: str
    by_k: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, traffic_class: _Optional[str] = ..., draft: _Optional[str] = ..., by_k: _Optional[_Iterable[float]] = ...) -> None: ...
