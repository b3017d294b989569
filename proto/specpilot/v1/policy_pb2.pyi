from specpilot.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OverrideScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OVERRIDE_SCOPE_UNSPECIFIED: _ClassVar[OverrideScope]
    OVERRIDE_SCOPE_POD: _ClassVar[OverrideScope]
    OVERRIDE_SCOPE_FLEET: _ClassVar[OverrideScope]
OVERRIDE_SCOPE_UNSPECIFIED: OverrideScope
OVERRIDE_SCOPE_POD: OverrideScope
OVERRIDE_SCOPE_FLEET: OverrideScope

class GetPolicyRequest(_message.Message):
    __slots__ = ("traffic_class",)
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    def __init__(self, traffic_class: _Optional[str] = ...) -> None: ...

class PositionEstimate(_message.Message):
    __slots__ = ("position", "mean", "lower", "upper", "effective_tries")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_TRIES_FIELD_NUMBER: _ClassVar[int]
    position: int
    mean: float
    lower: float
    upper: float
    effective_tries: float
    def __init__(self, position: _Optional[int] = ..., mean: _Optional[float] = ..., lower: _Optional[float] = ..., upper: _Optional[float] = ..., effective_tries: _Optional[float] = ...) -> None: ...

class DraftEstimate(_message.Message):
    __slots__ = ("draft", "positions", "expected_tokens", "changes_detected", "verified_drafts")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_DETECTED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    draft: str
    positions: _containers.RepeatedCompositeFieldContainer[PositionEstimate]
    expected_tokens: _containers.RepeatedScalarFieldContainer[float]
    changes_detected: int
    verified_drafts: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, draft: _Optional[str] = ..., positions: _Optional[_Iterable[_Union[PositionEstimate, _Mapping]]] = ..., expected_tokens: _Optional[_Iterable[float]] = ..., changes_detected: _Optional[int] = ..., verified_drafts: _Optional[_Iterable[float]] = ...) -> None: ...

class Override(_message.Message):
    __slots__ = ("traffic_class", "pin_k", "force_draft", "force_off", "note", "set_unix_seconds", "scope", "set_by")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    PIN_K_FIELD_NUMBER: _ClassVar[int]
    FORCE_DRAFT_FIELD_NUMBER: _ClassVar[int]
    FORCE_OFF_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    SET_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SET_BY_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    pin_k: int
    force_draft: str
    force_off: bool
    note: str
    set_unix_seconds: float
    scope: OverrideScope
    set_by: str
    def __init__(self, traffic_class: _Optional[str] = ..., pin_k: _Optional[int] = ..., force_draft: _Optional[str] = ..., force_off: _Optional[bool] = ..., note: _Optional[str] = ..., set_unix_seconds: _Optional[float] = ..., scope: _Optional[_Union[OverrideScope, str]] = ..., set_by: _Optional[str] = ...) -> None: ...

class ClassPolicy(_message.Message):
    __slots__ = ("traffic_class", "decisions", "estimates", "overrides", "offline", "batch_share", "measured_tokens_per_step", "measured_speedup")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SHARE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    decisions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Decision]
    estimates: _containers.RepeatedCompositeFieldContainer[DraftEstimate]
    overrides: _containers.RepeatedCompositeFieldContainer[Override]
    offline: bool
    batch_share: float
    measured_tokens_per_step: float
    measured_speedup: float
    def __init__(self, traffic_class: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[_common_pb2.Decision, _Mapping]]] = ..., estimates: _Optional[_Iterable[_Union[DraftEstimate, _Mapping]]] = ..., overrides: _Optional[_Iterable[_Union[Override, _Mapping]]] = ..., offline: _Optional[bool] = ..., batch_share: _Optional[float] = ..., measured_tokens_per_step: _Optional[float] = ..., measured_speedup: _Optional[float] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "model", "running_requests", "report_age_seconds", "policy_version_applied", "hardware", "versions_behind")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REPORT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_APPLIED_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_BEHIND_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    running_requests: int
    report_age_seconds: float
    policy_version_applied: int
    hardware: str
    versions_behind: int
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., running_requests: _Optional[int] = ..., report_age_seconds: _Optional[float] = ..., policy_version_applied: _Optional[int] = ..., hardware: _Optional[str] = ..., versions_behind: _Optional[int] = ...) -> None: ...

class GetPolicyResponse(_message.Message):
    __slots__ = ("version", "batch_bucket_upper_bounds", "classes", "engines", "engine_status", "measured_batch_buckets")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_BUCKET_UPPER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATUS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BATCH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    version: int
    batch_bucket_upper_bounds: _containers.RepeatedScalarFieldContainer[int]
    classes: _containers.RepeatedCompositeFieldContainer[ClassPolicy]
    engines: _containers.RepeatedScalarFieldContainer[str]
    engine_status: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    measured_batch_buckets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., batch_bucket_upper_bounds: _Optional[_Iterable[int]] = ..., classes: _Optional[_Iterable[_Union[ClassPolicy, _Mapping]]] = ..., engines: _Optional[_Iterable[str]] = ..., engine_status: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., measured_batch_buckets: _Optional[_Iterable[int]] = ...) -> None: ...

