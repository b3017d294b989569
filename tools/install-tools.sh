#!/usr/bin/env bash
# Install the non-Python tools the build and the tests use. Idempotent: a second run only checks.
#
#   buf       npm package @bufbuild/buf (pinned), installed into .tools/ (git-ignored)
#   promtool  Debian package `prometheus`; apt-get installs it when missing and running as root
#   chromium  Debian package `chromium` (the dashboard's browser test); apt-get installs it when
#             missing and running as root
#   redis     Debian package `redis-server` (redis-server, redis-cli: the fleet tests start real
#             servers); apt-get installs it when missing and running as root
#
# Both end up reachable as .tools/bin/<tool> (symlinks), which the Makefile and the tests use, so
# nothing has to be added to PATH. Override the pinned buf with BUF_VERSION=x.y.z.
set -euo pipefail

BUF_VERSION="${BUF_VERSION:-1.75.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.tools"
BIN="$TOOLS/bin"
STATUS=0

say() { printf '[install-tools] %s\n' "$*"; }

# apt_install PACKAGE: install a Debian package when running as root with apt-get (updating the
# package lists first if they do not know it); otherwise, or if that fails, return 1.
apt_install() {
    [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1 || return 1
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache policy "$1" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        say "apt package lists do not know '$1' yet: apt-get update"
        apt-get update -q
    fi
    say "installing $1: apt-get install -y --no-install-recommends $1"
    apt-get install -y -q --no-install-recommends "$1"
}

mkdir -p "$BIN"

# --- buf --------------------------------------------------------------------------------------
buf_version() { "$1" --version 2>/dev/null || true; }
if [[ -x "$BIN/buf" && "$(buf_version "$BIN/buf")" == "$BUF_VERSION" ]]; then
    say "buf $BUF_VERSION already installed: $BIN/buf"
elif ! command -v npm >/dev/null 2>&1; then
    say "ERROR: npm not found; install Node.js/npm (Debian: apt-get install nodejs npm), then rerun"
    STATUS=1
else
    say "installing buf $BUF_VERSION with npm into $TOOLS (npm install @bufbuild/buf@$BUF_VERSION)"
    npm install --prefix "$TOOLS" --no-audit --no-fund --loglevel=error "@bufbuild/buf@$BUF_VERSION"
    ln -sfn ../node_modules/.bin/buf "$BIN/buf"
    got="$(buf_version "$BIN/buf")"
    if [[ "$got" != "$BUF_VERSION" ]]; then
        say "ERROR: $BIN/buf reports version '${got}', expected $BUF_VERSION"
        STATUS=1
    else
        say "buf $got installed: $BIN/buf"
    fi
fi

# --- promtool ---------------------------------------------------------------------------------
find_promtool() {
    local p
    p="$(command -v promtool 2>/dev/null || true)"
    [[ -z "$p" && -x /usr/bin/promtool ]] && p=/usr/bin/promtool
    printf '%s' "$p"
}
PROMTOOL="$(find_promtool)"
if [[ -z "$PROMTOOL" ]]; then
    apt_install prometheus && PROMTOOL="$(find_promtool)"
fi
if [[ -n "$PROMTOOL" ]]; then
    ln -sfn "$PROMTOOL" "$BIN/promtool"
    say "promtool available: $BIN/promtool -> $PROMTOOL ($("$PROMTOOL" --version 2>&1 | head -n1))"
else
    say "WARNING: promtool not found. Install the Debian package 'prometheus'"
    say "         (sudo apt-get install --no-install-recommends prometheus) or put promtool on PATH;"
    say "         tests that check the metrics exposition with promtool will be skipped until then."
    # In CI a missing tool is an error, not a skipped test.
    [[ "${CI:-}" == "true" ]] && STATUS=1
fi

# --- redis-server -----------------------------------------------------------------------------
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    apt_install redis-server || true
fi
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
    say "redis available: $(redis-server --version | head -n1)"
else
    say "ERROR: redis-server not found. Install the Debian package 'redis-server'"
    say "       (sudo apt-get install --no-install-recommends redis-server): the fleet tests"
    say "       start real Redis servers."
    STATUS=1
fi

# --- chromium ---------------------------------------------------------------------------------
# The dashboard's browser test drives Debian's chromium through Playwright (no browser download).
if ! command -v chromium >/dev/null 2>&1; then
    apt_install chromium || true
fi
if command -v chromium >/dev/null 2>&1; then
    say "chromium available: $(chromium --version 2>/dev/null | head -n1)"
else
    say "ERROR: chromium not found. Install the Debian package 'chromium'"
    say "       (sudo apt-get install --no-install-recommends chromium): the dashboard's"
    say "       browser test drives it."
    STATUS=1
fi

if [[ "$STATUS" != 0 ]]; then
    say "FAILED (see the messages above)"
fi
exit "$STATUS"
