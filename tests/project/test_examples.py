"""Every file in ``examples/`` runs as ``python examples/NAME.py`` and shows what it claims.

Each example is run as a subprocess from the repository root with this interpreter (dgr is
installed in it; the examples import nothing from the checkout by path), and must exit 0 and
print its key lines. A new example without a test here fails ``test_every_example_is_run``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT = 180  # seconds per example; each takes a few on 2 cores

#: Example file name -> lines its output must contain (regular expressions, one per line).
EXPECTED: dict[str, list[str]] = {
    "in_process_route.py": [
        r"^The capital of France is Paris\.$",
        r"^route \[\(0, 10\), \(10, 20\), \(20, 30\)\] == whole model: \[",
        r"^after the route change \(epoch 1\):",
        r"^in_process_route: OK$",
    ],
    "route_sessions.py": [
        r"^  killing stage 'b' \[1, 3\) mid-decode$",
        r"^s[012]: done, epoch 2, route changes 1, .*whole-model equal True$",
        r"^route_sessions: OK$",
    ],
    "tracker.py": [
        r"^127\.0\.0\.1:\d+ \[0,2\) model [0-9a-f]{12} .* lane certified \(fixture evidence\)"
        r" mutual TLS$",
        r"^  SIGKILL 127\.0\.0\.1:\d+ mid-decode$",
        r"^  epoch 2 stage 0 127\.0\.0\.1:\d+ rows prefill 0 decode \d+ replay \d+, replay after"
        r" dead \| same rows$",
        r"^s0: done, 1 route change\(s\)$",
        r"^  127\.0\.0\.1:\d+ \[\d,\d\) forwards \d+ rows \d+ .*bytes in \d+ out \d+$",
        r"^tracker: OK$",
    ],
    "property_suite.py": [
        r"^sessions ended: \{.*'done': [1-9]",
        r"^property_suite: OK$",
    ],
}


def run_example(name: str) -> str:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    for pattern in EXPECTED[name]:
        found = re.search(pattern, proc.stdout, flags=re.M)
        assert found, f"{name}: no {pattern!r} in\n{proc.stdout}"
    return proc.stdout


def test_every_example_is_run() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", ["in_process_route.py", "route_sessions.py", "property_suite.py"])
def test_in_process_example(name: str) -> None:
    run_example(name)


@pytest.mark.slow
def test_tracker_example_spawns_workers_and_stops_them() -> None:
    out = run_example("tracker.py")
    ports = {int(p) for p in re.findall(r"^127\.0\.0\.1:(\d+) \[", out, flags=re.M)}
    assert len(ports) == 4
    for port in ports:  # every worker it started is gone: nothing listens there any more
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
