"""Every ``dgr`` subcommand answers a missing file, a bad number or an unreachable endpoint
with one line on stderr and exit status 2, never a traceback.

The table covers every subcommand of ``dgr_engine.cli._SUBCOMMANDS`` (a subcommand without a
row fails :func:`test_every_subcommand_has_rows`). Rows run in-process through
``dgr_engine.cli.main`` where that starts no worker; ``dgr worker`` itself runs as a process,
in ``tests/e2e/test_bad_input_processes.py`` (:data:`PROCESS_ROWS`). Placeholders:
``{missing}`` a path that does not exist, ``{not_gguf}`` a file that is no GGUF, ``{port}`` a
loopback port nothing listens on, ``{tmp}`` an empty directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from dgr_engine import cli
from tests.harness import closed_port

Row = tuple[tuple[str, ...], str]
"""A command line (placeholders in braces) and a text its one line must hold."""

ROWS: tuple[Row, ...] = (
    (("generate", "--spawn", "0", "--fixture", "tiny-llama"), "--spawn"),
    (("generate", "--endpoints", "127.0.0.1:{port}", "--ids"), "127.0.0.1:{port}"),
    (("generate", "--spawn", "2", "--fixture", "tiny-llama", "--temperature", "-1"), "temperature"),
    (("chat", "--spawn", "2", "--model", "{missing}"), "{missing}"),
    (("chat", "--endpoints", "127.0.0.1:{port}", "--vocab", "{missing}"), "{missing}"),
    (("chat", "--spawn", "99", "--fixture", "tiny-llama"), "--spawn"),
    (("serve", "--spawn", "2", "--model", "{missing}"), "{missing}"),
    (("serve", "--endpoints", "127.0.0.1:{port}", "--vocab", "{not_gguf}"), "{not_gguf}"),
    (("serve", "--spawn", "2", "--fixture", "tiny-llama", "--port", "-5"), "--port"),
    (
        ("serve", "--spawn", "2", "--fixture", "tiny-llama", "--api-key-file", "{missing}"),
        "{missing}",
    ),
    (("serve", "--spawn", "2", "--fixture", "tiny-llama", "--api-key", "two words"), "API key"),
    (("generate", "--spawn", "2", "--model", "{missing}"), "{missing}"),
    (("generate", "--endpoints", "127.0.0.1:{port}", "--ids", "-n", "many"), "many"),
    (("generate", "--endpoints", "127.0.0.1:{port}", "--ids", "--lock", "{missing}"), "{missing}"),
    (("demo", "--model", "{missing}"), "{missing}"),
    (("demo", "--fixture", "tiny-llama", "--stages", "0"), "into 0 stages"),
    (("fixtures", "build", "no-such-fixture"), "no-such-fixture"),
    (("models", "fetch", "no-such-model"), "no-such-model"),
    (("models", "path", "no-such-model"), "no-such-model"),
    (("certify", "--model", "{missing}"), "{missing}"),
    (("certify", "--model", "{not_gguf}"), "{not_gguf}"),
    (("certify", "--fixture", "tiny-llama", "--ctx", "0"), "--ctx"),
    (("certify", "--fixture", "tiny-llama", "--lock", "{missing}"), "{missing}"),
    (("certify", "--fixture", "tiny-llama", "--sign-key", "{missing}"), "{missing}"),
    (("baseline", "--model", "{missing}"), "{missing}"),
    (("baseline", "{missing}"), "{missing}"),
    (("baseline", "--threads", "0", "--fixture", "hf-llama-gqa"), "--threads"),
    (("mtp", "--model", "{missing}"), "{missing}"),
    (("mtp", "--model", "{not_gguf}"), "{not_gguf}"),
    (("mtp", "--stages", "1"), "--stages"),
    (("mtp", "--lock", "{missing}"), "{missing}"),
    (("artifacts", "manifest", "{missing}"), "{missing}"),
    (("artifacts", "manifest", "{not_gguf}", "--chunk-mib", "0"), "--chunk-mib"),
    (("artifacts", "verify", "{missing}", "--root", "{tmp}", "--allow-temp-root"), "{missing}"),
    (("lock", "show", "--lock", "{missing}"), "{missing}"),
    (("lock", "declare-certifier", "--name", "n", "--key", "{missing}"), "{missing}"),
    (("gate", "DGR-054", "--lock", "{missing}"), "{missing}"),
    (("gate", "DGR-054", "--evidence", "{missing}"), "{missing}"),
)
"""Rows run in-process."""

PROCESS_ROWS: tuple[Row, ...] = (
    (("worker", "--model", "{missing}", "--layers", "0:2"), "{missing}"),
    (("worker", "--fixture", "tiny-llama", "--layers", "0:2", "--ctx", "0"), "--ctx"),
    (("worker", "--fixture", "tiny-llama", "--layers", "0:99"), "[0, 99)"),
    (("worker", "--fixture", "tiny-llama", "--layers", "0:2", "--port", "{busy}"), "in use"),
)
"""Rows of subcommands that are a worker process themselves (``{busy}``: a port in use)."""


def fill(row: Sequence[str], places: dict[str, str]) -> list[str]:
    return [word.format(**places) for word in row]


def places_in(tmp: Path, **more: str) -> dict[str, str]:
    """The placeholders' values under ``tmp``."""
    not_gguf = tmp / "not-a-model.gguf"
    not_gguf.write_bytes(b"no GGUF here")
    empty = tmp / "empty"
    empty.mkdir()
    missing = str(tmp / "no-such-file.gguf")
    return {"missing": missing, "not_gguf": str(not_gguf), "tmp": str(empty), **more}


