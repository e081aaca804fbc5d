"""``dgr worker``'s command line refuses nonsense (issue 12, item 5): out-of-range values in
the parser, a context the model was not trained for or the machine cannot hold, a truncated or
corrupt GGUF, a busy port — each in one line, exit status 2, nothing allocated — and SIGTERM
is honoured while the model loads."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from dgr_engine.errors import InvalidArgument, ModelLoadError
from dgr_engine.fixtures.split import ensure_split
from dgr_engine.gguf_check import check_gguf
from dgr_engine.testing import write_corrupt_copy, write_truncated_copy
from dgr_engine.tooling.processes import dgr_command
from dgr_engine.worker.engine_access import preflight as preflight_module
from dgr_engine.worker.engine_access.preflight import preflight


def worker(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [dgr_command(), "worker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and "STOPPED" not in result.stdout
    return lines[0]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-sessions", "-1"),
        ("--max-sessions", "99999999999"),
        ("--ctx", "-1"),
        ("--ctx", "100000000"),
        ("--batch", "-1"),
        ("--threads", "0"),
        ("--port", "70000"),
        ("--port", "-1"),
        ("--session-lease", "-5"),
        ("--max-message-bytes", "10"),
        ("--grace", "-1"),
        ("--grace", "nan"),
        ("--admission-wait", "-1"),
        ("--stall-seconds", "inf"),
        ("--resume-grace", "-0.5"),
        ("--inline-max-rows", "-1"),
        ("--max-sessions", "four"),
    ],
)
def test_out_of_range_values_are_refused_by_the_parser(
    tiny_llama: Path, flag: str, value: str
) -> None:
    line = one_line(worker("--model", str(tiny_llama), "--layers", "0:4", flag, value))
    assert line.startswith(f"dgr worker: error: argument {flag}: "), line
    assert value in line or "expected" in line


def test_a_storage_root_without_a_manifest_is_refused(tiny_llama: Path) -> None:
    line = one_line(worker("--model", str(tiny_llama), "--layers", "0:4", "--root", "/srv"))
    assert line == "dgr worker: error: --root and --allow-temp-root go with --manifest"


def test_a_split_model_root_under_home_is_refused(tmp_path: Path) -> None:
    manifest = tmp_path / "m.json"
    manifest.write_text("{}")
    line = one_line(worker("--manifest", str(manifest), "--layers", "0:4", "--root", "/srv"))
    assert "m.json: schema None: this dgr reads 'dgr.manifest/1'" in line
    split = ensure_split("tiny-llama-split")
    args = ["--manifest", str(split.manifest_path), "--layers", "0:4", "--root", "/home/x/m"]
    line = one_line(worker(*args))
    assert "storage root /home/x/m is under /home" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--metrics-tls"], "--metrics-host and --metrics-tls go with --metrics-port"),
        (
            ["--metrics-host", "127.0.0.1"],
            "--metrics-host and --metrics-tls go with --metrics-port",
        ),
        (["--metrics-port", "0", "--metrics-tls"], "--metrics-tls needs --tls-cert and --tls-key"),
    ],
)
def test_metrics_flags_that_cannot_be_served_are_one_line(
    tiny_llama: Path, args: list[str], expected: str
) -> None:
    line = one_line(worker("--model", str(tiny_llama), "--layers", "0:4", *args))
    assert line == f"dgr worker: error: {expected}"


def test_a_context_beyond_the_training_context_is_refused_before_loading(
    tiny_llama: Path,
) -> None:
    line = one_line(worker("--model", str(tiny_llama), "--layers", "0:4", "--ctx", "4096"))
    assert "--ctx 4096 exceeds the model's training context (512)" in line


def test_a_kv_cache_the_machine_cannot_hold_is_refused(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preflight_module, "mem_available_bytes", lambda: 1 << 20)
    with pytest.raises(InvalidArgument, match=r"needs about .* GiB of KV cache for 4 layer"):
        preflight(tiny_llama, (0, -1), n_ctx_per_session=512, max_sessions=64)
    header = preflight(tiny_llama, (0, 2), n_ctx_per_session=8, max_sessions=1)
    assert (header.arch, header.n_layer, header.context_length) == ("llama", 4, 512)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncated-data", "truncated GGUF: tensor '"),
        ("truncated-header", "truncated GGUF: the header ends early"),
        ("magic", "not a GGUF file (magic b'XXXX'"),
        ("version", "unsupported GGUF version"),
        ("tensor_count", "not a plausible header"),
    ],
)
def test_a_damaged_gguf_is_named_in_one_line(
    tiny_llama: Path, tmp_path: Path, damage: str, expected: str
) -> None:
    bad = tmp_path / f"{damage}.gguf"
    if damage == "truncated-data":
        write_truncated_copy(tiny_llama, bad, 0.5)
    elif damage == "truncated-header":
        write_truncated_copy(tiny_llama, bad, 0.001)
    else:
        write_corrupt_copy(tiny_llama, bad, damage)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match=str(bad)):
        check_gguf(bad)
    line = one_line(worker("--model", str(bad), "--layers", "0:4"))
    assert f"cannot start the worker: {bad}: " in line and expected in line, line
    assert "reshape" not in line


def test_a_busy_port_is_one_line_and_no_stopped(tiny_llama: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line(worker("--model", str(tiny_llama), "--layers", "0:4", "--port", str(port)))
    assert line.endswith(f"cannot serve on 127.0.0.1:{port}: the port is in use"), line


def test_sigterm_while_loading_stops_at_once(tmp_path: Path) -> None:
    """The model is a FIFO nobody writes: loading never ends (storage that hangs)."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [dgr_command(), "worker", "--model", str(fifo), "--layers", "0:4", "--log-level", "DEBUG"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        while True:  # bounded: each line within 60 s, and the process ends the stream
            line = lines.get(timeout=60)
            assert line is not None, "the worker ended before loading"
            if "loading layers" in line:
                break
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)  # stdout holds one line: no reader needed while it runs
        assert proc.stdout is not None
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)
    assert proc.returncode == 0
    assert out.strip() == "STOPPED sessions_closed=0"
