"""Start-up step profile: a few timed dummy decode steps and one step that prefills prompt tokens,
so the controller's step-cost model starts from this hardware instead of its generic prior.

Worker side: ``install_step_profile`` (from the general plugin's ``register``) wraps the worker's
``compile_or_warm_up_model``, which runs after the model is loaded and the KV cache exists. The
wrapper times the runner's ``_dummy_run`` (a uniform decode batch: the target's forward and, for a
model drafter, its passes; ``uniform_decode_query_len`` is set to 1 + K for the call and restored)
at a few batch sizes x K, one step that prefills (vLLM's own profiling batch: a full batch of
sequences sharing ``PROFILE_PREFILL_TOKENS`` prompt tokens; timed second, after the smallest
decode step), and the drafter's own
``dummy_run`` to price one draft pass, each the
fastest of a few repeats (contention only ever adds time), within a time budget; torch's RNG state
is restored afterwards, so serving is unaffected. The result reaches the scheduler side
(``step_profile``), which puts it in the hello, through this module when the worker runs in the
engine-core process (the ``uni`` executor), and through a hand-off file when it runs in a process
of its own (``vllm serve``'s multiprocess executor, tensor parallelism): the worker measures while
the engine core builds its KV cache, before it builds the scheduler. The file's name comes from
the environment that the first vLLM process to load the plugin sets and its children inherit
(``share_profile_file``), one per data-parallel rank; the scheduler side deletes it once read.

Each timed step is followed by what a served step does after its forward pass
(``_Verification``): the LM head over the rows it samples and vLLM's sampler, or its rejection
sampler over K drafts a sequence. On a CPU without Triton the rejection sampler is the larger
part of a speculative step's extra cost, and a profile of the forward passes alone priced
verification as nearly free at the batch sizes where it costs most.

The profile is on by default, for engines on specpilot's scheduler only (the general plugin loads
in every vLLM process). A served engine also spends time the dummy steps do not (its server, the
scheduler, input preparation), so the controller weighs each point lightly
(``cost_prior_profile_weight_steps``) and its live timings correct the points.

Approximation: the dummy drafter runs its passes over all the step's tokens, a real one over the
batch after the first pass; at decode batch sizes a pass is latency-bound, so this is small.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from specpilot.contract.pricing import split_step_tokens
from specpilot.contract.records import StepProfile

log = logging.getLogger("specpilot.plugin")

# Batch sizes every engine times (those within its max_num_seqs); an engine that runs larger
# batches also times doublings of the last up to its max_num_seqs, and max_num_seqs itself
# (``profile_batch_sizes``): the cost model's knots above the ridge are priced from the prior
# alone where no step was timed, and a prior that overprices large verification steps never
# tries them at the loads where they would pay.
PROFILE_BATCH_SIZES = (1, 16, 32)
PROFILE_KS = (0, 1, 2, 4)
# The long context the ends of the profile are timed again at, tokens a sequence (capped by the
# model's length): the dummy steps' own context is ~0, so the cost model's context column is
# identified before traffic only with a second length.
PROFILE_CONTEXT_TOKENS = 512
# The prompt tokens the profile's prefill step spreads over a full batch (capped by the engine's
# token budget per step).
PROFILE_PREFILL_TOKENS = 512
_REPEATS = 5
_WARM_UPS = 2  # first calls allocate, and the first shapes also wake the thread pool
# A shape whose timed calls add up to this many seconds stops repeating after two: on a CPU the
# largest verification steps take a quarter of a second each, and the budget must reach them.
_SLOW_SHAPE_SECONDS = 0.3
_BUDGET_SECONDS = 8.0


def profile_batch_sizes(max_seqs: int) -> list[int]:
    """The batch sizes an engine of ``max_seqs`` sequences times, smallest first:
    ``PROFILE_BATCH_SIZES`` within it, then doublings of the last up to it, then ``max_seqs``."""
    batches = [b for b in PROFILE_BATCH_SIZES if b <= max_seqs]
    if max_seqs > PROFILE_BATCH_SIZES[-1]:
        while batches[-1] * 2 <= max_seqs:
            batches.append(batches[-1] * 2)
        if batches[-1] < max_seqs:
            batches.append(max_seqs)
    return batches


def _batch_groups(max_seqs: int) -> list[list[int]]:
    """The batch sizes of ``profile_batch_sizes`` in the order they are timed: those every
    engine times (``PROFILE_BATCH_SIZES``), then the larger ones, so a budget spent on a large
    engine's largest steps never costs it the small steps every engine serves."""
    batches = profile_batch_sizes(max_seqs)
    n = sum(1 for b in PROFILE_BATCH_SIZES if b <= max_seqs)
    return [group for group in (batches[:n], batches[n:]) if group]


