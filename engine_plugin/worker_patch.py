"""Worker-side patches of vLLM's model runner: no drafter tax, exact n-gram rows under
probabilistic drafting (and, installed with them, the draft-confidence capture,
``draft_confidence``, and the drafter's early stop, ``drafter_stop``, which the runner's
``propose_draft_token_ids`` wrapper sets up for each marked step).

The scheduler (scheduler.py) marks each ``SchedulerOutput`` it builds (:func:`mark_step`); the
worker reads the marks. In-process the worker sees the same object; across processes the marks
travel with it (plain instance attributes survive pickling). A plain vLLM scheduler never sets
them, so the patches then change nothing.

1. **No drafter tax** (``GPUModelRunner.propose_draft_token_ids``, which ``CPUModelRunner``
   inherits). vLLM runs the drafter's first forward every step, even when the step's batch K
   (``num_spec_tokens_to_schedule``) is 0 (``v1/spec_decode/llm_base_proposer.py``: "already ran
   to keep the drafter KV cache in sync"). In a decode-only step the scheduler marked
   (:data:`SKIP_ATTR`: the plugin's batch modes, every running request off or on substituted
   n-gram drafts) and whose batch K is 0, the wrapper returns one empty draft list per request
   (what the K=0 path yields, through the list branch of ``_copy_draft_token_ids_to_cpu`` /
   ``take_draft_token_ids``) and clears the cached draft probabilities as the original does. A
   step that prefills is never skipped: its first pass writes the prompt into the drafter's KV.
   The skipped positions stay holes in the drafter's KV cache (zeroed blocks on CPU); later
   drafts attend to them, which costs acceptance, never correctness (verification is lossless).
   A drafter without KV (vLLM's n-gram and suffix proposers) is skipped in any step, prefill
   included and in every K mode, where no scheduled request takes its drafts
   (:data:`IDLE_ATTR`: every one's class off): its proposal would be cut whole. So is a model
   drafter where every scheduled request was admitted off (never to be drafted for: its KV
   holes are never read). A drafter that learns from the responses it sees (vLLM's suffix
   proposer, whose cache of past responses drafts for later requests) keeps learning in such
   a step and drafts nothing (:func:`learning_only`), so a busy period's responses still draft
   in the quiet one after it.
2. **Deterministic rows** (``GPUModelRunner._get_spec_decode_draft_probs``). With
   ``draft_sample_method="probabilistic"`` rejection sampling divides by the drafter's
   probabilities. A request whose drafts the plugin replaced by n-gram tokens
   (:data:`DETERMINISTIC_ATTR`) must be verified against one-hot probabilities at those tokens
   to stay exact; its rows are rebuilt so, at the draft's own length (batch_max lengthens n-gram
   drafts past what the drafter drafted). Other rows keep the drafter's probabilities. When the
   drafter cached none (greedy drafting, or a skipped pass) vLLM already treats every row as
   one-hot and nothing changes. ``execute_model`` is wrapped only to hand the step's marks to
   the sampler (``_sample`` does not see the scheduler output).
3. **Off is free in the sampler** (``GPUModelRunner._sample``). A speculative engine sends every
   step through the rejection sampler, drafts or not; with any sampled (T > 0) request in the
   batch it draws exponential noise over the whole batch x vocabulary for recovered tokens,
   and it samples the bonus tokens through extra copies of the logits. In a step of the
   plugin's scheduler where no request has a draft (every K 0: speculation off), the logits
   hold one row per request, exactly as without speculation, and the wrapper hands them to
   the plain sampler: the same tokens under greedy decoding, the target's distribution when
   sampling, the output shape the runner's bookkeeping takes for a step without drafts.

:func:`install_worker_patches` is idempotent, version-guarded (it checks the exact methods and
parameters it relies on) and never raises: when the internals are missing it logs one line and
leaves vLLM as it is.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from specpilot.engine_plugin.draft_confidence import capture, install_confidence_capture
from specpilot.engine_plugin.drafter_stop import install_drafter_stop, stopping
from specpilot.engine_plugin.vllm_compat import is_supported, method_parameters, vllm_version

if TYPE_CHECKING:
    import torch

__all__ = [
    "DETERMINISTIC_ATTR",
    "IDLE_ATTR",
    "SKIP_ATTR",
    "deterministic_draft_probs",
    "draft_free",
    "install_worker_patches",
    "is_decode_only",
    "learning_cache",
    "learning_only",
    "mark_step",
    "patches_applicable",
    "patches_installed",
    "should_skip_drafter",
]

log = logging.getLogger("specpilot.plugin")

SKIP_ATTR = "specpilot_skip_idle_drafter"
"""On a SchedulerOutput: True when the plugin allows skipping the drafter in this step."""
IDLE_ATTR = "specpilot_idle_drafter"
"""On a SchedulerOutput: True when no request of the step takes the drafter's drafts (every one
off; for a model drafter, admitted off for life): its proposal is skipped outright."""
DETERMINISTIC_ATTR = "specpilot_deterministic_drafts"
"""On a SchedulerOutput: the ids of requests whose scheduled drafts are deterministic (n-gram)."""
_STEP_ATTR = "_specpilot_deterministic"  # on the runner: the current step's deterministic ids
_MARKED_ATTR = "_specpilot_marked"  # on the runner: the current step came from the plugin
_PATCHED = "__specpilot_patched__"

_RUNNER = "vllm.v1.worker.gpu_model_runner"
# (method, the leading parameters the wrappers rely on), read from vLLM 0.32's source.
_NEEDED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("propose_draft_token_ids", ("self", "scheduler_output", "sampled_token_ids")),
    ("_get_spec_decode_draft_probs", ("self", "spec_decode_metadata")),
    ("execute_model", ("self", "scheduler_output")),
    ("_sample", ("self", "logits", "spec_decode_metadata")),
)
_lock = threading.Lock()
_state: dict[str, bool] = {}


def mark_step(output: Any, *, skip_drafter: bool, deterministic: Collection[str],
              idle_drafter: bool = False) -> None:
    """Set the plugin's marks on a SchedulerOutput (scheduler side)."""
    setattr(output, SKIP_ATTR, skip_drafter)
    setattr(output, DETERMINISTIC_ATTR, frozenset(deterministic))
    setattr(output, IDLE_ATTR, idle_drafter)


