from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecisionReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_REASON_UNSPECIFIED: _ClassVar[DecisionReason]
    DECISION_REASON_WARMUP: _ClassVar[DecisionReason]
    DECISION_REASON_GOODPUT: _ClassVar[DecisionReason]
    DECISION_REASON_EXPLORE: _ClassVar[DecisionReason]
    DECISION_REASON_CHANGE_DETECTED: _ClassVar[DecisionReason]
    DECISION_REASON_OVERRIDE: _ClassVar[DecisionReason]
    DECISION_REASON_OFFLINE: _ClassVar[DecisionReason]
    DECISION_REASON_NEIGHBOURS: _ClassVar[DecisionReason]

class DraftKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_KIND_UNSPECIFIED: _ClassVar[DraftKind]
    DRAFT_KIND_MODEL: _ClassVar[DraftKind]
    DRAFT_KIND_NGRAM: _ClassVar[DraftKind]
    DRAFT_KIND_SUFFIX: _ClassVar[DraftKind]
DECISION_REASON_UNSPECIFIED: DecisionReason
DECISION_REASON_WARMUP: DecisionReason
DECISION_REASON_GOODPUT: DecisionReason
DECISION_REASON_EXPLORE: DecisionReason
DECISION_REASON_CHANGE_DETECTED: DecisionReason
DECISION_REASON_OVERRIDE: DecisionReason
DECISION_REASON_OFFLINE: DecisionReason
DECISION_REASON_NEIGHBOURS: DecisionReason
DRAFT_KIND_UNSPECIFIED: DraftKind
DRAFT_KIND_MODEL: DraftKind
DRAFT_KIND_NGRAM: DraftKind
DRAFT_KIND_SUFFIX: DraftKind

class Decision(_message.Message):
    __slots__ = ("traffic_class", "batch_bucket", "draft", "k", "reason", "expected_speedup", "probe_rate", "probe_k", "probe_draft", "probe_steps", "too_little_evidence")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    BATCH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    PROBE_RATE_FIELD_NUMBER: _ClassVar[int]
    PROBE_K_FIELD_NUMBER: _ClassVar[int]
    PROBE_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PROBE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOO_LITTLE_EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    batch_bucket: int
    draft: str
    k: int
    reason: DecisionReason
    expected_speedup: float
    probe_rate: float
    probe_k: int
    probe_draft: str
    probe_steps: bool
    too_little_evidence: bool
    def __init__(self, traffic_class: _Optional[str] = ..., batch_bucket: _Optional[int] = ..., draft: _Optional[str] = ..., k: _Optional[int] = ..., reason: _Optional[_Union[DecisionReason, str]] = ..., expected_speedup: _Optional[float] = ..., probe_rate: _Optional[float] = ..., probe_k: _Optional[int] = ..., probe_draft: _Optional[str] = ..., probe_steps: _Optional[bool] = ..., too_little_evidence: _Optional[bool] = ...) -> None: ...

class DecisionEvent(_message.Message):
    __slots__ = ("policy_version", "unix_seconds", "decision", "previous_draft", "previous_k", "figures")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_K_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    unix_seconds: float
    decision: Decision
    previous_draft: str
    previous_k: int
    figures: DecisionFigures
    def __init__(self, policy_version: _Optional[int] = ..., unix_seconds: _Optional[float] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., previous_draft: _Optional[str] = ..., previous_k: _Optional[int] = ..., figures: _Optional[_Union[DecisionFigures, _Mapping]] = ...) -> None: ...

class ArmFigures(_message.Message):
    __slots__ = ("draft", "k", "expected_tokens", "goodput_tokens_per_second", "speedup", "acceptance_mean", "acceptance_half_width", "too_little_evidence")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_MEAN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_HALF_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TOO_LITTLE_EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    draft: str
    k: int
    expected_tokens: float
    goodput_tokens_per_second: float
    speedup: float
    acceptance_mean: float
    acceptance_half_width: float
    too_little_evidence: bool
    def __init__(self, draft: _Optional[str] = ..., k: _Optional[int] = ..., expected_tokens: _Optional[float] = ..., goodput_tokens_per_second: _Optional[float] = ..., speedup: _Optional[float] = ..., acceptance_mean: _Optional[float] = ..., acceptance_half_width: _Optional[float] = ..., too_little_evidence: _Optional[bool] = ...) -> None: ...

class DecisionFigures(_message.Message):
    __slots__ = ("batch_size", "chosen", "previous", "best", "pinned_by")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    BEST_FIELD_NUMBER: _ClassVar[int]
    PINNED_BY_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    chosen: ArmFigures
    previous: ArmFigures
    best: ArmFigures
    pinned_by: str
    def __init__(self, batch_size: _Optional[int] = ..., chosen: _Optional[_Union[ArmFigures, _Mapping]] = ..., previous: _Optional[_Union[ArmFigures, _Mapping]] = ..., best: _Optional[_Union[ArmFigures, _Mapping]] = ..., pinned_by: _Optional[str] = ...) -> None: ...
