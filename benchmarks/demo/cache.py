"""Build-once directories: a build is written to a temporary sibling and renamed into place, so
an interrupted build never looks complete and concurrent builders do not mix files."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_marker(path: Path, valid: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """The JSON object in ``path`` when it parses and ``valid`` accepts it, else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and valid(data) else None


def build_once(root: Path, marker: str, valid: Callable[[dict[str, Any]], bool],
               build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """The marker data of a complete build in ``root``, building it first when needed.

    ``build(tmp)`` fills the temporary directory and returns the marker data (JSON-able); the
    marker file ``marker`` is written last, then the directory is renamed to ``root``. A stale
    build in ``root`` (no valid marker) is replaced; a build finished meanwhile by another
    process wins over this one.
    """
    done = read_marker(root / marker, valid)
    if done is not None:
        return done
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        data = build(tmp)
        (tmp / marker).write_text(json.dumps(data, indent=2) + "\n")
        if root.exists():
            done = read_marker(root / marker, valid)
            if done is not None:  # a concurrent builder finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return done
            shutil.rmtree(root)
        try:
            tmp.rename(root)
        except OSError:
            done = read_marker(root / marker, valid)
            if done is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return done
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return data
