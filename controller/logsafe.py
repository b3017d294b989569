"""Names that clients choose (engine ids, draft and class names, request text), fit for a log
line or a terminal: a name is written as Python's ``repr`` writes a string, so a line break
cannot forge a log line, an ANSI escape cannot move a terminal's cursor and a NUL cannot cut a
line short, and it is cut to a bounded length."""

from __future__ import annotations

NAME_LIMIT = 120  # characters of a name kept in a log line


def safe_name(value: object, limit: int = NAME_LIMIT) -> str:
    """``value`` quoted with every control, format and separator character escaped (``\\n``,
    ``\\x1b``, ``\\x00``, ``\\u2028``), cut to ``limit`` characters (the cut is marked with the
    full length)."""
    text = str(value)
    if len(text) > limit:
        return f"{text[:limit]!r}...({len(text)} characters)"
    return repr(text)


def shown(value: object) -> str:
    """``value`` as is when every character of it is printable (a table cell stays readable),
    else ``safe_name(value)``: what the CLI prints of a name an engine chose."""
    text = str(value)
    return text if text.isprintable() else safe_name(text)