def is_decode_only(output: Any) -> bool:
    """Whether every scheduled token is a request's one new token or one of its drafts."""
    drafts = sum(len(d) for d in output.scheduled_spec_decode_tokens.values())
    return int(output.total_num_scheduled_tokens) <= len(output.num_scheduled_tokens) + drafts


def should_skip_drafter(output: Any) -> bool:
    """The drafter's pass may be skipped: marked idle by the plugin (a drafter without state per
    sequence that no scheduled request takes drafts from), or marked by it with batch K 0 in a
    decode-only step."""
    if getattr(output, IDLE_ATTR, False) is True:
        return True
    return (getattr(output, SKIP_ATTR, False) is True
            and output.num_spec_tokens_to_schedule == 0 and is_decode_only(output))


def deterministic_draft_probs(
    draft_probs: torch.Tensor,
    prob_req_ids: Sequence[str],
    req_ids: Sequence[str],
    num_draft_tokens: Sequence[int],
    draft_token_ids: torch.Tensor,
    deterministic: Collection[str],
) -> torch.Tensor | None:
    """The draft-probability rows rejection sampling needs, one per scheduled draft token in
    batch order (``req_ids`` with ``num_draft_tokens``; ``draft_token_ids`` flat, same order).

    Rows of requests in ``deterministic`` are one-hot at their draft tokens (any length); others
    are the drafter's ``draft_probs[row, :n]`` (``row`` from ``prob_req_ids``). None when a
    drafter row is missing (vLLM then verifies every row as one-hot, as its own method does) or
    when no request drafted.
    """
    import torch

    row_by_req = {req_id: i for i, req_id in enumerate(prob_req_ids)}
    rows: list[torch.Tensor] = []
    offset = 0
    vocab = draft_probs.shape[-1]
    for req_id, n in zip(req_ids, num_draft_tokens, strict=False):
        if n == 0:
            continue
        if req_id in deterministic:
            tokens = draft_token_ids[offset:offset + n].to(torch.int64)
            one_hot = torch.zeros((n, vocab), dtype=draft_probs.dtype, device=draft_probs.device)
            rows.append(one_hot.scatter_(1, tokens.unsqueeze(1), 1.0))
        else:
            row = row_by_req.get(req_id)
            if row is None:
                return None
            rows.append(draft_probs[row, :n])
        offset += n
    return torch.cat(rows, dim=0).contiguous() if rows else None


