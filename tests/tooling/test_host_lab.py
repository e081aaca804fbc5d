"""The host lab (``dgr_engine.tooling.host_lab``): hosts that reach each other over a bridge,
silence that answers nothing (no reset: a connect times out), a heal that lifts it, and a
close that leaves no namespace or interface behind. Needs root, ``ip`` and ``iptables``, as
CI has (``tests/lab.py``)."""

from __future__ import annotations

import socket
import subprocess

import pytest

from dgr_engine.tooling.host_lab import BENCHMARK_RANGE
from tests.lab import host_lab, python_on

SERVE = (
    "import socket,sys\n"
    "s = socket.create_server((sys.argv[1], 9000))\n"
    "print('up', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.sendall(b'hi')\n"
    "    c.close()\n"
)


def _hello(address: str, timeout: float) -> bytes:
    with socket.create_connection((address, 9000), timeout=timeout) as conn:
        return conn.recv(2)


def _names() -> str:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return namespaces + links


def test_hosts_talk_until_silenced_and_the_lab_leaves_nothing_behind() -> None:
    with host_lab(2) as lab:
        assert lab.subnet.subnet_of(BENCHMARK_RANGE)
        address = lab.address(1)
        with python_on(lab, 1, SERVE):
            assert _hello(address, 5.0) == b"hi"
            lab.silence(1)
            with pytest.raises(TimeoutError):  # dropped: no reset, no refusal, nothing
                _hello(address, 1.0)
            lab.heal(1)
            assert _hello(address, 5.0) == b"hi"
    assert f"dgr{lab.lab_id}" not in _names()
