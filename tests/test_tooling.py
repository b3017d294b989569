"""Build tooling: generated protobuf code is fresh, `buf lint` passes, the generated modules work.

The external tools come from tools/install-tools.sh (buf under .tools/bin). Without them these
tests skip locally, but fail when CI=true: CI must never pass by skipping.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
IN_CI = os.environ.get("CI", "").lower() == "true"


def _missing_tool(name: str) -> None:
    msg = f"{name} not found: run tools/install-tools.sh (installs it under .tools/bin)"
    if IN_CI:
        pytest.fail(f"{msg}; CI=true, so a missing tool is a failure, not a skip")
    pytest.skip(msg)


def _find_tool(name: str) -> str | None:
    for candidate in (
        ROOT / ".tools" / "bin" / name,
        ROOT / ".tools" / "node_modules" / ".bin" / name,
    ):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def _load_generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_specpilot_proto_generate", PROTO_ROOT / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def buf() -> str:
    path = _find_tool("buf")
    if path is None:
        _missing_tool("buf")
    assert path is not None
    return path


# --- generated code staleness ------------------------------------------------------------------


def test_generated_protobuf_code_is_not_stale() -> None:
    stale = _load_generate().stale_files()
    assert stale == [], f"stale generated protobuf code, run `make proto`: {stale}"


def test_staleness_check_detects_an_edited_proto(tmp_path: Path) -> None:
    """The check itself can fail: on a copy of proto/, edit a .proto and `--check` must exit 1."""
    copy = tmp_path / "proto"
    shutil.copytree(PROTO_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    proto = copy / "specpilot" / "v1" / "common.proto"
    proto.write_text(proto.read_text() + "\nmessage ToolingStalenessProbe {\n  string x = 1;\n}\n")
    run = subprocess.run(
        [sys.executable, str(copy / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "common_pb2.py" in run.stdout


# --- buf lint ----------------------------------------------------------------------------------


def test_buf_lint_passes(buf: str) -> None:
    run = subprocess.run([buf, "lint"], cwd=PROTO_ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"buf lint failed in proto/:\n{run.stdout}{run.stderr}"


def test_buf_config_enforces_standard_rules(buf: str, tmp_path: Path) -> None:
    """With the project's buf.yaml, a proto that breaks STANDARD rules must make buf lint fail."""
    shutil.copy(PROTO_ROOT / "buf.yaml", tmp_path / "buf.yaml")
    bad = tmp_path / "specpilot" / "v1" / "bad.proto"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        'syntax = "proto3";\n\npackage specpilot.v1;\n\n'
        "message bad_message {\n  string BadField = 1;\n}\n\n"
        "service BadService {\n  rpc Do(bad_message) returns (bad_message);\n}\n"
    )
    run = subprocess.run([buf, "lint"], cwd=tmp_path, capture_output=True, text=True)
    out = run.stdout + run.stderr
    assert run.returncode != 0, f"buf lint accepted a non-STANDARD proto:\n{out}"
    assert "PascalCase" in out or "lower_snake_case" in out, out


# --- generated modules -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "service", "methods"),
    [
        ("engine", "EngineService", {"Connect"}),
        (
            "policy",
            "PolicyService",
            {"GetPolicy", "SetOverride", "ClearOverride", "WatchDecisions", "ExplainDecision"},
        ),
    ],
)
def test_generated_modules_expose_service(module: str, service: str, methods: set[str]) -> None:
    pb2 = importlib.import_module(f"specpilot.v1.{module}_pb2")
    pb2_grpc = importlib.import_module(f"specpilot.v1.{module}_pb2_grpc")

    descriptor = pb2.DESCRIPTOR.services_by_name[service]
    assert descriptor.full_name == f"specpilot.v1.{service}"
    assert methods <= set(descriptor.methods_by_name)

    assert hasattr(pb2_grpc, f"{service}Stub")
    assert hasattr(pb2_grpc, f"{service}Servicer")
    assert hasattr(pb2_grpc, f"add_{service}Servicer_to_server")


def test_engine_connect_is_bidirectional_stream() -> None:
    from specpilot.v1 import engine_pb2

    connect = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].methods_by_name["Connect"]
    assert connect.client_streaming and connect.server_streaming


def test_policy_watch_is_server_stream() -> None:
    from specpilot.v1 import policy_pb2

    watch = policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].methods_by_name[
        "WatchDecisions"
    ]
    assert watch.server_streaming and not watch.client_streaming


# --- CI wiring ---------------------------------------------------------------------------------


def test_ci_runs_exactly_make_test() -> None:
    ci = ROOT / ".ci" / "run"
    assert ci.stat().st_mode & stat.S_IXUSR, ".ci/run must be executable"
    text = ci.read_text()
    assert "set -euo pipefail" in text
    commands = [line.strip() for line in text.splitlines() if line.strip().startswith("make ")]
    assert commands == ["make test"], commands


def test_promtool_available() -> None:
    """The metrics tests check the exposition with promtool; CI must have it."""
    path = _find_tool("promtool")
    if path is None:
        _missing_tool("promtool")
    assert path is not None
    run = subprocess.run([path, "--version"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
