"""Starting and stopping ``dgr worker`` processes on loopback (tracker code, demo, tests).

:meth:`WorkerProcess.spawn` runs the installed ``dgr`` entry point (the one beside the running
interpreter, else the first on ``PATH``), from any directory, and waits, bounded in time, for
its ``LISTENING HOST:PORT`` line; :meth:`~WorkerProcess.stop` sends SIGTERM and waits (bounded)
for a clean exit, then SIGKILLs. Use as a context manager, or call ``stop`` in a ``finally``.

A worker that exits (or hangs) before it listens is :class:`WorkerStartFailed`
(:class:`WorkerStartTimedOut`): one line saying which worker and what happened, then the last
lines of its log, which is otherwise in a temporary file nobody sees.
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import attrs

from dgr_engine.options import EngineOptions
from dgr_session.errors import DgrError

LOG_TAIL_LINES = 10
"""Lines of a worker's log that :class:`WorkerStartFailed` carries."""
_LOG_LINE_CHARS = 400


class WorkerStartFailed(DgrError, RuntimeError):
    """A worker process exited before it listened. ``str()`` is :attr:`summary` (which worker,
    its exit status) and then the last :data:`LOG_TAIL_LINES` lines of its log, indented: what
    a command prints as it is. Nothing of the process is left running."""

    def __init__(
        self, summary: str, *, command: Sequence[str], returncode: int | None, log: Sequence[str]
    ) -> None:
        self.summary = summary
        """One line: which worker, what happened."""
        self.command = tuple(command)
        self.returncode = returncode
        """Its exit status (negative: the signal that ended it; ``None``: it was stopped by
        the caller, after a timeout)."""
        self.log_tail = tuple(log)
        """The last lines of its log (stderr), oldest first."""
        if self.log_tail:
            lines = "\n".join(f"  {line}" for line in self.log_tail)
            super().__init__(f"{summary}; its last log lines:\n{lines}")
        else:
            super().__init__(f"{summary}; its log is empty")


class WorkerStartTimedOut(WorkerStartFailed, TimeoutError):
    """A worker process did not listen within its start-up time (it is stopped)."""


_SHOWN_FLAGS: dict[str, Callable[[str], str]] = {
    "--layers": lambda value: f"layers {value}",
    "--model": lambda value: Path(value).name,
}


def describe_command(args: Sequence[str]) -> str:
    """``dgr worker (layers 0:2, model.gguf)``: a worker's command in a few words."""
    words = list(args)
    dgr = [i for i, word in enumerate(words) if Path(word).name == "dgr"]
    words = words[dgr[0] :] if dgr else words  # past a runner's prefix (``ip netns exec H``)
    name = Path(words[0]).name if words else "process"
    if name == "dgr" and len(words) > 1:
        name = f"dgr {words[1]}"
    details = [
        shown(words[words.index(flag) + 1])
        for flag, shown in _SHOWN_FLAGS.items()
        if flag in words[:-1]
    ]
    return f"{name} ({', '.join(details)})" if details else name


def _log_tail(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return [
        line if len(line) <= _LOG_LINE_CHARS else line[: _LOG_LINE_CHARS - 3] + "..."
        for line in lines[-LOG_TAIL_LINES:]
    ]


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


@attrs.frozen
class WorkerPlacement:
    """Where a worker runs: the address it listens on, and the command prefix that runs it
    there (a host of ``tooling.host_lab``: ``ip netns exec NAME``). The default: here, on
    loopback."""

    host: str = "127.0.0.1"
    runner: tuple[str, ...] = ()


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
        runner: Sequence[str] = (),
    ) -> WorkerProcess:
        """Starts ``dgr worker`` and waits for its LISTENING line (:class:`WorkerStartTimedOut`
        after ``startup_timeout`` s, :class:`WorkerStartFailed` if it exits first, each with
        the last lines of its log; either way it is stopped).
        ``options`` defaults to the worker's own defaults. ``runner``: a command prefix that
        runs it elsewhere (a host of ``tooling.host_lab``, listening on ``host`` there). The
        workers of one machine share its cores: OpenMP's threads wait passively
        (``OMP_WAIT_POLICY=PASSIVE``, as the llama.cpp peers they are measured against) unless
        the environment says otherwise."""
        args = [
            *runner,
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
            # never the caller's terminal: a worker reads nothing, and one holding a terminal
            # open keeps it (and a terminal multiplexer's pane) alive after its caller ends
            stdin=subprocess.DEVNULL,
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
                raise WorkerStartTimedOut(
                    f"{describe_command(self.args)} not listening after {timeout:g} s",
                    command=self.args,
                    returncode=None,
                    log=_log_tail(self.stderr_text()),
                )
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait(5.0)
                how = f"exited with {code}" if code >= 0 else f"was killed by signal {-code}"
                raise WorkerStartFailed(
                    f"{describe_command(self.args)} {how} before listening",
                    command=self.args,
                    returncode=code,
                    log=_log_tail(self.stderr_text()),
                )
            if line.startswith("LISTENING "):
                self.address = line.split(" ", 1)[1]
                return