class SetOverrideRequest(_message.Message):
    __slots__ = ("override",)
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    override: Override
    def __init__(self, override: _Optional[_Union[Override, _Mapping]] = ...) -> None: ...

class SetOverrideResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class ClearOverrideRequest(_message.Message):
    __slots__ = ("traffic_class", "scope")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    scope: OverrideScope
    def __init__(self, traffic_class: _Optional[str] = ..., scope: _Optional[_Union[OverrideScope, str]] = ...) -> None: ...

class ClearOverrideResponse(_message.Message):
    __slots__ = ("policy_version", "cleared")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    cleared: bool
    def __init__(self, policy_version: _Optional[int] = ..., cleared: _Optional[bool] = ...) -> None: ...

class WatchDecisionsRequest(_message.Message):
    __slots__ = ("traffic_class",)
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    def __init__(self, traffic_class: _Optional[str] = ...) -> None: ...

class WatchDecisionsResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _common_pb2.DecisionEvent
    def __init__(self, event: _Optional[_Union[_common_pb2.DecisionEvent, _Mapping]] = ...) -> None: ...

class ExplainDecisionRequest(_message.Message):
    __slots__ = ("traffic_class", "batch_bucket")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    BATCH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    batch_bucket: int
    def __init__(self, traffic_class: _Optional[str] = ..., batch_bucket: _Optional[int] = ...) -> None: ...

class ArmScore(_message.Message):
    __slots__ = ("draft", "k", "expected_tokens", "step_seconds", "goodput_tokens_per_second", "speedup", "too_little_evidence")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    TOO_LITTLE_EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    draft: str
    k: int
    expected_tokens: float
    step_seconds: float
    goodput_tokens_per_second: float
    speedup: float
    too_little_evidence: bool
    def __init__(self, draft: _Optional[str] = ..., k: _Optional[int] = ..., expected_tokens: _Optional[float] = ..., step_seconds: _Optional[float] = ..., goodput_tokens_per_second: _Optional[float] = ..., speedup: _Optional[float] = ..., too_little_evidence: _Optional[bool] = ...) -> None: ...

class ExplainDecisionResponse(_message.Message):
    __slots__ = ("decision", "arms", "text", "batch_size")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    decision: _common_pb2.Decision
    arms: _containers.RepeatedCompositeFieldContainer[ArmScore]
    text: str
    batch_size: int
    def __init__(self, decision: _Optional[_Union[_common_pb2.Decision, _Mapping]] = ..., arms: _Optional[_Iterable[_Union[ArmScore, _Mapping]]] = ..., text: _Optional[str] = ..., batch_size: _Optional[int] = ...) -> None: ...

class GetRecommendationsRequest(_message.Message):
    __slots__ = ("traffic_class",)
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    def __init__(self, traffic_class: _Optional[str] = ...) -> None: ...

class RecommendedOption(_message.Message):
    __slots__ = ("pool", "draft", "k", "goodput_tokens_per_second", "tries", "sidecars", "cost_steps")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TRIES_FIELD_NUMBER: _ClassVar[int]
    SIDECARS_FIELD_NUMBER: _ClassVar[int]
    COST_STEPS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    draft: str
    k: int
    goodput_tokens_per_second: float
    tries: float
    sidecars: int
    cost_steps: float
    def __init__(self, pool: _Optional[str] = ..., draft: _Optional[str] = ..., k: _Optional[int] = ..., goodput_tokens_per_second: _Optional[float] = ..., tries: _Optional[float] = ..., sidecars: _Optional[int] = ..., cost_steps: _Optional[float] = ...) -> None: ...

class ClassRecommendation(_message.Message):
    __slots__ = ("traffic_class", "batch_bucket", "batch_size", "draft", "pool", "options")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    BATCH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    batch_bucket: int
    batch_size: int
    draft: str
    pool: str
    options: _containers.RepeatedCompositeFieldContainer[RecommendedOption]
    def __init__(self, traffic_class: _Optional[str] = ..., batch_bucket: _Optional[int] = ..., batch_size: _Optional[int] = ..., draft: _Optional[str] = ..., pool: _Optional[str] = ..., options: _Optional[_Iterable[_Union[RecommendedOption, _Mapping]]] = ...) -> None: ...

class GetRecommendationsResponse(_message.Message):
    __slots__ = ("classes", "computed_unix_seconds")
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    classes: _containers.RepeatedCompositeFieldContainer[ClassRecommendation]
    computed_unix_seconds: float
    def __init__(self, classes: _Optional[_Iterable[_Union[ClassRecommendation, _Mapping]]] = ..., computed_unix_seconds: _Optional[float] = ...) -> None: ...
