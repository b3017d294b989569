"""matplotlib for the commands that draw PNGs (``simulate``, ``bench engine``, the benchmarks):
optional, from the ``sim`` extra; without it the commands write JSON and markdown only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def plots_available(command: str) -> bool:
    """True when matplotlib imports; otherwise say so on stderr, naming ``command``."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"specpilot {command}: matplotlib is not installed (pip install "
              "'./benchmarks[sim]' in a checkout): writing JSON and markdown only", file=sys.stderr)
        return False
    return True


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """``fig`` laid out tight, written to ``path`` (110 dpi) and closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    pyplot().close(fig)
