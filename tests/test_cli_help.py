"""``specpilot ... --help`` reads as a command's help: no reST markup (double backquotes) and no
talk of the modules behind it."""

from __future__ import annotations

import re

import pytest

from specpilot.controller.cli import main

COMMANDS = [["serve"], ["check"], ["settings"], ["simulate"], ["demo"], ["models"], ["bench"],
            ["policy"], *(["policy", action] for action in
                          ("get", "set", "clear", "watch", "explain", "recommend")), []]
INTERNAL = re.compile(r"``|\bcontroller/|\bcontroller\.[a-z]|wired into")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "specpilot")
def test_help_has_no_markup_and_no_module_names(command: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "usage: specpilot" in text
    assert not INTERNAL.findall(text), [line for line in text.splitlines()
                                        if INTERNAL.search(line)]
