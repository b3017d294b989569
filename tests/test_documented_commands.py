"""Every command that README.md and docs/*.md document exists and runs as written, at least as far
as its ``--help`` (nothing here starts a server or an engine).

Commands are read from the documents themselves, so a newly documented one is checked without
editing this file: each line of a fenced or indented code block and each inline code span is a
snippet; a snippet's ``# = COMMAND`` comment documents an equivalent command, checked too.

- ``specpilot CMD [SUB] ...``: ``--help`` of the command exits 0 and its usage names it (run
  in-process through ``specpilot.controller.cli.main``, the function the ``specpilot`` script runs);
  when the snippet is an invocation (a code-block line, or any snippet with options) and has no
  placeholder syntax (``|``, ``...``, ``[``), the whole argument list also parses.
- ``python SCRIPT ...``: the script exists, ``python SCRIPT --help`` exits 0 naming it, and every
  option the snippet passes is in that help.
- ``make TARGET``: the Makefile defines the target (parsed, not run: setup targets are slow).
- ``pytest PATH``: the path exists.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from specpilot.controller.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
PLACEHOLDER = re.compile(r"\||\.\.\.|\[")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
COMMAND_SUBSTITUTION = re.compile(r"^\s*[A-Z_][A-Z0-9_]*=\$\((.*)\)\s*$")
MAKE_TARGET = re.compile(r"^[a-z][\w-]*$")
# An indented line is a code block's (not a list item's continuation) if it starts a command.
COMMAND_START = re.compile(r"^(?:\S+=\S*\s+)*(?:\.venv/bin/)?(?:specpilot|python3?|make|pytest)\s")


@dataclass(frozen=True)
class Snippet:
    text: str
    where: str  # file:line
    block: bool  # a line of a code block (an invocation as typed), not an inline span


@dataclass(frozen=True)
class Command:
    tool: str  # "specpilot", "python", "make" or "pytest"
    words: tuple[str, ...]  # the arguments after the tool
    where: str
    invocation: bool  # worth parsing whole (see the module docstring)

    def __str__(self) -> str:
        return " ".join((self.tool, *self.words))


def snippets(path: Path) -> Iterator[Snippet]:
    fenced = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{n}"
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or (line.startswith("    ") and COMMAND_START.match(line.strip())):
            yield Snippet(line.strip(), where, block=True)
        else:
            for span in re.findall(r"`([^`\n]+)`", line):
                yield Snippet(span.strip(), where, block=False)


def commands(snippet: Snippet) -> Iterator[Command]:
    """The snippet's command and the equivalents its ``# =`` comments name."""
    for part in snippet.text.split("# ="):
        code = re.split(r"\s+#", part, maxsplit=1)[0]
        code = COMMAND_SUBSTITUTION.sub(r"\1", code)  # VAR=$(COMMAND): the command
        words = code.split()
        if words and words[-1] == "&":  # run in the background: the command is the same
            words.pop()
        while words and ENV_ASSIGNMENT.match(words[0]):
            words.pop(0)
        if not words:
            continue
        tool = words[0].removeprefix(".venv/bin/")
        tool = "python" if tool == "python3" else tool
        args = tuple(words[1:])
        if tool in ("specpilot", "python", "make", "pytest") and args:
            invocation = ((snippet.block or any(w.startswith("-") for w in args))
                          and not PLACEHOLDER.search(part))
            yield Command(tool, args, snippet.where, invocation)


DOCUMENTED = [c for doc in DOCUMENTS for s in snippets(doc) for c in commands(s)]


def of(tool: str) -> list[Command]:
    return [c for c in DOCUMENTED if c.tool == tool]


def _ids(cmds: list[Command]) -> list[str]:
    return [f"{c.where} {c}" for c in cmds]


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``specpilot ARGV`` in-process: (exit status, stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
    return status, out.getvalue()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions
                 if isinstance(a, argparse._SubParsersAction)), {})


