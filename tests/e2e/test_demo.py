"""README command 1: worker processes on loopback, a stage SIGKILLed mid-decode, a new route
under a new epoch, output equal to the whole model; every process stopped, also on Ctrl-C. By
default on the real model SmolLM2-135M-Instruct (a chat answer, text equal to the whole
model's), with --fixture on the generated fixtures."""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dgr_engine import cli
from dgr_engine.tooling.processes import dgr_command


def demo_main(args: list[str]) -> int:
    return cli.main(["demo", *args])


pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def dgr_sh_command(branch: str) -> list[str]:
    """The program ``./dgr.sh BRANCH`` execs once its venv is ready, with this test run's venv
    (the one ``dgr.sh`` made) for ``.venv/bin``."""
    script = (ROOT / "dgr.sh").read_text()
    body = script.split(f"    {branch})\n", 1)[1].split(";;", 1)[0]
    (line,) = [s.strip() for s in body.splitlines() if s.strip().startswith("exec ")]
    words = [w for w in shlex.split(line)[1:] if w != "$@"]
    venv_bin = Path(sys.executable).parent
    return [
        str(venv_bin / w.removeprefix(".venv/bin/")) if w.startswith(".venv/") else w for w in words
    ]


def test_dgr_sh_demo_runs_the_dgr_demo_program() -> None:
    command = dgr_sh_command("demo")
    assert Path(command[0]).name == "dgr" and command[1:] == ["demo"], command
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "PARITY OK" in done.stdout, done.stdout + done.stderr


def pids_in(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"\bpid (\d+)", text)]


def assert_gone(pids: list[int], out: str = "") -> None:
    assert pids, out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped by the demo
            print(f"pid {pid} is still there\n{out}")


def untracked() -> set[str]:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return {line[3:] for line in done.stdout.splitlines() if line.startswith("??")}


def assert_chat_answer(out: str) -> None:
    """The chat demo's answer: streamed, a stage lost mid-answer and recovered on the spare,
    the text equal to the whole model's, every phase timed."""
    assert "model     smollm2-135m-instruct: SmolLM2-135M-Instruct.Q4_1.gguf (30 layers" in out
    assert (
        "lanes     certified with REAL-HARDWARE evidence (a real model on a hardware lane the "
        "lock declares: this machine and build); sessions require real-hardware evidence"
    ) in out, out
    assert "security  mutual TLS (a throwaway local CA) and route grants" in out
    assert re.search(r"^question  What is the capital of France\?  \(the model's chat", out, re.M)
    assert re.search(r"SIGKILL stage 1 \[10,20\) pid \d+ .* mid-decode", out), out
    assert out.count("new route:") == 1 and "(spare)" in out, out
    assert "epoch 2: re-prefill from position 0" in out, out
    # the answer streams before and after the loss, and is the whole model's
    answer = re.findall(r"^answer    (?:\.\.\. )?(.*)$", out, re.M)
    assert len(answer) == 2, out
    (whole,) = re.findall(r"^whole     (.*)$", out, re.M)
    assert whole == "The capital of France is Paris.", out
    assert " ".join(answer) == whole, out
    assert "text equal to the route's: True" in out and "stopped at the end-of-turn token" in out
    assert "epoch 1 -> 2  route changes 1" in out and "whole-model equal: True" in out, out
    (timings,) = re.findall(r"^timings   (.*)$", out, re.M)
    for phase in ("fetch", "certify", "workers", "first token", "recovery", "total"):
        assert re.search(rf"{phase} \d+\.\d\d s", timings), timings
    assert out.rstrip().endswith("PARITY OK"), out
    assert_gone(pids_in(out), out)


