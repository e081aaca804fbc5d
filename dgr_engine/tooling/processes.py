"""Starting and stopping ``dgr worker`` processes on loopback (tracker code, demo, tests).

:meth:`WorkerProcess.spawn` runs the installed ``dgr`` entry point (the one beside the running
interpreter, else the first on ``PATH``), from any directory, and waits, bounded in time, for
its ``LISTENING HOST:PORT`` line; :meth:`~WorkerProcess.stop` sends SIGTERM and waits (bounded)
for a clean exit, then SIGKILLs. Use as a context manager, or call ``stop`` in a ``finally``.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from dgr_engine.options import EngineOptions


def dgr_command() -> str:
    """The path of the installed ``dgr`` program; ``FileNotFoundError`` if dgr is not
    installed (``pip install .``)."""
    beside = Path(sys.executable).with_name("dgr")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("dgr")
    if found is None:
        raise FileNotFoundError(
            f"no `dgr` program beside {sys.executable} or on PATH: install dgr (pip install .)"
        )
    return found


def worker_omp_wait_policy() -> str:
    """``OMP_WAIT_POLICY`` of the workers the tooling starts: this environment's, else
    ``PASSIVE`` (the workers of one machine share its cores)."""
    return os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


class WorkerProcess:
    """One worker subprocess. ``address`` is ``host:port`` once spawned."""

    def __init__(self, proc: subprocess.Popen[str], stderr: IO[bytes], args: list[str]) -> None:
        self.proc = proc
        self.args = args
        self.address = ""
        self.stdout_lines: list[str] = []
        self._stderr = stderr
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    @classmethod
    def spawn(
        cls,
        model: str | os.PathLike[str],
        layers: tuple[int, int],
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        options: EngineOptions | None = None,
        log_level: str = "INFO",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
    ) -> WorkerProcess:
        """Starts ``dgr worker`` and waits for its LISTENING line (``TimeoutError`` after
        ``startup_timeout`` s, ``RuntimeError`` if it exits first; either way it is stopped).
        ``options`` defaults to the worker's own defaults. The workers of one machine share
        its cores: OpenMP's threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, as the
        llama.cpp peers they are measured against) unless the environment says otherwise."""
        args = [
            dgr_command(),
            "worker",
            "--model",
            str(model),
            "--layers",
            f"{layers[0]}:{layers[1]}",
            "--host",
            host,
            "--port",
            str(port),
            *(options or EngineOptions()).worker_argv(),
            "--log-level",
            log_level,
            *extra_args,
        ]
        env = {**os.environ, "OMP_WAIT_POLICY": worker_omp_wait_policy()}
        return cls.launch(args, startup_timeout, env=env)

    @classmethod
    def launch(
        cls,
        args: Sequence[str],
        startup_timeout: float = 60.0,
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> WorkerProcess:
        """Starts ``args`` (a program that prints "LISTENING host:port" when ready) and waits
        for that line; a process that does not get there is stopped."""
        stderr = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            list(args),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=cwd,
            env=None if env is None else dict(env),
        )
        worker = cls(proc, stderr, list(args))
        try:
            worker._await_listening(startup_timeout)
        except BaseException:
            worker.kill()
            raise
        return worker

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait up to ``timeout`` s, else SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._reader.join(timeout)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash: no session is closed) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(15.0)
        self._reader.join(15.0)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line.rstrip("\n"))
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _await_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"worker {self.args} not listening after {timeout} s")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(5.0)
                raise RuntimeError(
                    f"worker exited with {self.proc.returncode} before listening:\n"
                    f"{self.stderr_text()[-4000:]}"
                )
            if line.startswith("LISTENING "):
                self.address = line.split(" ", 1)[1]
                return