def _wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def propose_draft_token_ids(self: Any, scheduler_output: Any, *args: Any,
                                **kwargs: Any) -> Any:
        try:
            skip = should_skip_drafter(scheduler_output)
        except Exception:  # a layout we did not expect: run the drafter, as vLLM would
            skip = False
        if not skip:
            if not hasattr(scheduler_output, SKIP_ATTR):  # not specpilot's scheduler
                return original(self, scheduler_output, *args, **kwargs)
            with capture(self.drafter), stopping(self, scheduler_output):
                return original(self, scheduler_output, *args, **kwargs)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        cache = learning_cache(self.drafter)
        if cache is not None:
            with learning_only(cache):
                return original(self, scheduler_output, *args, **kwargs)
        return [[] for _ in self.input_batch.req_ids]

    setattr(propose_draft_token_ids, _PATCHED, True)
    return propose_draft_token_ids


def learning_cache(drafter: Any) -> Any | None:
    """The cache of responses a drafter learns from (vLLM's suffix proposer: ``suffix_cache``,
    whose ``speculate`` drafts from it), or None for a drafter that learns nothing."""
    cache = getattr(drafter, "suffix_cache", None)
    return cache if callable(getattr(cache, "speculate", None)) else None


@functools.cache
def _empty_draft() -> Any:
    """What the suffix cache's ``speculate`` returns where nothing matches (built once: an idle
    step asks for it)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingDraft  # type: ignore[import-untyped]

        return SuffixDecodingDraft()
    except Exception:  # another cache of the same shape: vLLM reads only ``token_ids``
        return SimpleNamespace(token_ids=[])


@contextmanager
def learning_only(cache: Any) -> Iterator[None]:
    """Inside the block the cache learns as it always does (each request's prompt, every new
    token, requests ending) but drafts nothing: ``speculate`` returns an empty draft, what it
    returns where nothing matches. An idle step then costs the cache's upkeep, not its
    search, and the responses of a busy period still draft for the quiet one after it."""
    empty = _empty_draft()
    own = vars(cache).get("speculate")  # an instance's own, where one was set
    cache.speculate = lambda *args, **kwargs: empty
    try:
        yield
    finally:
        if own is None:
            del cache.speculate  # the class's method again
        else:
            cache.speculate = own


def _wrap_execute(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        setattr(self, _STEP_ATTR, getattr(scheduler_output, DETERMINISTIC_ATTR, frozenset()))
        setattr(self, _MARKED_ATTR, hasattr(scheduler_output, SKIP_ATTR))
        return original(self, scheduler_output, *args, **kwargs)

    setattr(execute_model, _PATCHED, True)
    return execute_model


def _wrap_draft_probs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _get_spec_decode_draft_probs(self: Any, spec_decode_metadata: Any) -> Any:
        deterministic = getattr(self, _STEP_ATTR, None)
        probs, prob_ids = self._draft_probs, self._draft_prob_req_ids
        if not deterministic or probs is None or prob_ids is None:
            return original(self, spec_decode_metadata)
        return deterministic_draft_probs(
            probs, prob_ids, self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens,
            spec_decode_metadata.draft_token_ids, deterministic)

    setattr(_get_spec_decode_draft_probs, _PATCHED, True)
    return _get_spec_decode_draft_probs


def draft_free(spec_decode_metadata: Any) -> bool:
    """Whether a step verifies no draft at all (every request's K 0 in it)."""
    return spec_decode_metadata is not None and max(
        spec_decode_metadata.num_draft_tokens, default=0) == 0


def _wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any, *args: Any,
                **kwargs: Any) -> Any:
        # Only in the plugin's steps: under a plain vLLM scheduler the patches change nothing.
        if getattr(self, _MARKED_ATTR, False) and draft_free(spec_decode_metadata):
            return original(self, logits, None, *args, **kwargs)
        return original(self, logits, spec_decode_metadata, *args, **kwargs)

    setattr(_sample, _PATCHED, True)
    return _sample


