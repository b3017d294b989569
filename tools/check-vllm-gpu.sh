#!/usr/bin/env bash
# The plugin's vLLM surface (engine_plugin/vllm_surface.py: every class, method and attribute it
# subclasses, overrides, wraps or reads) checked against the GPU build of vLLM, by import and
# signature inspection, in an environment of its own: vLLM's GPU wheels and their CUDA torch
# install and import on a machine without a GPU (nothing is run on one). Called by
# `make check-vllm-gpu`; not part of `make test`.
#
#   VLLM_GPU_SPEC   what to install (default: vllm==0.33.*)
#   VLLM_GPU_VENV   where (default: .cache/vllm-gpu; about 6 GB)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SPEC="${VLLM_GPU_SPEC:-vllm==0.33.*}"
VENV="${VLLM_GPU_VENV:-$ROOT/.cache/vllm-gpu}"
say() { printf '[check-vllm-gpu] %s\n' "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    # The interpreter of the project's own environment (make setup made it).
    PY="$("$ROOT/.venv/bin/python" -c 'import sys; print(sys._base_executable)')"
    say "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
say "installing $SPEC into $VENV (first run: a few minutes)"
"$VENV/bin/pip" install -q --disable-pip-version-check "$SPEC" grpcio
say "checking the plugin's vLLM surface"
cd "$ROOT"
PYTHONPATH="$ROOT:$ROOT/proto" "$VENV/bin/python" -m specpilot.engine_plugin.vllm_surface
