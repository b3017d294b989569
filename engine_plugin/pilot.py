"""The plugin inside one vLLM scheduler: classifies requests, applies the policy to their drafts,
captures what verification accepted, and hands reports to the controller link.

The scheduler subclasses (scheduler.py) call the ``on_*`` hooks; every hook runs on the engine's
scheduler thread, does dictionary work only, and never blocks (the network lives in the link's
thread). Any exception is caught by the subclass, logged once, and the pilot is switched off: the
engine keeps serving with its own configuration.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from specpilot.contract.classes import DEFAULT_CLASS
from specpilot.contract.pricing import split_step_tokens
from specpilot.contract.records import CalibrationRows, DraftKind, DraftSpec, EngineHello
from specpilot.contract.version import package_version
from specpilot.engine_plugin.classify import Classifier
from specpilot.engine_plugin.config import PluginConfig
from specpilot.engine_plugin.deterministic import Counterfactual, DeterministicDraft
from specpilot.engine_plugin.drafter_stop import STOP_ATTR, StopPlan, mark_stop
from specpilot.engine_plugin.hardware import describe_hardware
from specpilot.engine_plugin.link import ControllerLink
from specpilot.engine_plugin.ngram import NGRAM_DRAFT, NgramProposer
from specpilot.engine_plugin.policy.cut import cut_length
from specpilot.engine_plugin.policy.picks import CounterfactualPicks
from specpilot.engine_plugin.policy.stats import StatsAggregator
from specpilot.engine_plugin.policy.step import StepPolicy, drafter_k
from specpilot.engine_plugin.policy.view import Choice, PolicyLookup, PolicyView
from specpilot.engine_plugin.profile import step_profile
from specpilot.engine_plugin.suffix import (
    SUFFIX_DRAFT,
    SuffixProposer,
    SuffixTrees,
    suffix_available,
)
from specpilot.engine_plugin.vllm_types import (
    CachedRequestDataLike,
    ModelRunnerOutputLike,
    NewRequestDataLike,
    RequestLike,
    SchedulerOutputLike,
    VllmConfigLike,
)
from specpilot.engine_plugin.vocab import TokenizerLike, first_differences, vocab_hash
from specpilot.engine_plugin.worker_patch import mark_step, patches_applicable

log = logging.getLogger("specpilot.plugin")

TokenizerLoader = Callable[[str], TokenizerLike]


_NO_CHOICE = Choice("", 0, False)


@dataclass(slots=True)
class _Request:
    traffic_class: str
    draft: str = ""  # draft whose tokens the request verified last
    drafted: int = 0
    accepted: int = 0
    # K asked of a deterministic draft this step, substituted or the engine's own n-gram or
    # suffix drafter: its proposal may be shorter, and is scored as this K.
    asked_k: int = 0
    # The request's choice under ``choice_from`` (this step's lookup for its batch size): the
    # drafter's K and the cut of its drafts read the same choice at no second lookup.
    choice: Choice = _NO_CHOICE
    choice_from: PolicyLookup | None = None
    # The target transforms the request's sampling: its confidences are calibrated apart.
    transformed: bool = False
    # The drafter's confidence in each of the drafts the request verifies next (model drafters
    # that report them; None otherwise, or once the drafts were substituted).
    confidences: Sequence[float] | None = None
    # The K the token cut shortened this step's drafts from (0: not cut): scored as this K.
    cut_from: int = 0
    # A model drafter's engine decided at the request's first scheduled step (``Pilot._admit``).
    admitted: bool = False
    # Admitted while its class was off: the model drafter never sees it, so it stays off.
    off_for_life: bool = False


def transforms_sampling(request: RequestLike) -> bool:
    """Whether the target's sampling of ``request`` is transformed (penalties, logit bias,
    allowed or banned tokens, a minimum length, structured output): the draft never sees it,
    so its confidence overstates what the target accepts."""
    params = request.sampling_params
    if request.use_structured_output:
        return True
    if params is None:
        return False
    return bool(params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0 or params.min_tokens or params.logit_bias
                or params.allowed_token_ids or params.bad_words)


def step_context_tokens(output: SchedulerOutputLike) -> int | None:
    """The context a step's attention reads: over its requests, the tokens each one's KV cache
    held when the step was scheduled (vLLM advances ``num_computed_tokens`` right after, so the
    request objects already count the step's own tokens; the output keeps the values before).
    None (unknown) where the output does not say; 0 is a step of new requests only."""
    cached: CachedRequestDataLike | None = getattr(output, "scheduled_cached_reqs", None)
    new: Sequence[NewRequestDataLike] = getattr(output, "scheduled_new_reqs", ())
    if cached is None:
        return None
    return int(sum(cached.num_computed_tokens)) + sum(r.num_computed_tokens for r in new)


@dataclass(frozen=True)
class EngineSpec:
    """What the engine was started with, read from vLLM's config."""

    model: str
    tokenizer: str
    drafter: str  # name of the engine's own drafter ("" without speculation)
    drafter_kind: DraftKind | None  # None without speculation
    drafter_tokenizer: str  # "" for n-gram
    max_k: int
    async_scheduling: bool
    greedy_draft_sampling: bool
    ngram_min: int
    ngram_max: int
    max_model_len: int
    max_num_seqs: int
    # The worker verifies substituted drafts against one-hot probabilities whatever the draft
    # sampling method (specpilot.engine_plugin.worker_patch).
    one_hot_rows: bool = False
    suffix: SuffixTrees = field(default_factory=SuffixTrees)  # the suffix trees' settings
    hardware: str = ""  # specpilot.engine_plugin.hardware.describe_hardware
    data_parallel_rank: int = 0

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfigLike) -> EngineSpec:
        spec = vllm_config.speculative_config
        model_cfg = vllm_config.model_config
        drafter, kind, draft_tok = "", None, ""
        if spec is not None and spec.method in _DETERMINISTIC_METHODS:
            drafter = str(spec.method)
            kind = _DETERMINISTIC_METHODS[drafter]
        elif spec is not None:
            # The draft's own tokenizer, from its directory: vLLM itself only compares vocabulary
            # sizes and runs the draft with the target's tokenizer (draft_model_config.tokenizer),
            # which is exactly how a silent mismatch gets in.
            drafter = Path(str(spec.model)).name or str(spec.method)
            kind, draft_tok = DraftKind.MODEL, str(spec.model)
        return cls(
            model=str(model_cfg.served_model_name or model_cfg.model),
            tokenizer=str(model_cfg.tokenizer),
            drafter=drafter,
            drafter_kind=kind,
            drafter_tokenizer=draft_tok,
            max_k=int(vllm_config.num_speculative_tokens or 0) if spec is not None else 0,
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
            greedy_draft_sampling=getattr(spec, "draft_sample_method", "greedy") == "greedy",
            ngram_min=int(getattr(spec, "prompt_lookup_min", None) or 2),
            ngram_max=int(getattr(spec, "prompt_lookup_max", None) or 4),
            suffix=SuffixTrees.from_spec(spec),
            max_model_len=int(model_cfg.max_model_len),
            max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
            one_hot_rows=patches_applicable(),
            hardware=describe_hardware(vllm_config),
            data_parallel_rank=int(getattr(vllm_config.parallel_config, "data_parallel_rank",
                                           0) or 0),
        )

    @property
    def deterministic_drafter(self) -> bool:
        """The engine's own drafter is vLLM's n-gram or suffix proposer: it proposes 0..K tokens
        a request and keeps no state (no KV) per sequence."""
        return self.drafter_kind in (DraftKind.NGRAM, DraftKind.SUFFIX)

    @property
    def can_substitute(self) -> bool:
        """Draft tokens can be replaced in the sync scheduler. They are verified as one-hot
        (so the output distribution stays the target's) under greedy draft sampling, and under
        probabilistic sampling when the worker patch rebuilds their rows."""
        return (self.drafter_kind is DraftKind.MODEL and not self.async_scheduling
                and (self.greedy_draft_sampling or self.one_hot_rows))


