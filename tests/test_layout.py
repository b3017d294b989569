"""The layout's import rules, checked on the source: who may import whom.

- The sidecar (``controller``) and the plugin (``engine_plugin``) never import ``benchmarks`` or
  ``tests``; the CLI names its tool commands by module path and imports them only when run.
- ``benchmarks`` never imports ``tests``.
- The pure core (``controller.core``) imports no I/O edge: not the server, the wire converter,
  gRPC, protobuf, HTTP, Prometheus or pydantic.
- The engine's policy module (``engine_plugin.policy``), which the plugin and the simulator both
  drive, imports neither vLLM, torch nor the network, nor the plugin's vLLM-facing modules, nor
  the controller's brain.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Package -> top-level modules it must never import.
FORBIDDEN = {
    "controller": ("benchmarks", "tests"),
    "engine_plugin": ("benchmarks", "tests"),
    "benchmarks": ("tests",),
}
CORE_FORBIDDEN = ("controller.server", "controller.wire", "controller.metrics",
                  "controller.settings", "grpc", "google.protobuf", "specpilot", "aiohttp",
                  "prometheus_client", "pydantic", "pydantic_settings")
ENGINE_POLICY_FORBIDDEN = ("vllm", "torch", "transformers", "grpc", "controller.server",
                           "controller.core.controller", "controller.core.policy",
                           *(f"engine_plugin.{p.stem}" for p in (ROOT / "engine_plugin").iterdir()
                             if p.stem not in ("policy", "__init__", "__pycache__")))


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (absolute only)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(ROOT)} imports {module}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_downwards(package: str) -> None:
    assert _violations(package, FORBIDDEN[package]) == []


def test_core_imports_no_edge() -> None:
    assert (ROOT / "controller" / "core").is_dir()
    assert _violations("controller/core", CORE_FORBIDDEN) == []


def test_the_engine_policy_module_is_pure() -> None:
    assert (ROOT / "engine_plugin" / "policy").is_dir()
    assert "engine_plugin.pilot" in ENGINE_POLICY_FORBIDDEN  # the control: the glue is named
    assert _violations("engine_plugin/policy", ENGINE_POLICY_FORBIDDEN) == []


def test_the_rule_catches_a_forbidden_import(tmp_path: Path) -> None:
    # The control: the same scan flags an import it must flag.
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom tests.engine import harness\nfrom . import sibling\n")
    assert imported_modules(bad) == {"os", "tests.engine"}


def test_tool_commands_name_modules_that_exist() -> None:
    # The CLI imports its tool commands lazily by name: a moved module must fail here, not in a
    # user's shell.
    import importlib

    from controller.cli import TOOL_COMMANDS

    for name, tool in TOOL_COMMANDS.items():
        module = importlib.import_module(tool.module)
        assert callable(getattr(module, tool.add_arguments)), name
        assert callable(getattr(module, tool.run)), name
