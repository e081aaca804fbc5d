"""A connection's peer that vanishes without a word is found out (``wire/keepalive.py``): the
options are set on every TCP socket dgr holds, and between two hosts of the lab a socket whose
peer fell silent ends within ``IDLE_SECONDS + PROBES * PROBE_SECONDS`` (plus slack) instead of
waiting for minutes."""

from __future__ import annotations

import socket
import time

import pytest

from dgr_engine.wire.keepalive import (
    IDLE_SECONDS,
    PROBE_SECONDS,
    PROBES,
    UNACKNOWLEDGED_SECONDS,
    keep_alive,
)
from tests.lab import host_lab, python_on

WAITS = (
    "import socket, sys, time\n"
    "from dgr_engine.wire.keepalive import keep_alive\n"
    "s = socket.create_server((sys.argv[1], 9100))\n"
    "print('up', flush=True)\n"
    "c, _ = s.accept()\n"
    "keep_alive(c)\n"
    "began = time.monotonic()\n"
    "try:\n"
    "    c.recv(1)\n"
    "    print('eof', flush=True)\n"
    "except OSError as e:\n"
    "    print(type(e).__name__, round(time.monotonic() - began, 1), flush=True)\n"
)


def test_every_tcp_socket_gets_keepalive_and_a_user_timeout() -> None:
    with socket.socket() as sock:
        keep_alive(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == IDLE_SECONDS
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == PROBE_SECONDS
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == PROBES
        timeout_ms = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert timeout_ms == UNACKNOWLEDGED_SECONDS * 1000
    a, b = socket.socketpair()  # not TCP: left as it is
    with a, b:
        keep_alive(a)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0


@pytest.mark.slow  # about 20 s of waiting for the kernel to give up
def test_a_socket_whose_peer_fell_silent_ends_within_the_keepalive_bound() -> None:
    bound = IDLE_SECONDS + PROBES * PROBE_SECONDS
    with host_lab(1) as lab:
        address = lab.address(0)
        with python_on(lab, 0, WAITS) as said_by_waiter:
            with socket.create_connection((address, 9100), timeout=5.0):
                lab.silence(0)  # the waiter's probes reach nobody: its peer vanished
                began = time.monotonic()
                said = said_by_waiter.readline().split()
                took = time.monotonic() - began
    assert said and said[0] == "TimeoutError", said
    assert IDLE_SECONDS <= took <= bound + 10, (took, bound)  # minutes without keepalive
