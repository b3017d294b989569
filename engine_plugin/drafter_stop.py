"""The drafter's early stop, worker side: a model drafter (EAGLE head, draft model) stops after
the pass where the policy's ``DrafterStop`` says no further pass pays, so fewer sequential
passes run and every request gets a draft list as long as the passes run.

The scheduler puts a :class:`StopPlan` on a step's ``SchedulerOutput`` (:func:`mark_stop`; the
pilot's ``plan_drafter_stop``) for the drafts proposed at the end of that step: per scheduled
request its calibration rows (None: not priced) and the K its decision asks of the drafter, and
the bucket's prices. The runner's ``propose_draft_token_ids`` wrapper (``worker_patch``) builds
the step's ``DrafterStop`` in the drafter's row order (the input batch's) and hangs it on the
proposer (:func:`stopping`). The confidence capture's ``_sample_draft_tokens`` wrapper
(``draft_confidence``) calls it after each pass with the pass's tokens; it asks the stop with
the pass's confidences and, where no pass pays, raises a private exception out of vLLM's draft
loop (``SpecDecodeBaseProposer.propose``: ``for token_index in range(num_speculative_tokens -
1)``), caught by a wrapper of ``propose`` that returns what a call asking for that many passes
returns: the passes' tokens stacked ([requests, passes]) and, under probabilistic drafting,
their probabilities as ``_last_draft_probs``.

Why that is safe, from vLLM 0.32's source: the exception leaves ``_sample_draft_tokens`` outside
every forward context, and the state the loop leaves behind is that of a call with ``K =
passes`` (the runner already handles any width, down to 0: ``_copy_draft_token_ids_to_cpu`` and
``take_draft_token_ids`` read the tensor's own width, ``_get_spec_decode_draft_probs`` the
scheduled drafts' count). The first pass always runs (it writes the step's tokens into the
drafter's KV), and the stop only shortens: it never runs more passes than asked. Sync scheduling
only: with async scheduling the scheduler places K placeholders before the drafts exist, so the
pilot never plans a stop there.

:func:`install_drafter_stop` is idempotent, version-guarded and never raises; a step without a
plan costs one attribute read.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specpilot.contract.records import CalibrationRows
from specpilot.engine_plugin.draft_confidence import NOTES_ATTR, PASS_HOOK_ATTR, PROPOSER
from specpilot.engine_plugin.policy.cut import DrafterStop
from specpilot.engine_plugin.vllm_compat import method_parameters

if TYPE_CHECKING:
    import torch

__all__ = [
    "STOP_ATTR",
    "StopPlan",
    "drafter_stop_installed",
    "install_drafter_stop",
    "mark_stop",
    "stopping",
]

log = logging.getLogger("specpilot.plugin")

STOP_ATTR = "specpilot_drafter_stop"
"""On a SchedulerOutput: the :class:`StopPlan` for the drafts proposed at the end of its step."""
_PATCHED = "__specpilot_stop__"
_METHOD = "propose"  # of PROPOSER: the draft loop the stop leaves
_state: dict[str, bool] = {}
# What ``propose`` must hold for the stop to leave it as a shorter call would (vLLM 0.32).
_PROPOSE_PARAMS = ("self", "num_speculative_tokens")
_PROPOSE_NAMES = ("_sample_draft_tokens", "_last_draft_probs", "num_speculative_tokens",
                  "parallel_drafting")


@dataclass(frozen=True)
class StopPlan:
    """One step's stop, plain data (it travels pickled to a worker process)."""

    min_survival: float
    pass_tokens: float
    # Per scheduled request id: its calibration rows (None: not priced) and the K asked.
    requests: Mapping[str, tuple[CalibrationRows | None, int]]


def mark_stop(output: Any, plan: StopPlan | None) -> None:
    """Put (or clear) the stop plan on a SchedulerOutput (scheduler side)."""
    setattr(output, STOP_ATTR, plan)


def _failed(what: str) -> None:
    """Log an unexpected failure with its traceback once per process, then quietly: it would
    recur every step."""
    if _state.get("failure_logged"):
        log.debug("specpilot: %s", what, exc_info=True)
    else:
        _state["failure_logged"] = True
        log.exception("specpilot: %s (logged once)", what)


class _Stopped(Exception):
    """Out of vLLM's draft loop, to the ``propose`` wrapper."""


