"""The engine core's patch (``core_patch``): after a step, drafts the scheduler knows are taken
from it; otherwise, and for a plain vLLM scheduler, the worker is asked as vLLM does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from specpilot.engine_plugin import core_patch
from specpilot.engine_plugin.core_patch import KNOWN_DRAFTS_METHOD


class Scheduler:
    def __init__(self, known: Any) -> None:
        self.known = known
        self.updates: list[Any] = []

    def specpilot_known_draft_token_ids(self) -> Any:
        return self.known

    def update_draft_token_ids(self, drafts: Any) -> None:
        self.updates.append(drafts)


class PlainScheduler:
    def __init__(self) -> None:
        self.updates: list[Any] = []

    def update_draft_token_ids(self, drafts: Any) -> None:
        self.updates.append(drafts)


def engine_core(scheduler: Any, *, spec: bool = True, async_on: bool = False) -> Any:
    asked: list[bool] = []

    def original(self: Any, model_executed: bool) -> None:  # vLLM's: asks the worker
        asked.append(model_executed)
        if model_executed and self.check_for_draft_tokens and not self.async_scheduling:
            self.scheduler.update_draft_token_ids("from the worker")

    core = SimpleNamespace(scheduler=scheduler, check_for_draft_tokens=spec,
                           async_scheduling=async_on, asked=asked)
    core.post_step = core_patch._wrap_post_step(original).__get__(core)
    return core


def test_the_method_name_is_the_schedulers() -> None:
    from specpilot.engine_plugin.scheduler import SpecPilotScheduler

    assert callable(getattr(SpecPilotScheduler, KNOWN_DRAFTS_METHOD))


def test_known_drafts_are_handed_over_without_asking_the_worker() -> None:
    core = engine_core(Scheduler(known="empty drafts"))
    core.post_step(True)
    assert core.scheduler.updates == ["empty drafts"]
    assert core.asked == []


@pytest.mark.parametrize("case", ["unknown", "plain", "not executed", "async", "no spec"])
def test_otherwise_the_worker_is_asked_as_vllm_does(case: str) -> None:
    scheduler = PlainScheduler() if case == "plain" else Scheduler(
        known=None if case == "unknown" else "empty drafts")
    core = engine_core(scheduler, spec=case != "no spec", async_on=case == "async")
    core.post_step(case != "not executed")
    assert len(core.asked) == 1
    worker = case in ("unknown", "plain")
    assert scheduler.updates == (["from the worker"] if worker else [])


def test_installed_once_on_the_real_engine_core() -> None:
    pytest.importorskip("vllm")
    assert core_patch.install_core_patch()
    assert core_patch.install_core_patch()  # idempotent
    from vllm.v1.engine.core import EngineCore

    assert core_patch.core_patch_installed()
    inner = getattr(EngineCore.post_step, "__wrapped__", None)
    assert inner is not None  # vLLM's own, wrapped once
    assert not getattr(inner, "__specpilot_patched__", False)
