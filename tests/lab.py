"""The host lab for tests (``dgr_engine.tooling.host_lab``): made where the machine allows it;
in CI (``CI`` set, as ``.ci/run`` runs, as root) it must be, so a test fails saying why it
could not; elsewhere (not root, no ``iptables``) the test is skipped saying why."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import IO

import pytest

from dgr_engine.tooling.host_lab import HostLab, unavailable


@contextlib.contextmanager
def host_lab(n_hosts: int) -> Iterator[HostLab]:
    why = unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the host lab cannot be made in CI: {why}")
        pytest.skip(f"the host lab cannot be made here: {why}")
    with HostLab(n_hosts) as lab:
        yield lab


@contextlib.contextmanager
def python_on(lab: HostLab, host: int, script: str) -> Iterator[IO[str]]:
    """Runs ``script`` (``python -c``, its first argument the host's address) on host
    ``host`` and waits for it to print ``up``; yields the rest of its output; kills it at
    the end."""
    process = subprocess.Popen(
        [*lab.runner(host), sys.executable, "-c", script, lab.address(host)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "up\n"
        yield process.stdout
    finally:
        process.kill()
        process.wait(10)