@dataclass(frozen=True)
class Announcement:
    """What the engine tells the controller (``hello``) and the drafts it may run: those whose
    vocabulary matches the target's (``drafts_allowed``)."""

    hello: EngineHello
    drafts_allowed: frozenset[str]


def announce(engine: EngineSpec, config: PluginConfig, load: TokenizerLoader) -> Announcement:
    """The hello, after the tokenizer guard: a model draft whose vocabulary differs from the
    target's is refused here (and flagged to the controller by its hash). Loads the target's
    tokenizer, and the model draft's, with ``load``."""
    e = engine
    drafts: list[DraftSpec] = []
    allowed: set[str] = set()
    target = load(e.tokenizer)
    target_hash = vocab_hash(target)
    if e.drafter_kind is DraftKind.MODEL:
        draft_tok = load(e.drafter_tokenizer)
        draft_hash = vocab_hash(draft_tok)
        if draft_hash != target_hash:
            log.error(
                "specpilot: draft %r tokenizer differs from the target's %r; speculation "
                "refused (acceptance would be meaningless). First differences: %s",
                e.drafter, e.tokenizer, "; ".join(first_differences(target, draft_tok)))
        else:
            allowed.add(e.drafter)
        drafts.append(DraftSpec(e.drafter, DraftKind.MODEL, e.max_k, draft_hash))
    elif e.drafter_kind is not None:
        allowed.add(e.drafter)
        drafts.append(DraftSpec(e.drafter, e.drafter_kind, e.max_k))
    offered = substitutable_drafts(e, config) if e.drafter in allowed else {}
    for name, kind in offered.items():
        allowed.add(name)
        drafts.append(DraftSpec(name, kind, e.max_k))
    substitute = bool(offered)
    hello = EngineHello(
        engine_id=config.engine_id, model=e.model, target_vocab_hash=target_hash,
        drafts=tuple(drafts), max_k=e.max_k,
        per_request_k=config.k_mode != "batch_wide",
        # The drafter's passes follow the K chosen (not the configured K) in both batch modes:
        # the controller then prices draft passes as the batch's largest K.
        batch_wide_k=config.k_mode != "per_request",
        ngram_substitution=substitute,
        ngram_counterfactual=substitute or e.deterministic_drafter,
        step_probes=True,  # PolicyLookup probes whole steps where a decision asks it
        # Per-step re-picks need the drafter's passes to follow the step's largest K.
        step_composition=config.step_composition and config.k_mode == "batch_max",
        engine_version=_vllm_version(), plugin_version=package_version(),
        max_batch_size=e.max_num_seqs,
        step_profile=step_profile(e.drafter if e.drafter_kind is DraftKind.MODEL else "",
                                  e.data_parallel_rank),
        hardware=config.hardware or e.hardware,
    )
    return Announcement(hello, frozenset(allowed))


