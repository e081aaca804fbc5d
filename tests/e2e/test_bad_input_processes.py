"""``dgr worker`` answers a missing file, a bad number or a busy port with one line on stderr
and exit status 2, as every other subcommand does in-process
(``tests/cli/test_bad_input_every_subcommand.py``, whose table this runs)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from dgr_engine.tooling.processes import dgr_command
from tests.cli.test_bad_input_every_subcommand import (
    PROCESS_ROWS,
    check_one_line,
    fill,
    places_in,
)


@pytest.mark.parametrize(
    ("argv", "expected"), PROCESS_ROWS, ids=[" ".join(r[0]) for r in PROCESS_ROWS]
)
def test_a_worker_given_bad_input_says_so_in_one_line_and_exits_2(
    argv: tuple[str, ...], expected: str, tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        places = places_in(tmp_path, busy=str(busy.getsockname()[1]))
        done = subprocess.run(
            [dgr_command(), *fill(argv, places)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    check_one_line("", done.returncode, done.stderr, expected.format(**places))