class _Run:
    """One ``propose`` call under a stop: the passes' tokens (and probabilities) so far."""

    def __init__(self, proposer: Any, stop: DrafterStop, rows: int) -> None:
        self.proposer = proposer
        self.stop = stop
        self.rows = rows
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.blind = False  # a pass without its confidences: the drafter runs on

    def after_pass(self, tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Called by the ``_sample_draft_tokens`` wrapper after each pass; raises
        :class:`_Stopped` where no further pass pays."""
        self.tokens.append(tokens)
        if probs is not None:
            self.probs.append(probs)
        if self.blind:
            return
        try:
            proposer, passes = self.proposer, len(self.tokens)
            notes = getattr(proposer, NOTES_ATTR, None) or []
            if (proposer.parallel_drafting or tokens.dim() != 1
                    or len(notes) != passes or notes[-1].shape[0] < self.rows):
                self.blind = True
                return
            if passes >= proposer.num_speculative_tokens:
                return  # the last pass asked: nothing to stop
            go_on = self.stop.after_pass(notes[-1][:self.rows].tolist())
        except Exception:
            _failed("the drafter's stop failed; this step drafts in full")
            self.blind = True
            return
        if not go_on:
            raise _Stopped

    def result(self) -> torch.Tensor:
        """What a ``propose`` asking for the passes run returns, and its cached state."""
        import torch

        proposer = self.proposer
        proposer.num_speculative_tokens = len(self.tokens)
        if self.probs:
            proposer._last_draft_probs = torch.stack(self.probs, dim=1).contiguous()
        return torch.stack(self.tokens, dim=1)


def _plan_stop(output: Any, req_ids: Sequence[str]) -> DrafterStop | None:
    plan = getattr(output, STOP_ATTR, None)
    if not isinstance(plan, StopPlan):
        return None
    # A request the plan does not name (none should be) is drafted as asked.
    asked = (None, int(output.num_spec_tokens_to_schedule))
    return DrafterStop([plan.requests.get(r, asked) for r in req_ids],
                       plan.min_survival, plan.pass_tokens)


@contextmanager
def stopping(runner: Any, output: Any) -> Iterator[None]:
    """Inside the block the runner's drafter stops early as the plan on ``output`` says (rows
    in the input batch's order); nothing where the step carries no plan or the stop is not
    installed."""
    run, drafter = None, None
    try:
        if getattr(output, STOP_ATTR, None) is not None and _state.get("installed"):
            req_ids = list(runner.input_batch.req_ids)
            stop = _plan_stop(output, req_ids)
            if stop is not None:
                drafter = runner.drafter
                run = _Run(drafter, stop, len(req_ids))
                setattr(drafter, PASS_HOOK_ATTR, run)
    except Exception:
        _failed("could not set up the drafter's stop; this step drafts in full")
        run = None
    try:
        yield
    finally:
        if run is not None:
            setattr(drafter, PASS_HOOK_ATTR, None)


def _wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = getattr(self, PASS_HOOK_ATTR, None)
        if not isinstance(run, _Run):
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        except _Stopped:
            return run.result()

    setattr(propose, _PATCHED, True)
    return propose


def _proposer_class() -> tuple[type | None, str]:
    module, _, attr = PROPOSER.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as exc:
        return None, f"cannot import {PROPOSER} ({exc!r})"
    have = method_parameters(cls, _METHOD)
    if have is None or have[:len(_PROPOSE_PARAMS)] != _PROPOSE_PARAMS:
        return None, f"{PROPOSER}.propose{_PROPOSE_PARAMS} not found (have {have})"
    code = getattr(inspect.unwrap(vars(cls)[_METHOD]), "__code__", None)
    missing = [n for n in _PROPOSE_NAMES if n not in getattr(code, "co_names", ())]
    if missing:
        return None, f"{PROPOSER}.propose does not use {missing}"
    return cls, ""


def install_drafter_stop() -> bool:
    """Wrap the proposer's ``propose`` in this process (the confidence capture must be in place:
    it calls the stop after each pass); True when in place. Idempotent; logs once and returns
    False when vLLM's internals differ; never raises."""
    try:
        cls, why = _proposer_class()
        if cls is None:
            if not _state.get("announced"):
                _state["announced"] = True
                log.warning("specpilot: the drafter's early stop is off (%s): the drafter runs "
                            "every pass asked", why)
            _state["installed"] = False
            return False
        propose = getattr(cls, _METHOD)
        if not getattr(propose, _PATCHED, False):
            setattr(cls, _METHOD, _wrap_propose(propose))
        _state["installed"] = True
        return True
    except Exception:
        log.exception("specpilot: failed to install the drafter's early stop")
        _state["installed"] = False
        return False


def drafter_stop_installed() -> bool:
    cls, _ = _proposer_class()
    return (cls is not None and getattr(getattr(cls, _METHOD), _PATCHED, False) is True
            and bool(_state.get("installed")))
