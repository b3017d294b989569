"""Every vLLM class, method and attribute the plugin subclasses, overrides, wraps or reads, and a
check of them against the vLLM installed in this interpreter.

Two sources, so the list cannot drift from the code: the ``Protocol``s of
:mod:`specpilot.engine_plugin.vllm_types` (what the pilot reads and writes), each mapped here to the
vLLM class that implements it, and :data:`HOOKS` (what the scheduler subclasses override and the
worker-side patches and the start-up profile wrap or call, with the leading parameters they rely
on). ``python -m specpilot.engine_plugin.vllm_surface`` prints the table (found / missing /
changed); the CPU build's run is a test, the GPU build's is ``make check-vllm-gpu`` (in its own
environment).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from dataclasses import dataclass

from specpilot.engine_plugin import vllm_types
from specpilot.engine_plugin.draft_confidence import NEEDED as CONFIDENCE_METHODS
from specpilot.engine_plugin.drafter_stop import _PROPOSE_PARAMS as STOP_PARAMS
from specpilot.engine_plugin.worker_patch import _NEEDED as RUNNER_METHODS

FOUND, MISSING, CHANGED = "found", "missing", "changed"


@dataclass(frozen=True)
class Hook:
    """One vLLM object the plugin depends on. ``member`` empty: the object itself (a class or a
    function); ``params``: the leading parameter names the plugin relies on (checked when
    given)."""

    where: str  # "module:Qualified.Name"
    member: str = ""
    params: tuple[str, ...] = ()
    used_by: str = ""


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"

HOOKS: tuple[Hook, ...] = (
    # The scheduler subclasses (engine_plugin/scheduler.py): overridden or read.
    Hook(_SCHED, "add_request", ("self", "request"), "scheduler.py"),
    Hook(_SCHED, "schedule", ("self",), "scheduler.py"),
    Hook(_SCHED, "update_from_output", ("self", "scheduler_output", "model_runner_output"),
         "scheduler.py"),
    Hook(_SCHED, "_free_request", ("self", "request"), "scheduler.py"),
    Hook(_SCHED, "update_draft_token_ids", ("self", "draft_token_ids"), "scheduler.py"),
    Hook(_SCHED, "shutdown", ("self",), "scheduler.py"),
    Hook(_SCHED, "vllm_config", (), "scheduler.py"),
    Hook(_SCHED, "requests", (), "scheduler.py"),
    Hook(_SCHED, "running", (), "scheduler.py"),
    Hook("vllm.v1.core.sched.async_scheduler:AsyncScheduler", "_update_after_schedule",
         ("self", "scheduler_output"), "scheduler.py (async)"),
    Hook("vllm.v1.engine:EngineCoreOutputs", used_by="scheduler.py"),
    Hook("vllm.v1.outputs:DraftTokenIds", "req_ids", (), "scheduler.py"),
    Hook("vllm.v1.outputs:DraftTokenIds", "draft_token_ids", (), "scheduler.py"),
    Hook("vllm.config:SchedulerConfig", "get_scheduler_cls", ("self",), "profile.py"),
    # The worker-side patches (engine_plugin/worker_patch.py) and the start-up profile.
    *(Hook(_RUNNER, name, params, "worker_patch.py") for name, params in RUNNER_METHODS),
    *(Hook(path, name, params, "draft_confidence.py")
      for path, name, params in CONFIDENCE_METHODS),
    Hook(_PROPOSER, "propose", STOP_PARAMS, "drafter_stop.py"),
    Hook(_PROPOSER, "parallel_drafting", (), "drafter_stop.py"),
    Hook(_PROPOSER, "num_speculative_tokens", (), "drafter_stop.py"),
    Hook(_PROPOSER, "_last_draft_probs", (), "drafter_stop.py"),
    Hook(_PROPOSER, "use_local_argmax_reduction", (), "draft_confidence.py"),
    Hook(_PROPOSER, "use_heterogeneous_vocab", (), "draft_confidence.py"),
    Hook(_RUNNER, "_draft_probs", (), "worker_patch.py"),
    Hook(_RUNNER, "_draft_prob_req_ids", (), "worker_patch.py"),
    Hook(_RUNNER, "input_batch", (), "worker_patch.py"),
    Hook(_RUNNER, "_dummy_run", ("self", "num_tokens"), "profile.py"),
    Hook(_RUNNER, "drafter", (), "profile.py"),
    Hook(_RUNNER, "uniform_decode_query_len", (), "profile.py"),
    Hook("vllm.v1.worker.gpu_worker:Worker", "compile_or_warm_up_model", ("self",),
         "profile.py"),
    Hook("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer", "dummy_run",
         ("self", "num_tokens"), "profile.py"),
    Hook("vllm.v1.spec_decode.ngram_proposer:_find_longest_matched_ngram_and_propose_tokens",
         params=("origin_tokens", "min_ngram", "max_ngram", "max_model_len", "k"),
         used_by="ngram.py"),
)

# The vLLM class behind each protocol the pilot is typed against.
PROTOCOLS: dict[type, str] = {
    vllm_types.RequestLike: "vllm.v1.request:Request",
    vllm_types.SchedulerOutputLike: "vllm.v1.core.sched.output:SchedulerOutput",
    vllm_types.NewRequestDataLike: "vllm.v1.core.sched.output:NewRequestData",
    vllm_types.CachedRequestDataLike: "vllm.v1.core.sched.output:CachedRequestData",
    vllm_types.ModelRunnerOutputLike: "vllm.v1.outputs:ModelRunnerOutput",
    vllm_types.SamplingParamsLike: "vllm.sampling_params:SamplingParams",
    vllm_types.LoRARequestLike: "vllm.lora.request:LoRARequest",
    vllm_types.VllmConfigLike: "vllm.config:VllmConfig",
    vllm_types.SpeculativeConfigLike: "vllm.config:SpeculativeConfig",
    vllm_types.ModelConfigLike: "vllm.config:ModelConfig",
    vllm_types.SchedulerConfigLike: "vllm.config:SchedulerConfig",
}


def protocol_hooks() -> tuple[Hook, ...]:
    """A hook per member of each protocol (attributes, properties and methods)."""
    hooks = []
    for proto, where in PROTOCOLS.items():
        names = set(vars(proto).get("__annotations__", {}))
        names |= {n for n, v in vars(proto).items()
                  if not n.startswith("_") and (callable(v) or isinstance(v, property))}
        for name in sorted(names):
            method = inspect.isfunction(vars(proto).get(name))
            hooks.append(Hook(where, name, ("self",) if method else (), "pilot.py (read)"))
    return tuple(hooks)


def all_hooks() -> tuple[Hook, ...]:
    return HOOKS + protocol_hooks()


@dataclass(frozen=True)
class Finding:
    hook: Hook
    status: str
    detail: str = ""


def _resolve(where: str) -> object:
    module, _, qualname = where.partition(":")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _instance_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` get ``name``: a dataclass or pydantic field, an annotation,
    or an attribute its ``__init__`` (or a base's) assigns."""
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return True
        if name in getattr(klass, "model_fields", {}) or name in getattr(
                klass, "__struct_fields__", ()):
            return True
        init = vars(klass).get("__init__")
        code = getattr(inspect.unwrap(init), "__code__", None) if init is not None else None
        if code is not None and name in code.co_names:
            return True
    return False


