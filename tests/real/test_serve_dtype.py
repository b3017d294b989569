"""The real model's serving dtype follows the CPU: bfloat16 only where the hardware computes it,
float32 elsewhere, and an operator's choice over both."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.real.server import server_command
from benchmarks.real.smollm2 import DTYPE_ENV, choose_dtype, serve_dtype

AVX2_ONLY = {"avx2": True, "fma3": True, "avx512_bf16": False, "amx_bf16": False}


@pytest.mark.parametrize("native", ["avx512_bf16", "amx_bf16", "bf16"])
def test_a_cpu_with_native_bfloat16_serves_the_checkpoints_dtype(native: str) -> None:
    assert choose_dtype("", {**AVX2_ONLY, native: True}) == "bfloat16"


def test_a_cpu_that_emulates_bfloat16_serves_float32() -> None:
    assert choose_dtype("", AVX2_ONLY) == "float32"
    assert choose_dtype("", {}) == "float32"
    # Only a capability reported True counts (get_capabilities also holds sizes and names).
    assert choose_dtype("", {"avx512_bf16": 1, "amx_bf16": "yes"}) == "float32"


def test_the_operators_choice_wins_over_the_cpu() -> None:
    assert choose_dtype("float32", {"amx_bf16": True}) == "float32"
    assert choose_dtype("bfloat16", AVX2_ONLY) == "bfloat16"


def test_an_unknown_dtype_is_refused_saying_what_to_write() -> None:
    with pytest.raises(ValueError, match=f"{DTYPE_ENV}='float16'.*bfloat16, float32"):
        choose_dtype("float16", AVX2_ONLY)


def test_the_server_is_started_in_the_machines_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    def dtype_flag(dtype: str | None = None) -> str:
        command = server_command(Path("/m"), "m", 1, speculative_config=None, specpilot=False,
                                 dtype=dtype)
        return command[command.index("--dtype") + 1]

    serve_dtype.cache_clear()
    try:
        monkeypatch.setenv(DTYPE_ENV, "float32")
        assert dtype_flag() == "float32"
        serve_dtype.cache_clear()
        monkeypatch.setenv(DTYPE_ENV, "bfloat16")
        assert dtype_flag() == "bfloat16"
        assert dtype_flag(dtype="float32") == "float32"  # a caller's own choice stands
    finally:
        serve_dtype.cache_clear()