def command_paths(words: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The (sub)command paths a snippet names: ``policy get|set`` names two, ``policy ...``
    names ``policy``; AssertionError for a word that is no command where one is expected."""
    paths: list[tuple[str, ...]] = [()]
    parser = build_parser(words[0])
    for word in words:
        choices = subcommands(parser)
        if not choices or word == "..." or word.startswith("-"):
            break
        names = word.split("|")
        unknown = [n for n in names if n not in choices]
        assert not unknown, f"{' '.join(('specpilot', *paths[0]))} has no command {unknown}"
        paths = [(*p, n) for p in paths for n in names]
        parser = choices[names[0]]
    return paths


def test_the_documents_are_read() -> None:
    """The extraction finds what the documents are known to show, so it cannot pass empty."""
    found = {str(c) for c in DOCUMENTED}
    for expected in ("specpilot policy get", "specpilot demo", "make test", "make sim",
                     "python benchmarks/plugin_overhead.py", "python proto/generate.py"):
        assert expected in found, expected


def test_the_specpilot_script_runs_controller_cli_main() -> None:
    """What makes running ``main`` in-process faithful to the installed ``specpilot``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["scripts"]["specpilot"] == "specpilot.controller.cli:main"


@pytest.mark.parametrize("cmd", of("specpilot"), ids=_ids(of("specpilot")))
def test_specpilot_command(cmd: Command) -> None:
    for path in command_paths(cmd.words):
        status, out = run_cli([*path, "--help"])
        assert status == 0, f"{cmd.where}: specpilot {' '.join(path)} --help: {out}"
        assert f"usage: specpilot {' '.join(path)}" in " ".join(out.split()), out
    if cmd.invocation:
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            try:
                build_parser(cmd.words[0]).parse_args(list(cmd.words))
            except SystemExit:
                pytest.fail(f"{cmd.where}: `{cmd}` does not parse: {errors.getvalue()}")


@pytest.mark.parametrize("cmd", of("python"), ids=_ids(of("python")))
def test_python_script(cmd: Command) -> None:
    if cmd.words[0] == "-m":  # python -m MODULE: argparse names it "python -m" or its file
        target, args = list(cmd.words[:2]), cmd.words[2:]
        named: tuple[str, ...] = ("python -m", cmd.words[1].rsplit(".", 1)[-1] + ".py")
    else:
        script = ROOT / cmd.words[0]
        assert script.is_file(), f"{cmd.where}: no {cmd.words[0]}"
        target, args, named = [str(script)], cmd.words[1:], (script.name,)
    done = subprocess.run([sys.executable, *target, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"{cmd.where}: `{cmd} --help`: {done.stderr}"
    assert any(f"usage: {n}" in done.stdout for n in named), (
        f"{cmd.where}: `{cmd} --help` shows no usage")
    for option in (w.split("=")[0] for w in args if w.startswith("--")):
        assert option in done.stdout, f"{cmd.where}: `{cmd}`: no option {option}"


def makefile_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        rule = re.match(r"^([^\s#:=][^:=]*?)\s*::?(?!=)", line)
        if rule and not line.startswith("\t"):
            targets.update(rule.group(1).split())
    return targets


@pytest.mark.parametrize("cmd", of("make"), ids=_ids(of("make")))
def test_make_target(cmd: Command) -> None:
    targets = [w for w in cmd.words if MAKE_TARGET.match(w)]
    assert targets, f"{cmd.where}: `{cmd}` names no target"
    missing = set(targets) - makefile_targets()
    assert not missing, f"{cmd.where}: the Makefile has no target {sorted(missing)}"


@pytest.mark.parametrize("cmd", of("pytest"), ids=_ids(of("pytest")))
def test_pytest_path(cmd: Command) -> None:
    for path in (w for w in cmd.words if not w.startswith("-")):
        assert (ROOT / path.split("::")[0]).exists(), f"{cmd.where}: no {path}"