def _breadth_first(batches: list[int], max_k: int, max_tokens: int) -> list[tuple[int, int]]:
    """(batch size, K) for ``batches``: no speculation at every batch size, then the largest K
    at every batch size, then the Ks between; none above ``max_tokens``."""
    ks = [k for k in PROFILE_KS if k <= max_k]
    by_priority = ks[:1] + ks[-1:] + ks[1:-1] if len(ks) > 1 else ks
    return [(b, k) for k in by_priority for b in batches if b * (1 + k) <= max_tokens]


def profile_shapes(max_seqs: int, max_k: int, max_tokens: int) -> list[tuple[int, int]]:
    """(batch size, K) in the order the profile times them, breadth first within each group of
    ``_batch_groups``. A budget spent early still leaves both ends of the batch range and of K
    measured: the largest verification steps are the ones the prior prices worst."""
    return [s for group in _batch_groups(max_seqs) for s in _breadth_first(group, max_k,
                                                                          max_tokens)]


def profile_plan(max_seqs: int, max_k: int, max_tokens: int,
                 max_len: int) -> list[tuple[int, int, int]]:
    """(batch size, K, context tokens a sequence) in the order the profile times them: the
    ``profile_shapes`` at no context, and in each group of batch sizes the ends of K (its first
    shapes) again at ``PROFILE_CONTEXT_TOKENS`` right after them (capped so a sequence fits
    ``max_len``; 0: the runner cannot time a context, none added)."""
    top = max(k for k in PROFILE_KS if k <= max_k)
    plan: list[tuple[int, int, int]] = []
    for group in _batch_groups(max_seqs):
        shapes = [(b, k, 0) for b, k in _breadth_first(group, max_k, max_tokens)]
        if max_len:
            ends = [s for s in shapes if s[1] in (0, top)]  # breadth first: they lead
            long = [(b, k, min(PROFILE_CONTEXT_TOKENS, max_len - 1 - k)) for b, k, _ in ends]
            shapes = shapes[:len(ends)] + [s for s in long if s[2] > 0] + shapes[len(ends):]
        plan += shapes
    return plan


@dataclass(frozen=True)
class RawProfile:
    """What the worker measured. ``steps``: (batch, K, seconds, context) of whole dummy decode
    steps, the drafter (if any) running all ``drafter_passes`` of its passes, each sequence over
    ``context`` tokens of KV; ``pass_seconds``: (step tokens, seconds of one drafter pass);
    ``prefill``: (sequences, prefill tokens, seconds) of whole dummy steps that prefill (each
    sequence one token, the others prefill), the drafter running as in ``steps``."""

    drafter_passes: int
    steps: tuple[tuple[int, int, float, int], ...]
    pass_seconds: tuple[tuple[int, float], ...]
    prefill: tuple[tuple[int, int, float], ...] = ()


def prefill_shape(max_seqs: int, max_tokens: int) -> tuple[int, int, int]:
    """(step tokens, sequences, prefill tokens) of the profile's prefill step: vLLM's dummy
    batch of that many tokens (not a uniform decode batch) spreads them over up to ``max_seqs``
    sequences, as its own memory profiling does; its prefill tokens are the step's beyond one a
    sequence, as the plugin counts a live step's. Timed without attention metadata, as vLLM
    profiles it: its linear layers, which a prompt chunk's time is mostly spent in. (With
    ``force_attention``, or as vLLM's ``create_mixed_batch``, the CPU runner's worker crashes.)"""
    tokens = min(max_tokens, PROFILE_PREFILL_TOKENS + max_seqs)
    sequences = min(tokens, max_seqs)
    return tokens, sequences, split_step_tokens(tokens, sequences, 0)[1]


_measured: RawProfile | None = None
# Not a SPECPILOT_* name: set by the plugin itself, never by a person.
PROFILE_FILE_ENV = "_SPECPILOT_STEP_PROFILE_FILE"


def share_profile_file() -> None:
    """Name the hand-off file in the environment, unless a parent process already did (vLLM's
    engine core and workers inherit the API server's environment)."""
    if not os.environ.get(PROFILE_FILE_ENV):
        os.environ[PROFILE_FILE_ENV] = os.path.join(
            tempfile.gettempdir(), f"specpilot-step-profile-{os.getpid()}-{secrets.token_hex(6)}")


