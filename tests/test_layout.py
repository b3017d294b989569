"""The layout's import rules, checked on the source: who may import whom.

- One import namespace: the sidecar and the plugin are ``specpilot.controller`` and
  ``specpilot.engine_plugin`` (their folders, controller/ and engine_plugin/, are linked under
  proto/specpilot/); no module imports them by a top-level name.
- The sidecar and the plugin never import ``benchmarks`` or ``tests`` (the tools add their
  commands to the CLI through entry points).
- The plugin imports nothing of the controller: only the contract (``specpilot.contract``), the
  generated ``specpilot.v1`` and itself. The contract imports neither side. Of the plugin only the
  link, the stream's transport, touches protobuf messages: the rest receives records.
- ``benchmarks`` never imports ``tests``.
- The pure core (``specpilot.controller.core``) imports no I/O edge: not the server, the wire
  converters, gRPC, protobuf, TLS, HTTP, Prometheus or pydantic (of the contract, only its pure
  records, rules and pricing).
- No import cycles between modules, anywhere.
- The engine's policy module (``specpilot.engine_plugin.policy``), which the plugin and the
  simulator both drive, imports neither vLLM, torch nor the network, nor the plugin's
  vLLM-facing modules, nor the controller's brain.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The top-level names the namespace replaces: importing them would load a second copy.
BARE = ("controller", "engine_plugin")
# Folder -> modules it must never import.
FORBIDDEN = {
    "controller": ("benchmarks", "tests", *BARE),
    "engine_plugin": ("benchmarks", "tests", "specpilot.controller", *BARE),
    "benchmarks": ("tests", *BARE),
    "tests": BARE,
    "proto/specpilot/contract": ("specpilot.controller", "specpilot.engine_plugin", "benchmarks",
                                 "tests", *BARE),
}
CORE_FORBIDDEN = ("specpilot.controller.server", "specpilot.controller.wire",
                  "specpilot.controller.metrics", "specpilot.controller.settings", "grpc",
                  "google.protobuf", "specpilot.v1", "specpilot.contract.engine_stream",
                  "specpilot.contract.tls", "aiohttp", "prometheus_client", "pydantic",
                  "pydantic_settings")
ENGINE_POLICY_FORBIDDEN = ("vllm", "torch", "transformers", "grpc", "specpilot.controller",
                           *(f"specpilot.engine_plugin.{p.stem}"
                             for p in (ROOT / "engine_plugin").iterdir()
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


def test_only_the_link_touches_protobuf_in_the_plugin() -> None:
    protobuf = ("specpilot.v1", "google.protobuf")
    assert "specpilot.v1" in imported_modules(ROOT / "engine_plugin" / "link.py")  # the control
    assert [v for v in _violations("engine_plugin", protobuf)
            if not v.startswith("engine_plugin/link.py ")] == []


def test_the_engine_policy_module_is_pure() -> None:
    assert (ROOT / "engine_plugin" / "policy").is_dir()
    # The control: the glue is named.
    assert "specpilot.engine_plugin.pilot" in ENGINE_POLICY_FORBIDDEN
    assert _violations("engine_plugin/policy", ENGINE_POLICY_FORBIDDEN) == []


# Where the project's modules live: folder -> the dotted prefix of its modules.
SOURCES = {"controller": "specpilot.controller", "engine_plugin": "specpilot.engine_plugin",
           "benchmarks": "benchmarks", "proto/specpilot/contract": "specpilot.contract"}


def _module_name(path: Path, folder: Path, prefix: str) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


def _runtime_imports(path: Path) -> set[str]:
    """What ``path`` imports when it runs, at any depth (``if TYPE_CHECKING:`` blocks left out):
    for ``from a import b`` both ``a`` and ``a.b``, since ``b`` may be a module."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def import_graph(sources: dict[Path, str]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports, over the folders in ``sources``."""
    paths = {_module_name(p, folder, prefix): p for folder, prefix in sources.items()
             for p in sorted(folder.rglob("*.py"))}
    return {name: {m for m in _runtime_imports(path) if m in paths and m != name}
            for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = import_graph({ROOT / folder: prefix for folder, prefix in SOURCES.items()})
    assert "specpilot.engine_plugin.pilot" in graph and "specpilot.contract.records" in graph
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_planted_cycle(tmp_path: Path) -> None:
    # The control: two modules importing each other, one of them inside a function.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg import a\n")
    assert cycles(import_graph({pkg: "pkg"})) == [["pkg.a", "pkg.b"]]


def test_the_rule_catches_a_forbidden_import(tmp_path: Path) -> None:
    # The control: the same scan flags an import it must flag.
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom tests.engine import harness\nfrom . import sibling\n")
    assert imported_modules(bad) == {"os", "tests.engine"}


def test_the_namespace_links_the_design_folders() -> None:
    # What makes specpilot.controller and specpilot.engine_plugin importable from a checkout
    # and what the wheel packs under those names.
    for folder in BARE:
        link = ROOT / "proto" / "specpilot" / folder
        assert link.is_symlink() and link.resolve() == ROOT / folder


def test_the_tools_add_their_commands_through_entry_points() -> None:
    """The installed ``specpilot.commands`` entry points (specpilot-tools) give the CLI the
    simulator, the demo, the models and the benchmarks; each attaches a runnable command."""
    import argparse

    from specpilot.controller.cli import extra_commands

    extras = extra_commands()
    assert {"simulate", "demo", "models", "bench"} <= set(extras)
    for name, entry in extras.items():
        parser = argparse.ArgumentParser(prog=f"specpilot {name}")
        entry.load().attach(parser)
        assert callable(parser.get_default("func")), name
