"""Worker side of per-token confidence: the draft's probability of each token it proposes,
captured where the drafter computes it and handed to the scheduler with the draft tokens.

vLLM's model drafters (EAGLE heads, draft models: ``SpecDecodeBaseProposer``) draft each position
with ``_sample_draft_tokens``: greedy drafting takes the argmax of the logits
(``_greedy_sample``), probabilistic drafting samples from probabilities it also returns. The
wrappers note, per position, the probability of the proposed token (under greedy drafting the
largest one), in the steps specpilot's scheduler marked (:func:`capture`, called by the runner's
``propose_draft_token_ids`` wrapper in ``worker_patch``: a plain vLLM scheduler's steps cost
nothing); the step's positions are gathered as a (requests x K) tensor and the runner's
``take_draft_token_ids`` attaches them, as plain lists in the rows' order, to the
``DraftTokenIds`` it returns (:data:`CONFIDENCE_ATTR`: a plain instance attribute, which
survives pickling to another process). Reading the logits changes no token. Drafters with local
argmax reduction or a vocabulary mapping report none, nor do n-gram and suffix drafters. After
each pass the ``_sample_draft_tokens`` wrapper hands the pass to the step's drafter stop, where
one is set (``drafter_stop``).

:func:`install_confidence_capture` is idempotent, version-guarded and never raises.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from specpilot.engine_plugin.vllm_compat import method_parameters

log = logging.getLogger("specpilot.plugin")

CONFIDENCE_ATTR = "specpilot_draft_confidences"
"""On a DraftTokenIds: per request (``req_ids`` order), the draft's probability of each token it
proposed, position 1 first."""
NOTES_ATTR = "_specpilot_confidence_notes"  # on a proposer: the capture's per-position tensors
# On a proposer, while a step's drafter stop runs (``drafter_stop``): called after each pass.
PASS_HOOK_ATTR = "_specpilot_after_pass"
_LAST = "_specpilot_last_confidences"  # on a proposer: the last capture's (requests x K)
_PATCHED = "__specpilot_confidence__"
_announced: list[bool] = []  # the warning below, once per process

PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
# (class, method, the leading parameters the wrappers rely on), read from vLLM 0.32's source.
NEEDED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (PROPOSER, "_greedy_sample", ("self", "hidden_states")),
    (PROPOSER, "_sample_draft_tokens", ("self", "hidden_states", "sampling_metadata")),
    (RUNNER, "take_draft_token_ids", ("self",)),
)


def _note(proposer: Any, confidence: Any) -> None:
    notes = getattr(proposer, NOTES_ATTR, None)
    if notes is not None:
        notes.append(confidence.detach().float().cpu())


def _wrap_greedy_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _greedy_sample(self: Any, hidden_states: Any) -> Any:
        if (getattr(self, NOTES_ATTR, None) is None or self.use_local_argmax_reduction
                or self.use_heterogeneous_vocab):
            return original(self, hidden_states)
        import torch

        # vLLM's own default branch (the argmax of the logits), with the logits kept: the
        # largest probability is exp(max - logsumexp), no softmax over the vocabulary stored.
        logits = self.model.compute_logits(hidden_states)
        top = logits.amax(dim=-1).float()
        _note(self, torch.exp(top - torch.logsumexp(logits.float(), dim=-1)))
        return logits.argmax(dim=-1)

    setattr(_greedy_sample, _PATCHED, True)
    return _greedy_sample


def _wrap_sample_draft_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _sample_draft_tokens(self: Any, hidden_states: Any, sampling_metadata: Any,
                             *args: Any, **kwargs: Any) -> Any:
        tokens, probs = original(self, hidden_states, sampling_metadata, *args, **kwargs)
        if probs is not None:  # probabilistic drafting: the sampled token's own probability
            _note(self, probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1))
        hook = getattr(self, PASS_HOOK_ATTR, None)
        if hook is not None:  # may end the draft loop here (drafter_stop)
            hook.after_pass(tokens, probs)
        return tokens, probs

    setattr(_sample_draft_tokens, _PATCHED, True)
    return _sample_draft_tokens


@contextmanager
def capture(drafter: Any) -> Iterator[None]:
    """Note the confidences of the positions ``drafter`` drafts inside the block, and keep them,
    one row per request, for the runner's next ``take_draft_token_ids`` (nothing kept where the
    positions do not line up: a drafter that drafts all positions in one pass)."""
    setattr(drafter, NOTES_ATTR, [])
    try:
        yield
    finally:
        notes = getattr(drafter, NOTES_ATTR, None) or []
        setattr(drafter, NOTES_ATTR, None)
        last = None
        if len({tuple(n.shape) for n in notes}) == 1 and notes[0].dim() == 1:
            import torch

            last = torch.stack(notes, dim=1)
        setattr(drafter, _LAST, last)


def _wrap_take(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def take_draft_token_ids(self: Any) -> Any:
        out = original(self)
        drafter = getattr(self, "drafter", None)
        last = getattr(drafter, _LAST, None)
        if last is not None:
            setattr(drafter, _LAST, None)  # one step's, taken once
            if out is not None and last.shape[0] >= len(out.req_ids):
                setattr(out, CONFIDENCE_ATTR, last[:len(out.req_ids)].tolist())
        return out

    setattr(take_draft_token_ids, _PATCHED, True)
    return take_draft_token_ids


_WRAPPERS: Mapping[tuple[str, str], Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    (PROPOSER, "_greedy_sample"): _wrap_greedy_sample,
    (PROPOSER, "_sample_draft_tokens"): _wrap_sample_draft_tokens,
    (RUNNER, "take_draft_token_ids"): _wrap_take,
}


def _classes() -> tuple[dict[str, type], str]:
    found: dict[str, type] = {}
    for path, name, params in NEEDED:
        if path not in found:
            module, _, attr = path.partition(":")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except Exception as exc:
                return {}, f"cannot import {path} ({exc!r})"
            found[path] = cls
        have = method_parameters(found[path], name)
        if have is None or have[:len(params)] != params:
            return {}, f"{path}.{name}{params} not found (have {have})"
    return found, ""


def install_confidence_capture() -> bool:
    """Wrap the drafters' sampling and the runner's hand-over in this process; True when in
    place. Idempotent; logs once and returns False when vLLM's internals differ; never raises."""
    try:
        classes, why = _classes()
        if not classes:
            if not _announced:
                _announced.append(True)
                log.warning("specpilot: draft confidences not captured (%s): tokens are "
                            "calibrated by class and position only", why)
            return False
        for (path, name), wrap in _WRAPPERS.items():
            method = getattr(classes[path], name)
            if not getattr(method, _PATCHED, False):
                setattr(classes[path], name, wrap(method))
        return True
    except Exception:
        log.exception("specpilot: failed to install the draft-confidence capture")
        return False


def confidence_capture_installed() -> bool:
    classes, _ = _classes()
    return bool(classes) and all(getattr(getattr(classes[path], name), _PATCHED, False)
                                 for path, name in _WRAPPERS)