def _profile_file(data_parallel_rank: int) -> str | None:
    base = os.environ.get(PROFILE_FILE_ENV)
    return f"{base}-dp{data_parallel_rank}.json" if base else None


def _hand_off(raw: RawProfile, data_parallel_rank: int) -> None:
    """Write the profile for a scheduler in another process (atomically, readable by this user
    only)."""
    path = _profile_file(data_parallel_rank)
    if path is None:
        return
    body = json.dumps({"drafter_passes": raw.drafter_passes, "steps": raw.steps,
                       "pass_seconds": raw.pass_seconds, "prefill": raw.prefill})
    staging = f"{path}.{os.getpid()}.tmp"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
    os.replace(staging, path)


def _take_hand_off(data_parallel_rank: int) -> RawProfile | None:
    """The profile a worker process handed off, read once (the file is deleted); None when there
    is none or it cannot be read."""
    path = _profile_file(data_parallel_rank)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        return RawProfile(
            int(data["drafter_passes"]),
            tuple((int(b), int(k), float(s), int(c)) for b, k, s, c in data["steps"]),
            tuple((int(t), float(s)) for t, s in data["pass_seconds"]),
            tuple((int(b), int(p), float(s)) for b, p, s in data.get("prefill", ())))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("specpilot: the start-up step profile could not be read from %s (%s); the "
                    "controller keeps its prior", path, exc)
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _min_seconds(fn: Callable[[], Any], repeats: int = _REPEATS) -> float:
    """The fastest of ``repeats`` timed calls (contention only ever adds time), after the
    warm-ups; two suffice for a slow shape (``_SLOW_SHAPE_SECONDS``)."""
    for _ in range(_WARM_UPS):
        fn()
    times: list[float] = []
    while len(times) < repeats and not (len(times) >= 2 and sum(times) > _SLOW_SHAPE_SECONDS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class _Verification:
    """What a served step does after the target's forward pass, on dummy inputs: the LM head
    over the rows it samples (every verified position of a speculative step, the last of each
    sequence otherwise) and vLLM's sampler over them, or its rejection sampler for K drafts a
    sequence. On a CPU without Triton the rejection sampler's random path is a large share of
    a speculative step (more than the forward's extra tokens at batch 16), so a profile of the
    forward alone made verification look nearly free where it is not. Timed on the random
    path (temperature 1, no top-k or top-p), the path sampled traffic takes; greedy traffic
    costs less there, and its live timings set the difference. The hidden states (random,
    so the logits are finite) and the metadata are built outside the timed call, as the
    engine's are before its step; the sampler reads the LM head's own logits, as in serving, so
    the profile never holds more logits than a served step does. The torch RNG state is the
    caller's to restore."""

    def __init__(self, runner: Any, sampling_metadata: Any, spec_metadata: Callable[..., Any],
                 hidden_size: int) -> None:
        self._runner = runner
        self._metadata = sampling_metadata
        self._spec_metadata = spec_metadata
        self._hidden_size = hidden_size

    @classmethod
    def of(cls, runner: Any) -> _Verification | None:
        """For ``runner``; None (the forward passes alone are timed, one log line) when the
        vLLM internals it needs are not there or do not take the arguments it passes."""
        try:
            from vllm.v1.sample.logits_processor import LogitsProcessors
            from vllm.v1.sample.metadata import SamplingMetadata
            from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

            for name in ("sampler", "rejection_sampler", "model", "model_config"):
                getattr(runner, name)
            metadata = partial(SamplingMetadata, all_greedy=False, all_random=True, top_p=None,
                               top_k=None, generators={}, max_num_logprobs=None,
                               logprob_token_ids=None, no_penalties=True,
                               prompt_token_ids=None, allowed_token_ids_mask=None,
                               bad_words_token_ids={}, logitsprocs=LogitsProcessors())
            verification = cls(runner, metadata, SpecDecodeMetadata.make_dummy,
                               int(runner.model_config.get_hidden_size()))
            # One call of each kind before any is timed: internals that are there but take
            # other arguments must cost the profile its sampling, never the profile itself.
            for k in (0, 1):
                verification.prepare(1, k)()
            return verification
        except Exception as exc:  # missing internals: the forward passes only
            log.info("specpilot: the start-up profile times the forward passes only (%s)", exc)
            return None

    def prepare(self, sequences: int, k: int) -> Callable[[], None]:
        """The timed call for a step of ``sequences`` sequences verifying ``k`` drafts each."""
        import torch

        runner = self._runner
        rows = sequences * (1 + k) if k else sequences
        device = getattr(runner, "device", None)
        hidden = torch.rand(rows, self._hidden_size, device=device,
                            dtype=runner.model_config.dtype)

        def full(value: float) -> Any:
            return torch.full((sequences,), value, device=device)

        metadata = self._metadata(
            temperature=full(1.0), frequency_penalties=full(0.0), presence_penalties=full(0.0),
            repetition_penalties=full(1.0), output_token_ids=[[] for _ in range(sequences)],
            spec_token_ids=[[] for _ in range(sequences)])
        if k:
            spec = self._spec_metadata([[0] * k for _ in range(sequences)], device)

            def verify() -> None:
                logits = runner.model.compute_logits(hidden)
                runner.rejection_sampler(spec, None, logits, metadata)
        else:

            def verify() -> None:
                logits = runner.model.compute_logits(hidden)
                runner.sampler(logits=logits, sampling_metadata=metadata)
        return verify


def _timed_step(step: Callable[[], Any], verify: Callable[[], None] | None) -> Callable[[], None]:
    def call() -> None:
        step()
        if verify is not None:
            verify()
    return call


def take_profile(runner: Any, budget_seconds: float = _BUDGET_SECONDS) -> RawProfile:
    """Time dummy decode steps on ``runner`` (a vLLM GPU/CPU model runner) in the order of
    ``profile_plan``, with one step that prefills (``prefill_shape``) after the first of them.
    Stops when the budget is spent (the first two are always timed); shapes beyond the
    engine's limits are skipped."""
    import torch

    spec = runner.speculative_config
    drafter: Any = getattr(runner, "drafter", None)
    passes = int(spec.num_speculative_tokens) if spec is not None else 0
    model_drafter = drafter is not None and hasattr(drafter, "dummy_run") and (
        spec.uses_draft_model() or spec.use_eagle())
    max_seqs = int(runner.scheduler_config.max_num_seqs)
    # Runners whose dummy steps cannot be given a context are timed at none only.
    max_len = (int(getattr(runner, "max_model_len", 0) or 0)
               if "profile_seq_lens" in inspect.signature(runner._dummy_run).parameters else 0)
    shapes = profile_plan(max_seqs, passes, int(runner.max_num_tokens), max_len)
    started = time.perf_counter()
    steps: list[tuple[int, int, float, int]] = []
    prefill: list[tuple[int, int, float]] = []
    pass_seconds: dict[int, float] = {}
    saved_q = runner.uniform_decode_query_len
    rng = torch.get_rng_state()

    def time_passes(tokens: int) -> None:
        if model_drafter and passes and tokens not in pass_seconds:
            pass_seconds[tokens] = _min_seconds(partial(
                drafter.dummy_run, tokens, use_cudagraphs=False)) / passes

    try:
        with torch.inference_mode():
            verification = _Verification.of(runner)

            def verify(sequences: int, k: int) -> Callable[[], None] | None:
                return None if verification is None else verification.prepare(sequences, k)

            def time_decode(b: int, k: int, context: int) -> None:
                tokens = b * (1 + k)
                runner.uniform_decode_query_len = 1 + k
                # Each dummy sequence's length: its context and the step's own tokens.
                lengths = {"profile_seq_lens": context + 1 + k} if context else {}
                steps.append((b, k, _min_seconds(_timed_step(partial(
                    runner._dummy_run, tokens, uniform_decode=True, force_attention=True,
                    **lengths), verify(b, k))), context))
                time_passes(tokens)

            # The plan's first shape (the smallest decode step) before anything else: it is
            # what bounds the steps a report may count, and on a slow CPU the prefill step
            # alone may spend the budget.
            if shapes:
                time_decode(*shapes[0])
            # Then the prefill step, as one shape: prefill is a large share of a loaded
            # engine's time, and the decode plan may spend the whole budget on a slow engine.
            tokens, sequences, prefill_tokens = prefill_shape(max_seqs,
                                                              int(runner.max_num_tokens))
            if prefill_tokens > 0:
                prefill.append((sequences, prefill_tokens, _min_seconds(_timed_step(
                    partial(runner._dummy_run, tokens), verify(sequences, 0)))))
                time_passes(tokens)
            for shape in shapes[1:]:
                if time.perf_counter() - started > budget_seconds:
                    break
                time_decode(*shape)
    finally:
        runner.uniform_decode_query_len = saved_q
        torch.set_rng_state(rng)
    return RawProfile(passes if model_drafter else 0, tuple(steps),
                      tuple(sorted(pass_seconds.items())), tuple(prefill))


def step_profile(drafter: str, data_parallel_rank: int = 0) -> tuple[StepProfile, ...]:
    """The hello's profile from what the worker measured (empty if nothing was): per (batch, K),
    the step with ``drafter`` running K passes (K=0: the target alone), i.e. the measured step
    less the passes beyond K. ``drafter``: the model draft's name, "" if the engine has none.
    Both sources are consumed: a later engine in this process (another executor, its worker
    elsewhere) never sends this one's profile as its own."""
    global _measured
    handed = _take_hand_off(data_parallel_rank)
    raw, _measured = handed or _measured, None
    if raw is None:
        return ()
    per_pass = dict(raw.pass_seconds)

    def target_alone(tokens: int, seconds: float) -> float | None:
        """A step's seconds less its drafter's passes; None where they were not timed."""
        if not raw.drafter_passes:
            return seconds
        if tokens not in per_pass:
            return None
        return seconds - raw.drafter_passes * per_pass[tokens]

    out = []
    for b, k, seconds, context in raw.steps:
        tokens = b * (1 + k)
        if (alone := target_alone(tokens, seconds)) is None:
            continue
        if raw.drafter_passes and drafter and k:
            out.append(StepProfile(b, tokens, drafter, k, alone + k * per_pass[tokens], context))
        else:
            out.append(StepProfile(b, tokens, "", 0, alone, context))
    for b, prefill, seconds in raw.prefill:
        if (alone := target_alone(b + prefill, seconds)) is not None:
            out.append(StepProfile(b, b, "", 0, alone, prefill_tokens=prefill))
    return tuple(p for p in out if p.seconds > 0)


def _data_parallel_rank(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)


# The class attribute by which specpilot's schedulers say they read the profile (a marker, so
# this module need not import the scheduler, which imports it).
READS_STEP_PROFILE = "specpilot_reads_step_profile"


def runs_specpilot_scheduler(vllm_config: Any) -> bool:
    """Whether the engine schedules with specpilot's scheduler, the only reader of the profile
    (the general plugin loads in every vLLM process, most of which never send a hello)."""
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return isinstance(cls, type) and getattr(cls, READS_STEP_PROFILE, False) is True


def install_step_profile() -> bool:
    """Wrap the worker's ``compile_or_warm_up_model`` to take the profile after it. Returns
    whether it was installed; logs one line and does nothing when the internals are missing."""
    try:
        from specpilot.engine_plugin.vllm_compat import is_cpu_platform

        worker_cls: Any
        if is_cpu_platform():
            from vllm.v1.worker.cpu_worker import CPUWorker

            worker_cls = CPUWorker
        else:
            from vllm.v1.worker.gpu_worker import Worker

            worker_cls = Worker
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not hasattr(GPUModelRunner, "_dummy_run"):
            raise AttributeError("GPUModelRunner._dummy_run")
        original = worker_cls.compile_or_warm_up_model
    except Exception as exc:  # missing internals: serve without a profile
        log.info("specpilot: start-up step profile off (%s)", exc)
        return False
    if getattr(original, "_specpilot_profile", False):
        return True

    def compile_or_warm_up_model(self: Any) -> Any:
        result = original(self)
        global _measured
        _measured = None  # never hand a previous engine's profile to this one
        try:
            _take_hand_off(_data_parallel_rank(self.vllm_config))  # nor its file
            from specpilot.engine_plugin.config import PluginConfig

            if not (PluginConfig.from_env().step_profile
                    and runs_specpilot_scheduler(self.vllm_config)):
                return result
            if getattr(self, "rank", 0) != 0:
                return result  # one worker measures for the engine (tensor parallelism)
            t0 = time.perf_counter()
            _measured = take_profile(self.model_runner)
            _hand_off(_measured, _data_parallel_rank(self.vllm_config))
            log.info("specpilot: start-up step profile, %d shapes in %.2f s",
                     len(_measured.steps), time.perf_counter() - t0)
        except Exception:
            log.exception("specpilot: start-up step profile failed; the controller keeps its "
                          "prior")
        return result

    compile_or_warm_up_model._specpilot_profile = True  # type: ignore[attr-defined]
    worker_cls.compile_or_warm_up_model = compile_or_warm_up_model
    return True