_WRAPPERS: Mapping[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "propose_draft_token_ids": _wrap_propose,
    "execute_model": _wrap_execute,
    "_get_spec_decode_draft_probs": _wrap_draft_probs,
    "_sample": _wrap_sample,
}


def _runner_class() -> tuple[type | None, str]:
    version = vllm_version()
    if not is_supported(version):
        return None, f"vLLM {version} is not a supported version"
    try:
        import importlib

        module = importlib.import_module(_RUNNER)
    except Exception as exc:
        return None, f"cannot import {_RUNNER} ({exc!r})"
    runner = getattr(module, "GPUModelRunner", None)
    if not isinstance(runner, type):
        return None, f"{_RUNNER}.GPUModelRunner not found"
    for name, params in _NEEDED:
        have = method_parameters(runner, name)
        if have is None or have[:len(params)] != params:
            return None, f"GPUModelRunner.{name}{params} not found (have {have})"
    # The cached draft probabilities both patches read and reset.
    init = inspect.unwrap(vars(runner).get("__init__", object.__init__))  # vLLM decorates it
    names = getattr(getattr(init, "__code__", None), "co_names", ())
    if "_draft_probs" not in names or "_draft_prob_req_ids" not in names:
        return None, "GPUModelRunner keeps no _draft_probs/_draft_prob_req_ids"
    return runner, ""


def patches_applicable() -> bool:
    """Whether this vLLM has the internals the patches need (also true in a process, such as
    the scheduler's, where they are not installed: every process runs the same vLLM)."""
    with _lock:
        if "applicable" not in _state:
            _state["applicable"] = _runner_class()[0] is not None
        return _state["applicable"]


def patches_installed() -> bool:
    """Whether the patches are in place in this process."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:
        return False
    return all(getattr(getattr(GPUModelRunner, name, None), _PATCHED, False) for name in _WRAPPERS)


def install_worker_patches() -> bool:
    """Patch ``GPUModelRunner`` (and so ``CPUModelRunner``) in this process; True when in
    place. Idempotent; logs one line and returns False when vLLM's internals differ; never
    raises."""
    try:
        runner, why = _runner_class()
        with _lock:
            _state["applicable"] = runner is not None
            if runner is None:
                if not _state.get("announced"):
                    _state["announced"] = True
                    log.warning("specpilot: worker patches not installed (%s): the drafter runs "
                                "every step and n-gram drafts need greedy draft sampling", why)
                return False
            for name, wrap in _WRAPPERS.items():
                method = getattr(runner, name)
                if not getattr(method, _PATCHED, False):
                    setattr(runner, name, wrap(method))
            if install_confidence_capture():
                install_drafter_stop()  # asks each pass's confidences of the capture
            if not _state.get("announced"):
                _state["announced"] = True
                log.info("specpilot: installed the worker patches (idle drafter skip, one-hot "
                         "rows for n-gram drafts, the drafter's early stop, the plain sampler "
                         "for steps without drafts)")
        return True
    except Exception:
        log.exception("specpilot: failed to install the worker patches")
        return False