def check(hook: Hook) -> Finding:
    """``hook`` against the installed vLLM."""
    try:
        owner = _resolve(hook.where)
    except Exception as exc:
        return Finding(hook, MISSING, f"{type(exc).__name__}: {exc}")
    target: object = owner
    if hook.member:
        if not isinstance(owner, type):
            return Finding(hook, MISSING, f"{hook.where} is not a class")
        if not hasattr(owner, hook.member):
            if hook.params or not _instance_attribute(owner, hook.member):
                return Finding(hook, MISSING, f"no {hook.member}")
            return Finding(hook, FOUND, "instance attribute")
        target = getattr(owner, hook.member)
    if hook.params:
        if not callable(target):
            return Finding(hook, CHANGED, "not callable")
        try:
            have = tuple(inspect.signature(target).parameters)
        except (TypeError, ValueError) as exc:
            return Finding(hook, CHANGED, f"no signature ({exc})")
        if have[:len(hook.params)] != hook.params:
            return Finding(hook, CHANGED, f"parameters {have}, expected {hook.params} first")
    return Finding(hook, FOUND)


def check_all() -> list[Finding]:
    return [check(h) for h in all_hooks()]


def markdown(findings: list[Finding], vllm: str) -> str:
    rows = ["| vLLM object | member | parameters relied on | used by | " + vllm + " |",
            "|---|---|---|---|---|"]
    for f in findings:
        h = f.hook
        status = f.status + (f" ({f.detail})" if f.status != FOUND and f.detail else "")
        params = ", ".join(h.params) if h.params else "-"
        rows.append(f"| `{h.where}` | {('`' + h.member + '`') if h.member else '-'} | "
                    f"{params} | {h.used_by} | {status} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    import argparse

    from specpilot.engine_plugin.vllm_compat import SUPPORTED_VLLM, is_supported, vllm_version

    argparse.ArgumentParser(
        prog="python -m specpilot.engine_plugin.vllm_surface",
        description="Check every vLLM object the plugin relies on against the installed vLLM: "
        "a Markdown table (found / missing / changed) on stdout; exit 1 if any is not found.",
    ).parse_args()
    version = vllm_version() or "no vLLM"
    findings = check_all()
    print(markdown(findings, f"vLLM {version}"), end="")
    bad = [f for f in findings if f.status != FOUND]
    print(f"\n{len(findings) - len(bad)} of {len(findings)} found; vLLM {version} is "
          f"{'' if is_supported(version) else 'not '}in the plugin's supported range "
          f"{SUPPORTED_VLLM}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
