"""Attribute docstrings of dataclass fields: the one place a setting is documented.

A field's documentation is the string literal on the line(s) right after it (kopf's style)::

    @dataclass(frozen=True)
    class PolicyConfig:
        dwell_seconds: float = 5.0
        \"\"\"Minimum time a choice stays, seconds.\"\"\"

Python keeps no such docstring at run time, so the class's source is parsed (once per class).
Both the controller's settings and the engine plugin's derive their references from these
(Markdown tables, ``markdown_table``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import fields, is_dataclass
from functools import cache
from itertools import pairwise


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field of the dataclass ``cls`` -> its docstring, whitespace folded to one line.

    Raises TypeError when ``cls`` is not a dataclass or a field has no docstring: an
    undocumented setting is a bug, found at import of whatever derives from it.
    """
    if not is_dataclass(cls):
        raise TypeError(f"{cls.__qualname__} is not a dataclass")
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for stmt, after in pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    missing = [f.name for f in fields(cls) if not docs.get(f.name)]
    if missing:
        raise TypeError(f"{cls.__qualname__}: no docstring under field(s) {', '.join(missing)}")
    return {f.name: docs[f.name] for f in fields(cls)}


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table; a ``|`` inside a cell is escaped."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]
