"""Your own GGUF in one command: a real model no lock declares (SmolLM2 with another
``general.name``, so another content hash), under a fresh operator home, as a new user runs it.

Without ``--certify`` the route is refused in one line that names the command that fixes it
(and nothing is written); ``dgr serve --model PATH --spawn 2 --certify`` makes the operator's
lock (outside the checkout, its key 0600), certifies the lane with progress and serves an
answer equal to the whole model's; afterwards ``dgr certify --model PATH`` and ``dgr generate``
without the flag find that record, and ``generate --check`` is bit-exact."""

from __future__ import annotations

import hashlib
import json
import os
import select
import stat
import struct
import subprocess
import time
from pathlib import Path

import openai
import pytest

from benchmarks.serve_latency import ServerProcess
from dgr_engine.certification.lock import load_lock
from dgr_engine.cli._own_model import OPERATOR_HOME_ENV
from dgr_engine.client.text import prompt_ids, until_stop
from dgr_engine.gguf_check import check_gguf
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.tokenizer import Tokenizer
from dgr_engine.tooling.processes import WorkerProcess, dgr_command
from tests.harness import REPO, RealLane

QUESTION = "What is the capital of France?"
NEW_NAME = "My own model"


def renamed_gguf(source: Path, target: Path, name: str) -> Path:
    """A copy of ``source`` whose ``general.name`` is ``name`` padded to the old length (the
    header's size unchanged): another content hash, the same weights."""
    data = bytearray(source.read_bytes())
    key = b"general.name"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    (kind,) = struct.unpack_from("<I", data, at)
    assert kind == 8  # a string
    (length,) = struct.unpack_from("<Q", data, at + 4)
    text = name.encode().ljust(length, b" ")[:length]
    data[at + 12 : at + 12 + length] = text
    target.write_bytes(bytes(data))
    return target


@pytest.fixture
def own_gguf(smollm2_lane: RealLane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # the defaults a user has: no lock or evidence named; a fresh operator home
    monkeypatch.delenv("DGR_EVIDENCE_DIR", raising=False)
    monkeypatch.delenv("DGR_LOCK", raising=False)
    monkeypatch.setenv(OPERATOR_HOME_ENV, str(tmp_path / "operator"))
    return renamed_gguf(smollm2_lane.model, tmp_path / "my.gguf", NEW_NAME)


def _dgr(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [dgr_command(), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_an_undeclared_model_is_refused_in_one_line_naming_the_fix(
    own_gguf: Path, tmp_path: Path
) -> None:
    assert load_lock().real_model_of(_sha256(own_gguf)) is None  # no lock declares it
    done = _dgr("generate", "--model", str(own_gguf), "--spawn", "2", "--prompt", "Hi", "-n", "4")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"'dgr certify --model {own_gguf}'" in lines[0]
    assert "--certify" in lines[0]
    assert not (tmp_path / "operator").exists()  # refused: nothing written


def test_on_a_terminal_the_command_asks_first_and_a_no_is_the_refusal(
    own_gguf: Path, tmp_path: Path
) -> None:
    primary, secondary = os.openpty()
    argv = [dgr_command(), "generate", "--model", str(own_gguf), "--spawn", "2", "-n", "2"]
    proc = subprocess.Popen(
        [*argv, "--prompt", "Hi"], stdin=secondary, stdout=subprocess.PIPE, stderr=secondary
    )
    os.close(secondary)
    try:
        seen = _read_until(primary, b"[y/N] ", limit=120.0)
        assert b"certify it now under your own operator lock" in seen
        os.write(primary, b"n\n")
        assert proc.wait(60) == 2
        seen += _read_until(primary, None, limit=10.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(primary)
    assert f"'dgr certify --model {own_gguf}'".encode() in seen
    assert b"Traceback" not in seen
    assert not (tmp_path / "operator" / "models").exists()  # a no writes nothing


def _read_until(fd: int, marker: bytes | None, *, limit: float) -> bytes:
    """What the terminal shows until ``marker`` (``None``: until the program closes it), read
    for ``limit`` seconds at most."""
    seen = b""
    deadline = time.monotonic() + limit
    while marker is None or marker not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            if marker is None:
                return seen
            raise AssertionError(f"{marker!r} not shown in {limit:g} s: {seen[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the program closed the terminal
            chunk = b""
        if not chunk:
            if marker is None:
                return seen
            raise AssertionError(f"closed before {marker!r}: {seen[-2000:]!r}")
        seen += chunk
    return seen


def test_serve_certify_makes_the_operator_lock_certifies_and_serves(
    own_gguf: Path, tmp_path: Path, smollm2_lane: RealLane
) -> None:
    home = tmp_path / "operator"
    options = EngineOptions()
    server = ServerProcess.dgr(str(own_gguf), 2, options=options, extra=["--certify"])
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=40,
            temperature=0,
        )
        log = server.log.read_text()
    finally:
        assert server.stop() == 0
    assert answer.choices[0].message.content == _whole_answer(own_gguf, options)
    # the certification ran here, with progress, under the operator's own lock
    assert "under your operator lock" in log and "parity: bit-exact" in log, log[-3000:]
    (folder,) = (home / "models").iterdir()
    assert folder.name.startswith("my-own-model-")
    lock = load_lock(folder / "lock.json")
    assert lock.real_model_of(_sha256(own_gguf)) is not None
    assert not folder.resolve().is_relative_to(REPO)
    assert stat.S_IMODE((home / "certifier.pem").stat().st_mode) == 0o600
    assert (
        json.loads((REPO / "certification" / "lock.json").read_text())["real_models"]
        == (json.loads(lock.path.read_text())["real_models"][:-1])
    )  # the checkout's lock is untouched; the operator's adds the model
    # afterwards: dgr certify finds the record, generate needs no flag and is exact
    again = _dgr("certify", "--model", str(own_gguf))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "reusing record" in again.stdout or "certified under your operator lock" in (
        again.stdout
    )
    check = _dgr(
        "generate", "--model", str(own_gguf), "--spawn", "2", "--prompt", QUESTION, "--chat",
        "-n", "8", "--check",
    )  # fmt: skip
    assert check.returncode == 0, check.stderr
    assert "certified under your operator lock" in check.stderr
    # a worker started by hand with no lock named finds that record too (the command a dark
    # worker's refusal names then works); a client names the operator's lock to trust it
    with WorkerProcess.spawn(own_gguf, (0, 30)) as worker:
        assert "certified: real-hardware evidence" in worker.stderr_text()
        remote = _dgr(
            "generate", "--endpoints", worker.address, "--model", str(own_gguf),
            "--lock", str(lock.path), "--prompt", QUESTION, "--chat", "-n", "8", "--check",
        )  # fmt: skip
    assert remote.returncode == 0, remote.stderr


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _whole_answer(model: Path, options: EngineOptions) -> str:
    with Tokenizer(model) as tokenizer:
        prompt = prompt_ids(tokenizer, QUESTION, chat=True)
        tokens = whole_model_greedy(model, [prompt], 40, options)[0]
        stops = tokenizer.eog_tokens
        return tokenizer.decode([t for t in until_stop(tokens, stops) if t not in stops])


def test_the_rename_keeps_the_file_a_valid_gguf(tmp_path: Path, smollm2_lane: RealLane) -> None:
    renamed = renamed_gguf(smollm2_lane.model, tmp_path / "r.gguf", NEW_NAME)
    assert check_gguf(renamed).strings["general.name"].rstrip() == NEW_NAME
    assert renamed.stat().st_size == smollm2_lane.model.stat().st_size
    assert _sha256(renamed) != _sha256(smollm2_lane.model)