# vLLM speculative methods whose drafts are deterministic (no draft model), by their draft kind.
_DETERMINISTIC_METHODS = {NGRAM_DRAFT: DraftKind.NGRAM, SUFFIX_DRAFT: DraftKind.SUFFIX}


def substitutable_drafts(engine: EngineSpec, config: PluginConfig) -> dict[str, DraftKind]:
    """The deterministic drafts the plugin proposes itself and substitutes for the model
    drafter's tokens in this engine (also scored counterfactually)."""
    if not (engine.can_substitute and engine.max_k):
        return {}
    offered: dict[str, DraftKind] = {}
    if config.ngram_drafts:
        offered[NGRAM_DRAFT] = DraftKind.NGRAM
    if config.suffix_drafts:
        if suffix_available():
            offered[SUFFIX_DRAFT] = DraftKind.SUFFIX
        else:
            log.info("specpilot: suffix drafts not offered: arctic-inference is not installed")
    return offered


def engine_mode(engine: EngineSpec, config: PluginConfig) -> PluginConfig:
    """``config`` with the K mode this engine can run: vLLM's suffix proposer drafts only the
    configured K (``SuffixDecodingProposer.propose`` asserts it), so a suffix engine cuts
    per request instead of setting a batch K."""
    if engine.drafter_kind is DraftKind.SUFFIX and config.k_mode != "per_request":
        log.info("specpilot: k_mode %s -> per_request: vLLM's suffix drafter drafts only the "
                 "configured K", config.k_mode)
        return replace(config, k_mode="per_request")
    return config


def _proposer(name: str, engine: EngineSpec, config: PluginConfig) -> DeterministicDraft:
    if name == SUFFIX_DRAFT:
        trees = replace(engine.suffix, max_cached_requests=config.suffix_cached_responses)
        return SuffixProposer(trees, engine.max_model_len)
    return NgramProposer(engine.ngram_min, engine.ngram_max, engine.max_model_len)


def _load_tokenizer(path: str) -> TokenizerLike:
    from transformers import AutoTokenizer

    tokenizer: TokenizerLike = AutoTokenizer.from_pretrained(path)
    return tokenizer


@dataclass(frozen=True)
class _TimedStep:
    """A step's timing, before the passes its drafter ran are known: ``k`` the passes asked."""

    batch: int
    verified_tokens: int
    k: int
    seconds: float
    context_tokens: int | None
    prefill_tokens: int


