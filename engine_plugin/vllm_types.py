"""The attributes of vLLM's objects the plugin reads (and the one it writes), as ``Protocol``s.

The pilot (pilot.py) is typed against these, not against vLLM, so it imports no vLLM module and
its tests can pass plain fakes. The scheduler subclasses (scheduler.py) hand in vLLM's own objects,
which mypy then checks against these protocols: a renamed or retyped attribute in a new vLLM
release fails type checking, not a request in production. Names as of vLLM 0.32:
``vllm/v1/request.py`` (``Request``), ``vllm/v1/core/sched/output.py`` (``SchedulerOutput``),
``vllm/v1/outputs.py`` (``ModelRunnerOutput``), ``vllm/config/`` (``VllmConfig`` and its parts).

Members are read-only properties unless the plugin assigns them, so a vLLM attribute or property
of a narrower type satisfies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


# --- requests (vllm/v1/request.py) -------------------------------------------------------------
class SamplingParamsLike(Protocol):
    @property
    def extra_args(self) -> Mapping[str, Any] | None: ...
    # What transforms the target's sampling (``pilot.transforms_sampling``).
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def logit_bias(self) -> Mapping[int, float] | None: ...
    @property
    def allowed_token_ids(self) -> Sequence[int] | None: ...
    @property
    def bad_words(self) -> Sequence[str] | None: ...


class LoRARequestLike(Protocol):
    @property
    def lora_name(self) -> str: ...


class RequestLike(Protocol):
    """``vllm.v1.request.Request``."""

    # Assigned: the pilot cuts or replaces a request's drafts.
    spec_token_ids: list[int]

    @property
    def request_id(self) -> str: ...
    @property
    def sampling_params(self) -> SamplingParamsLike | None: ...
    @property
    def lora_request(self) -> LoRARequestLike | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def is_prefill_chunk(self) -> bool: ...
    # Tokens in the request's KV cache (the context its next step's attention reads).
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def use_structured_output(self) -> bool: ...
    # Wall-clock time (time.time()) the request arrived, seconds.
    @property
    def arrival_time(self) -> float: ...
    def is_finished(self) -> bool: ...


# --- one engine step (vllm/v1/core/sched/output.py, vllm/v1/outputs.py) ------------------------
class SchedulerOutputLike(Protocol):
    """``vllm.v1.core.sched.output.SchedulerOutput``."""

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...
    @property
    def total_num_scheduled_tokens(self) -> int: ...
    @property
    def scheduled_spec_decode_tokens(self) -> Mapping[str, Sequence[int]]: ...
    @property
    def num_invalid_spec_tokens(self) -> Mapping[str, int] | None: ...
    # Drafts per sequence the drafter was asked for (the largest K scheduled).
    @property
    def num_spec_tokens_to_schedule(self) -> int: ...
    # The step's requests with the tokens their KV caches held when it was scheduled.
    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestDataLike]: ...
    @property
    def scheduled_cached_reqs(self) -> CachedRequestDataLike: ...


class NewRequestDataLike(Protocol):
    """``vllm.v1.core.sched.output.NewRequestData``."""

    @property
    def num_computed_tokens(self) -> int: ...


class CachedRequestDataLike(Protocol):
    """``vllm.v1.core.sched.output.CachedRequestData``."""

    @property
    def num_computed_tokens(self) -> Sequence[int]: ...


class ModelRunnerOutputLike(Protocol):
    """``vllm.v1.outputs.ModelRunnerOutput``."""

    @property
    def sampled_token_ids(self) -> Sequence[Sequence[int]]: ...
    @property
    def req_id_to_index(self) -> Mapping[str, int]: ...


# --- the engine's configuration (vllm/config/) -------------------------------------------------
class SpeculativeConfigLike(Protocol):
    """``vllm.config.SpeculativeConfig`` (``EngineSpec.from_vllm`` reads ``draft_sample_method``
    and ``prompt_lookup_min``/``_max`` with a default, as it does without speculation)."""

    @property
    def method(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...


class ModelConfigLike(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def served_model_name(self) -> str | list[str] | None: ...
    @property
    def tokenizer(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def dtype(self) -> object: ...  # a torch.dtype


class ParallelConfigLike(Protocol):
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def pipeline_parallel_size(self) -> int: ...


class SchedulerConfigLike(Protocol):
    @property
    def async_scheduling(self) -> bool | None: ...
    @property
    def max_num_seqs(self) -> int: ...


class VllmConfigLike(Protocol):
    """``vllm.config.VllmConfig``."""

    @property
    def speculative_config(self) -> SpeculativeConfigLike | None: ...
    @property
    def model_config(self) -> ModelConfigLike: ...
    @property
    def scheduler_config(self) -> SchedulerConfigLike: ...
    @property
    def parallel_config(self) -> ParallelConfigLike: ...
    @property
    def num_speculative_tokens(self) -> int: ...
