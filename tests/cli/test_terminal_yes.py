"""The clear yes a command asks for on a terminal before certifying the user's own model
(``dgr_engine/cli/_own_model.terminal_yes``): only ``y`` or ``yes`` is a yes; without a
terminal nothing is asked or read."""

from __future__ import annotations

import io

import pytest

from dgr_engine.cli._own_model import terminal_yes


class Terminal(io.StringIO):
    def __init__(self, text: str = "", *, tty: bool = True) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("answer", "yes"),
    [("y\n", True), ("yes\n", True), (" Yes \n", True), ("\n", False), ("n\n", False),
     ("yep\n", False), ("", False)],
)  # fmt: skip
def test_only_a_clear_yes_is_a_yes(answer: str, yes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    shown = Terminal()
    monkeypatch.setattr("sys.stdin", Terminal(answer))
    monkeypatch.setattr("sys.stderr", shown)
    assert terminal_yes("certify it now? [y/N] ") is yes
    assert shown.getvalue() == "certify it now? [y/N] "


def test_without_a_terminal_nothing_is_asked_or_read(monkeypatch: pytest.MonkeyPatch) -> None:
    piped, shown = Terminal("y\n", tty=False), Terminal()
    monkeypatch.setattr("sys.stdin", piped)
    monkeypatch.setattr("sys.stderr", shown)
    assert terminal_yes("certify it now? [y/N] ") is False
    assert shown.getvalue() == "" and piped.read() == "y\n"