def test_the_default_demo_answers_a_chat_question_from_smollm2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = untracked()
    # first as an operator of their own machine whose lane no committed record covers: the
    # demo declares the model and this machine in a lock of its own, certifies the lane under
    # it (real-hardware: the lock's hardware lane is this machine) and routes over it
    operator = tmp_path / "operator"
    own = ["--operator-dir", str(operator), "--evidence", str(operator / "evidence")]
    assert demo_main(own) == 0
    out = capsys.readouterr().out
    assert "you are the operator of your own machine" in out, out
    assert "operator lock new (its time is now)" in out, out
    assert re.search(r"^record .*/real-hardware/[0-9a-f]{64}/[0-9a-f]{64}\.json", out, re.M), out
    assert (operator / "lock.json").is_file() and (operator / "certifier.pem").is_file()
    assert_chat_answer(out)

    # then as a user runs it (the checkout's evidence, not the suite's empty directory): the
    # committed records of the repo's lock where they cover this machine, else the operator
    # lock (kept) and the record just made under it
    monkeypatch.delenv("DGR_EVIDENCE_DIR", raising=False)
    assert demo_main(["--operator-dir", str(operator)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^reusing record .*\.json \(same lane, (the repo's|your) lock\)$", out, re.M)
    assert "certifying the lane" not in out, out
    assert_chat_answer(out)
    assert untracked() == before  # nothing left in the checkout


def test_demo_loses_a_stage_and_recovers_with_parity(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["--fixture", "tiny-llama", "--stages", "4", "--sessions", "2", "--steps", "10"]
    args += ["--lose-at", "3"]
    assert demo_main([*args, "--evidence", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # no record of this lane yet: the demo certifies it first, and says what evidence that is
    assert "certify   the fixture lane on this machine" in out, out
    assert re.search(
        r"^record .*/fixture/[0-9a-f]{64}/[0-9a-f]{64}\.json \(fixture evidence\)", out, re.M
    )
    assert "lanes     certified with FIXTURE evidence (generated model: not real-model" in out
    assert "security  mutual TLS (a throwaway local CA) and route grants" in out
    assert re.search(r"SIGKILL stage 1 \[1,2\) pid \d+", out), out
    assert out.count("new route:") == 2 and "(spare)" in out, out
    assert out.count("epoch 2: re-prefill from position 0") == 2, out
    replays = re.findall(
        r"the prompt and (\d+) accepted tokens in batched forwards \(first call (\d+) tokens\)", out
    )
    assert len(replays) == 2, out
    assert all(int(call) == 12 + int(k) for k, call in replays), out  # prompt + tokens at once
    assert out.count("epoch 1 -> 2  route changes 1") == 2, out
    assert out.count("whole-model equal: True") == 2, out
    assert "boundary bytes between stages" in out and "killed" in out, out
    assert out.rstrip().endswith("PARITY OK"), out
    assert_gone(pids_in(out), out)

    # the record of exactly this lane is reused by the next run
    again = ["--fixture", "tiny-llama", "--stages", "2", "--sessions", "1", "--steps", "4"]
    assert demo_main([*again, "--lose-at", "2", "--evidence", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^reusing record .*\.json \(same lane, the repo's lock\)$", out, re.M), out
    assert out.rstrip().endswith("PARITY OK"), out


def test_demo_on_tiny_v4_with_a_replacement_spawned_on_demand(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["--fixture", "tiny-v4", "--sessions", "2", "--steps", "12", "--no-spare"]
    args += ["--operator-dir", str(tmp_path)]  # its record goes there, not to dgr's cache
    assert demo_main(args) == 0
    out = capsys.readouterr().out
    assert "+token ids" in out, out  # stage [2,4) owns hash-routed layer 2
    assert "(replacement)" in out and "spare" not in out, out
    assert out.count("whole-model equal: True") == 2, out
    assert out.rstrip().endswith("PARITY OK"), out
    assert_gone(pids_in(out), out)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_demo_stops_every_worker(sig: signal.Signals, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    # A suite started as a background job (`cmd &` in a shell without job control) inherits
    # SIGINT ignored, and so would the demo, which then never sees the signal. A handler set
    # here is reset to the default in the child at exec, as in a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            # long enough (8 x 240 tokens) that the signal lands mid-run even on a loaded box
            [*dgr_sh_command("demo"), "--fixture", "tiny-llama", "--sessions", "8", "--steps"]
            + ["240", "--lose-at", "239", "--operator-dir", str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    lines: queue.Queue[str | None] = queue.Queue()
    errors: list[str] = []

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def drain_stderr() -> None:
        assert proc.stderr is not None
        errors.extend(proc.stderr)

    # one reader per pipe, and nothing else reads them (communicate() would race the readers)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    err_reader = threading.Thread(target=drain_stderr, daemon=True)
    err_reader.start()
    seen: list[str] = []
    try:
        while True:
            line = lines.get(timeout=60)
            assert line is not None, f"demo ended early: {''.join(seen)}{''.join(errors)}"
            seen.append(line)
            if line.startswith("sessions"):  # the workers run and the sessions have started
                break
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)
    err_reader.join(10)
    err = "".join(errors)
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    out = "".join(seen)
    assert proc.returncode == 130, out + err
    assert "interrupted: every worker stopped" in err
    assert "PARITY" not in out
    assert len(pids_in(out)) == 4  # three stages and a spare
    assert_gone(pids_in(out))


def test_a_fixture_demo_explains_its_speed_lines_and_leaves_the_checkout_as_it_was(
    tmp_path: Path,
) -> None:
    # as a user runs it from the checkout, under a lock no committed record counts under (a
    # new one made from the repo's), so the demo certifies its lane and writes a record
    lock = tmp_path / "lock.json"
    made = subprocess.run(
        [dgr_command(), "lock", "new", str(lock)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    env = {k: v for k, v in os.environ.items() if k != "DGR_EVIDENCE_DIR"}
    env.update(DGR_LOCK=str(lock), DGR_CACHE_DIR=str(tmp_path / "cache"))
    before = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    args = ["--fixture", "tiny-llama", "--stages", "2", "--sessions", "1", "--steps", "6"]
    done = subprocess.run(
        [*dgr_sh_command("demo"), *args, "--lose-at", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    out = done.stdout
    assert done.returncode == 0 and out.rstrip().endswith("PARITY OK"), out + done.stderr
    after = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert after == before  # no record (nor anything else) left in the checkout

    # the record went to the demo's own folder ($DGR_CACHE_DIR/demo here, ~/.cache/dgr/demo)
    records = tmp_path / "cache" / "demo" / "evidence"
    assert f"certify   the fixture lane on this machine (records in {records})" in out, out
    (record,) = records.glob("fixture/*/*.json")
    assert f"record {record} (fixture evidence)" in out, out
    # every speed figure says what it is worth here, next to PARITY OK
    speed = [line for line in out.splitlines() if re.match(r"\s+\S+\s+speed\.(de|pre)", line)]
    assert len(speed) == 2, out  # speed.decode and speed.prefill (a fail, on a fixture)
    for line in speed:
        assert "a generated fixture" in line and "says nothing" in line, line
    assert re.search(r"^speed     meaningless here: a generated fixture \(4 layers", out, re.M)
    # progress went to stderr: the workers starting, and how long that took
    assert "starting 3 workers (2 stages and 1 spare) of tiny-llama-" in done.stderr
    assert re.search(r"^3 workers ready in \d+\.\d s$", done.stderr, re.M), done.stderr

    # --quiet: the same run without a word of progress (the record is reused now)
    done = subprocess.run(
        [*dgr_sh_command("demo"), *args, "--lose-at", "2", "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.rstrip().endswith("PARITY OK"), done.stdout
    assert f"reusing record {record}" in done.stdout, done.stdout
    assert done.stderr == ""