class Pilot:
    """The plugin's state in one engine. The constructor only wires the parts together (no I/O,
    no thread); ``create`` reads the class rules, loads the tokenizers and starts the link."""

    def __init__(self, engine: EngineSpec, config: PluginConfig, classifier: Classifier,
                 announcement: Announcement) -> None:
        self.engine = engine
        self.config = config
        self.classifier = classifier
        self.drafts_allowed = announcement.drafts_allowed
        hello = announcement.hello
        static_k = engine.max_k if engine.drafter in self.drafts_allowed else 0
        self.view = PolicyView(static_k=static_k, static_draft=engine.drafter,
                               fail_static_timeout_seconds=config.fail_static_timeout_seconds,
                               max_k=engine.max_k)
        # Records for drafts the controller was not told about are dropped here, not sent.
        self.stats = StatsAggregator(max_k=max(engine.max_k, 1),
                                     drafts={d.name for d in hello.drafts})
        self.link = ControllerLink(
            config.controller, hello, self.view, config,
            on_hello_ack=lambda ack: self.classifier.set_max_classes(ack.max_classes),
            start=False)
        # Deterministic drafts (the ones announced: the controller must know a draft), served by
        # substituting the model drafter's tokens and scored counterfactually on all traffic.
        self.deterministic: dict[str, DeterministicDraft] = {
            d.name: _proposer(d.name, engine, config) for d in hello.drafts
            if d.kind is not DraftKind.MODEL and d.name != engine.drafter}
        # The drafts scored counterfactually: those, and the engine's own n-gram or suffix
        # drafter, whose acceptance would otherwise go unmeasured while its classes are off (a
        # class turned off early, on little evidence, would never be seen to pay again).
        self._scored: dict[str, DeterministicDraft] = dict(self.deterministic)
        if engine.deterministic_drafter and engine.drafter in self.drafts_allowed:
            self._scored[engine.drafter] = _proposer(engine.drafter, engine, config)
        self.counterfactual = {name: Counterfactual(d.propose, engine.max_k)
                               for name, d in self._scored.items()}
        self.requests: dict[str, _Request] = {}
        # The requests held, for the ones a step scores counterfactually.
        self.picks = CounterfactualPicks(config.counterfactual_per_step)
        # Requests per traffic class among ``requests``: the classes a step can hold.
        self._class_counts: dict[str, int] = {}
        # Requests whose drafts are deterministic tokens the plugin put there, until a step
        # schedules them (mark_step) or the drafter's tokens replace them.
        self._substituted: set[str] = set()
        # The requests whose scheduled drafts in the current step are deterministic tokens.
        self._verifying_deterministic: frozenset[str] = frozenset()
        # Drafts per request the drafter was asked for in the current step (mark_step).
        self._drafter_k = engine.max_k
        # The current step's drafter proposes nothing (mark_step): timed without its passes.
        self._drafter_idle_now = False
        # Held requests admitted off (``_admit``).
        self._off_for_life = 0
        # This step's policy: one lookup per batch size, the re-picks of ``batch_k``.
        self.step = StepPolicy(self.view, self.drafts_allowed, engine.drafter)
        self._step_started = 0.0
        # A decode step whose drafter may have stopped early, timed once its drafts' width says
        # how many passes ran (``on_drafts``).
        self._untimed: _TimedStep | None = None
        self._last_report = time.monotonic()

    @classmethod
    def create(cls, engine: EngineSpec, config: PluginConfig,
               tokenizer_loader: TokenizerLoader = _load_tokenizer) -> Pilot:
        """A running pilot: the class rules read, the hello announced after the tokenizer guard,
        and the link started (no thread without a controller: the static configuration stays).
        Raises ValueError for a bad class-rules file."""
        config = engine_mode(engine, config)
        classifier = Classifier.from_file(config.class_rules, config.max_classes)
        pilot = cls(engine, config, classifier, announce(engine, config, tokenizer_loader))
        pilot.link.start()
        return pilot

    # --- hooks ----------------------------------------------------------------------------------
    def on_add_request(self, request: RequestLike) -> None:
        params = request.sampling_params
        lora = request.lora_request
        traffic_class = self.classifier.classify(
            params.extra_args if params is not None else None,
            lora.lora_name if lora is not None else None,
            request.num_prompt_tokens,
            request.max_tokens,
        )
        self._forget(request.request_id)  # the same id again: counted once
        self.requests[request.request_id] = _Request(traffic_class,
                                                     transformed=transforms_sampling(request))
        self._count_class(traffic_class, 1)
        if self.counterfactual:
            self.picks.add(request.request_id, traffic_class)

    def _forget(self, req_id: str) -> _Request | None:
        """Drop a request's state and its place in the per-request indexes."""
        state = self.requests.pop(req_id, None)
        self._substituted.discard(req_id)
        if state is None:
            return None
        self._off_for_life -= state.off_for_life
        self._count_class(state.traffic_class, -1)
        self.picks.forget(req_id)
        return state

    def _count_class(self, traffic_class: str, change: int) -> None:
        n = self._class_counts.get(traffic_class, 0) + change
        if n > 0:
            self._class_counts[traffic_class] = n
        else:
            self._class_counts.pop(traffic_class, None)

    def on_schedule_start(self) -> None:
        self._step_started = time.monotonic()
        self.step.start()

    def batch_k(self, running: Iterable[RequestLike]) -> int:
        """The K the drafter drafts this step in the batch modes (``drafter_k``); in
        ``batch_max`` the arms of settled classes are first re-picked for the classes and counts
        of this step."""
        running = list(running)
        ids = [r.request_id for r in running]
        if not ids:
            return self.view.static_k
        lookup = self._lookup(len(ids))
        if self.config.k_mode == "batch_max":
            counts: dict[str, int] = {}
            for req_id in ids:
                state = self.requests.get(req_id)
                name = state.traffic_class if state is not None else DEFAULT_CLASS
                counts[name] = counts.get(name, 0) + 1
            # The KV each sequence holds before the step its drafts are verified in.
            context = sum(r.num_computed_tokens for r in running) / len(ids)
            self.step.compose(lookup, counts, len(ids), context)
        return drafter_k([self._choice(req_id, lookup) for req_id in ids], self.config.k_mode,
                         self.deterministic)

    def _lookup(self, batch_size: int) -> PolicyLookup:
        """This step's policy for a batch of ``batch_size`` (one lookup per size and step)."""
        return self.step.lookup(batch_size)

    def _choice(self, req_id: str, lookup: PolicyLookup) -> Choice:
        """The request's (draft, K) under ``lookup``, resolved once per lookup and request."""
        state = self.requests.get(req_id)
        if state is not None and state.off_for_life:
            return self.step.off
        if state is not None and state.choice_from is lookup:
            return state.choice
        traffic_class = state.traffic_class if state is not None else DEFAULT_CLASS
        choice = self.step.choice(lookup, traffic_class, req_id)
        if state is not None:
            state.choice, state.choice_from = choice, lookup
        return choice

    def on_drafts(self, requests: Mapping[str, RequestLike], req_ids: Sequence[str],
                  batch_size: int, batch_k: int | None,
                  confidences: Sequence[Sequence[float]] | None = None,
                  passes: int | None = None) -> None:
        """After the drafter proposed: cut each request's drafts to its K, or substitute a
        deterministic draft's (n-gram, suffix) where the policy picks one.

        Drafts are only ever lengthened by substitution in ``batch_max`` mode, where the drafter
        skipped the passes such requests do not need, and never beyond the configured
        K (what the engine sized its buffers for). Any deterministic draft keeps the output
        distribution exactly the target's. ``confidences``: the drafter's probability of each
        token it proposed, per request in ``req_ids`` order, where it reports them. ``passes``:
        the width of the drafts as the drafter returned them (the passes it ran)."""
        self._time_untimed(passes)
        if confidences is not None and len(confidences) == len(req_ids):
            states = self.requests
            for req_id, row in zip(req_ids, confidences, strict=True):
                if (state := states.get(req_id)) is not None:
                    state.confidences = row
        lengthen = self.config.k_mode == "batch_max"
        lookup = self._lookup(batch_size)
        uniform = self.step.uniform(lookup, self._class_counts)
        # The engine's own n-gram or suffix drafter proposes 0..K tokens: each request's K
        # asked is recorded below, so no shortcut for it.
        variable = self.engine.deterministic_drafter
        if (not variable and not self._off_for_life and uniform is not None
                and uniform.draft == self.engine.drafter
                and uniform.draft in self.drafts_allowed and uniform.k >= self._drafter_k
                and (batch_k is None or batch_k == uniform.k)
                and not (batch_k is None and confidences is not None and lookup.cuts())):
            # Every request wants the drafter's tokens at no fewer than it drafted: nothing to
            # cut, and the drafter's tokens replace any substituted ones put there before. (Every
            # request a step drafts for has a state, so its class is among the counted ones.)
            if self._substituted:
                self._substituted.difference_update(req_ids)
            return
        deterministic = self.deterministic
        drafter, states = self.engine.drafter, self.requests
        for req_id in req_ids:
            request = requests.get(req_id)
            if request is None or request.is_finished() or request.is_prefill_chunk:
                continue
            proposed = request.spec_token_ids or []
            choice = self._choice(req_id, lookup)
            want = choice.k if batch_k is None else batch_k
            state = states.get(req_id)
            if state is not None:
                state.cut_from = 0
            if (batch_k is None and state is not None and state.confidences is not None
                    and choice.draft == drafter
                    and (cut := lookup.cut(state.traffic_class, drafter,
                                           state.transformed)) is not None):
                state.cut_from = min(want, len(proposed))
                want = cut_length(state.confidences[:state.cut_from], *cut)
                if not want:  # verifies none: scored now, as K asked with none accepted
                    self.stats.record_verification(state.traffic_class, drafter,
                                                   state.cut_from, 0, drafted=0)
                    state.cut_from = 0
            proposer = deterministic.get(choice.draft)
            if proposer is not None:
                room = (self.engine.max_k if lengthen and not request.use_structured_output
                        else len(proposed))
                k = min(want, room)
                if not k:
                    continue
                draft = choice.draft
                request.spec_token_ids = proposer.propose(req_id, request.all_token_ids,
                                                          request.num_prompt_tokens, k)
                self._substituted.add(req_id)
                self._ask(state, draft, k, request.spec_token_ids)
                if state is not None:
                    state.confidences = None  # not the drafter's tokens any more
            else:
                if variable:
                    self._ask(state, drafter, min(want, self._drafter_k), proposed)
                if not proposed:
                    continue
                if want < len(proposed):
                    request.spec_token_ids = proposed[:want]
                self._substituted.discard(req_id)
                draft = drafter
            if state is not None:
                state.draft = draft

    def _ask(self, state: _Request | None, draft: str, k: int, proposal: Sequence[int]) -> None:
        """A deterministic draft was asked for ``k`` tokens and proposed ``proposal``. Scored as
        K asked (``on_output``): a short proposal counts its missing tail as rejected, an empty
        one (no match) as a step with none accepted, so E(K) of a deterministic draft is tokens
        per step, comparable with a model draft's, which always proposes K."""
        if state is None:
            return
        state.asked_k = k
        if k and not proposal:
            self.stats.record_verification(state.traffic_class, draft, k, 0, drafted=0)

    def mark_step(self, output: SchedulerOutputLike, batch_size: int) -> None:
        """On a step's SchedulerOutput, for the worker (specpilot.engine_plugin.worker_patch): which
        scheduled drafts are deterministic (substituted since the last step), whether the
        drafter may skip its pass (batch modes; the worker also requires batch K 0 and a
        decode-only step), and whether it is idle (:meth:`_drafter_idle`)."""
        substituted = self._substituted.intersection(output.scheduled_spec_decode_tokens)
        # A running request this step did not schedule keeps its substituted drafts for later.
        self._substituted.difference_update(output.num_scheduled_tokens)
        self._verifying_deterministic = frozenset(substituted)
        self._drafter_k = output.num_spec_tokens_to_schedule
        self._admit(output, batch_size)
        self._drafter_idle_now = self._drafter_idle(output, batch_size)
        skip = self.config.skip_idle_drafter and self.config.k_mode != "per_request"
        mark_step(output, skip_drafter=skip, deterministic=self._verifying_deterministic,
                  idle_drafter=self._drafter_idle_now)

    def _admit(self, output: SchedulerOutputLike, batch_size: int) -> None:
        """A model drafter must see a request's prompt to draft for it later, so whether it
        ever will is decided once, at the request's first scheduled step: a request whose
        class is off at ``batch_size`` then, and probes nothing (a probe, of requests or of
        whole steps, needs the drafter to have seen the requests it drafts for), is never
        drafted for (``off_for_life``), and steps of such requests only skip the drafter,
        prefill included (``_drafter_idle``)."""
        if not self.config.skip_idle_drafter or self.engine.drafter_kind is not DraftKind.MODEL:
            return
        states, lookup = self.requests, self._lookup(batch_size)
        for req_id in output.num_scheduled_tokens:
            state = states.get(req_id)
            if state is None or state.admitted:
                continue
            state.admitted = True
            if (self.step.resolve(lookup, state.traffic_class).choice.k == 0
                    and not lookup.probes(state.traffic_class)):
                state.off_for_life = True
                self._off_for_life += 1

    def _drafter_idle(self, output: SchedulerOutputLike, batch_size: int) -> bool:
        """Whether the engine's drafter may skip its proposal after this step outright, in
        every K mode and also in a step that prefills: no scheduled request takes its drafts.
        A drafter that keeps no state per sequence (n-gram, suffix) is idle where every
        scheduled request's class is off at ``batch_size``; a suffix drafter's trees then miss
        the step's tokens (drafts of a request switched on later match less of its own
        response, never wrongly). A model drafter, whose KV must hold what it drafts from, is
        idle only where every scheduled request was admitted off (``_admit``)."""
        ids = output.num_scheduled_tokens
        if not ids or not self.config.skip_idle_drafter:
            return False
        states = self.requests
        if not self.engine.deterministic_drafter:
            return bool(self._off_for_life) and all(
                (state := states.get(req_id)) is not None and state.off_for_life
                for req_id in ids)
        lookup = self._lookup(batch_size)
        return all(req_id in states and self._choice(req_id, lookup).k == 0 for req_id in ids)

    def plan_drafter_stop(self, output: SchedulerOutputLike, requests: Mapping[str, RequestLike],
                          batch_size: int) -> None:
        """On a sync step's SchedulerOutput, for the worker (``drafter_stop``): the early stop
        of the drafter's passes at the end of the step, where the policy prices a pass and cuts
        drafts. Each scheduled request asks for its decision's K of the drafter's tokens (at
        most the step's batch K; in ``batch_wide`` every request the batch K) with its class's
        calibration; one whose tokens a deterministic draft replaces asks for the room its
        substitution needs (none where ``batch_max`` lengthens it anyway), one off or still
        prefilling for none."""
        k_max = int(output.num_spec_tokens_to_schedule)
        plan = None
        if k_max > 1 and self.engine.drafter_kind is DraftKind.MODEL:
            lookup = self._lookup(batch_size)
            price = lookup.drafter_stop()
            if price is not None and lookup.cuts():
                plan = StopPlan(*price, self._stop_requests(output, requests, lookup, k_max))
        mark_stop(output, plan)

    def _stop_requests(self, output: SchedulerOutputLike, requests: Mapping[str, RequestLike],
                       lookup: PolicyLookup, k_max: int
                       ) -> dict[str, tuple[CalibrationRows | None, int]]:
        mode, drafter = self.config.k_mode, self.engine.drafter
        out: dict[str, tuple[CalibrationRows | None, int]] = {}
        for req_id in output.num_scheduled_tokens:
            request, state = requests.get(req_id), self.requests.get(req_id)
            if request is None or state is None:
                out[req_id] = (None, k_max)  # not the pilot's: drafted as vLLM asks
                continue
            if request.is_prefill_chunk:
                out[req_id] = (None, 0)  # its drafts are dropped
                continue
            choice = self._choice(req_id, lookup)
            want = k_max if mode == "batch_wide" else min(choice.k, k_max)
            if choice.draft in self.deterministic:
                lengthened = mode == "batch_max" and not request.use_structured_output
                out[req_id] = (None, 0 if lengthened else want)
                continue
            cut = lookup.cut(state.traffic_class, drafter, state.transformed) if want else None
            out[req_id] = (None if cut is None else cut[0], want)
        return out

    def on_placeholders(self, requests: Mapping[str, RequestLike], req_ids: Iterable[str],
                        batch_size: int) -> None:
        """Async scheduling: each request gets a placeholder list of its own K (the scheduler
        shares one list of the batch K between all requests; never mutate that one)."""
        lookup = self._lookup(batch_size)
        for req_id in req_ids:
            request = requests.get(req_id)
            if request is None or not request.spec_token_ids:
                continue
            k = min(self._choice(req_id, lookup).k, len(request.spec_token_ids))
            if k < len(request.spec_token_ids):
                request.spec_token_ids = [-1] * k

    def on_output(self, scheduler_output: SchedulerOutputLike,
                  runner_output: ModelRunnerOutputLike) -> None:
        """Before vLLM applies a step's output: count drafted/accepted per request and time the
        step."""
        seconds = time.monotonic() - self._step_started
        self._time_untimed(None)  # the previous step's drafts never came: timed at its K
        sampled = runner_output.sampled_token_ids
        index = runner_output.req_id_to_index
        invalid = scheduler_output.num_invalid_spec_tokens or {}
        scheduled_drafts = 0
        # Names bound once: this loop runs for every request of every step.
        index_of, invalid_of, state_of = index.get, invalid.get, self.requests.get
        record = self.stats.record_verification
        verifying, drafter = self._verifying_deterministic, self.engine.drafter
        variable = self.engine.deterministic_drafter
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            n = len(drafts)
            scheduled_drafts += n
            i = index_of(req_id)
            if i is None or not sampled:
                continue
            tokens = len(sampled[i])
            drafted = n - invalid_of(req_id, 0)
            state = state_of(req_id)
            if not tokens or state is None or drafted <= 0:
                continue
            accepted = min(tokens - 1, drafted)
            verified = drafted
            if req_id in verifying:
                draft = state.draft  # the deterministic draft on_drafts substituted
                drafted = max(drafted, state.asked_k)
            else:
                draft = state.draft = drafter
                if variable:
                    drafted = max(drafted, state.asked_k)
                elif state.confidences is not None:
                    self.stats.record_confidences(state.traffic_class, draft,
                                                  state.confidences[:drafted], accepted,
                                                  state.transformed)
            state.confidences = None
            # A cut tail counts as rejected, as a deterministic draft's missing one: the class's
            # E(K) is then what a step drafting K yields, and the cut does not select the
            # tokens its acceptance is learnt from.
            record(state.traffic_class, draft, max(drafted, state.cut_from), accepted,
                   drafted=verified)
            state.cut_from = 0
            state.drafted += drafted
            state.accepted += accepted
        batch = len(scheduler_output.num_scheduled_tokens)
        if batch:
            verified, prefill = split_step_tokens(scheduler_output.total_num_scheduled_tokens,
                                                  batch, scheduled_drafts)
            # The drafter drafted k passes for every sequence (cuts come after drafting), or
            # fewer where it stopped early.
            k = (scheduler_output.num_spec_tokens_to_schedule
                 if self.engine.max_k and not self._drafter_idle_now else 0)
            step = _TimedStep(batch, verified, k, seconds, step_context_tokens(scheduler_output),
                              prefill)
            if k > 1 and isinstance(getattr(scheduler_output, STOP_ATTR, None), StopPlan):
                # The drafter may stop early in the worker (whose process may be another): the
                # width of the drafts it returns says how many passes ran.
                self._untimed = step
            else:
                self._time(step, k)

    def _time_untimed(self, passes: int | None) -> None:
        """Time the step held for its drafts' width, at ``passes`` where fewer than its K."""
        step, self._untimed = self._untimed, None
        if step is not None:
            self._time(step, passes if passes is not None and 0 < passes < step.k else step.k)

    def _time(self, step: _TimedStep, passes: int) -> None:
        self.stats.record_step(step.batch, step.verified_tokens, passes * step.batch,
                               self.engine.drafter if passes else "", passes, step.seconds,
                               step.context_tokens, step.prefill_tokens)

    def after_output(self, requests: Mapping[str, RequestLike], req_ids: Collection[str],
                     running: int) -> None:
        """After vLLM appended the step's tokens (and freed finished requests): score pending
        counterfactual deterministic drafts, then hand a report to the link when one is due."""
        self._score_counterfactual(requests, req_ids, running)
        now = time.monotonic()
        # Flush when the engine goes idle too, so the last finished requests are not held back.
        if now - self._last_report >= self.link.report_interval_seconds or running == 0:
            self._last_report = now
            payload = self.stats.drain(running_requests=running)
            if not payload.is_empty:
                self.link.submit(payload)

    def _score_counterfactual(self, requests: Mapping[str, RequestLike],
                              req_ids: Collection[str], running: int) -> None:
        """Score the deterministic drafts on this step's picks (``CounterfactualPicks``) among
        the requests it decoded."""
        if not self.counterfactual:
            return

        def eligible(req_id: str) -> RequestLike | None:
            request = requests.get(req_id)
            if request is None or req_id not in req_ids or request.is_prefill_chunk:
                return None
            return request

        states, record = self.requests, self.stats.record_verification
        own = self.engine.drafter if self.engine.deterministic_drafter else None
        for req_id, request in self.picks.pick(eligible, running):
            state = states[req_id]
            for name, counterfactual in self.counterfactual.items():
                # A request served by this draft is measured for real, not counterfactually
                # (by the engine's own drafter: where it was asked for drafts this step).
                if (state.asked_k > 0) if name == own else (state.draft == name):
                    continue
                scored = counterfactual.step(req_id, request.all_token_ids,
                                             request.num_prompt_tokens)
                if scored is not None:
                    record(state.traffic_class, name, scored[0], scored[1], counterfactual=True)

    def on_free(self, request: RequestLike) -> None:
        req_id = request.request_id
        state = self._forget(req_id)
        for name, proposer in self._scored.items():
            proposer.finish(req_id, request.all_token_ids, request.num_prompt_tokens)
            self.counterfactual[name].forget(req_id)
        if state is None:
            return
        self.stats.record_finished(
            state.traffic_class, state.draft, request.num_prompt_tokens,
            request.num_output_tokens, state.drafted, state.accepted,
            max(time.time() - request.arrival_time, 0.0))

    def close(self) -> None:
        self.link.stop()


def _vllm_version() -> str:
    from specpilot.engine_plugin.vllm_compat import vllm_version

    return vllm_version() or "unknown"