def check_one_line(command: str, code: int | str | None, err: str, expected: str) -> None:
    """Exit 2, and stderr exactly one line holding ``expected``, no traceback."""
    lines = err.splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert expected in lines[0], lines[0]
    assert command in lines[0], lines[0]


def test_every_subcommand_has_rows() -> None:
    covered = {argv[0] for argv, _ in ROWS + PROCESS_ROWS}
    assert covered == set(cli._SUBCOMMANDS), set(cli._SUBCOMMANDS) ^ covered


@pytest.mark.parametrize(("argv", "expected"), ROWS, ids=[" ".join(r[0]) for r in ROWS])
def test_a_bad_input_is_one_line_and_exit_2(
    argv: tuple[str, ...], expected: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    places = places_in(tmp_path, port=str(closed_port()))
    try:
        code: int | str | None = cli.main(fill(argv, places))
    except SystemExit as exit_:  # argparse's own one line
        code = exit_.code
    check_one_line(f"dgr {argv[0]}", code, capfd.readouterr().err, expected.format(**places))


class Surprise(Exception):
    """What no subcommand expects."""


def test_an_unexpected_error_is_one_line_naming_its_type_and_how_to_see_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def boom(args: object) -> int:
        raise Surprise("it broke\nin two lines")

    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.setattr(cli.subcommand("gate"), "run", boom)
    assert cli.main(["gate", "DGR-054"]) == 2
    err = capfd.readouterr().err
    assert err == (
        "dgr gate: unexpected Surprise: it broke in two lines (run with DGR_DEBUG=1 for the "
        "traceback)\n"
    )
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(Surprise):
        cli.main(["gate", "DGR-054"])


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (
            FileNotFoundError(2, "No such file or directory", "/x/y.gguf"),
            "dgr lock: /x/y.gguf: No such file or directory",
        ),
        (ValueError("a\nb"), "dgr lock: a b"),
        (PermissionError(), "dgr lock: PermissionError"),
    ],
)
def test_an_expected_error_is_its_message_on_one_line(
    error: Exception, line: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def fail(args: object) -> int:
        raise error

    monkeypatch.setattr(cli.subcommand("lock"), "run", fail)
    assert cli.main(["lock", "show"]) == 2
    assert capfd.readouterr().err == f"{line}\n"


def test_ctrl_c_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.subcommand("gate"), "run", interrupted)
    assert cli.main(["gate", "DGR-054"]) == 130
    assert capfd.readouterr().err == "dgr gate: interrupted\n"
