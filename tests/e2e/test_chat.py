"""``dgr chat`` in a real terminal (tmux) on SmolLM2 over two workers it spawns: two turns where
the second depends on the first, /reset, Ctrl-C in the middle of an answer and another question
answered, /exit; no worker is left running and no stage holds a session.

tmux is Debian's ``tmux`` package (``apt-get install -y tmux``)."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dgr_engine.client.routes import describe
from dgr_engine.client.text import chat_ids, until_stop
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.tokenizer import Tokenizer
from tests.harness import SMOLLM2, RealLane

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "Answer in one short sentence."
FRANCE, GERMANY = "What is the capital of France?", "And of Germany?"
LONG = "Write a long story about a dragon who learns to bake bread."


class Pane:
    """One tmux session on a private server, running one command."""

    def __init__(self, command: list[str], env: dict[str, str], status_file: Path) -> None:
        self.socket = f"dgr-chat-test-{uuid.uuid4().hex[:8]}"
        # the command's exit status, written by the pane's shell when the command ends: tmux's
        # own (#{pane_dead_status}) is sometimes never filled in, its child left a zombie
        self._status_file = status_file
        #: Processes the test saw the command start (stopped at the end if still running).
        self.watched: set[int] = set()
        self._env = env  # the tmux server's, and so the pane's
        self._tmux(
            "new-session", "-d", "-s", "chat", "-x", "160", "-y", "60", "-c", str(ROOT),
            f"{shlex.join(command)}; echo $? > {shlex.quote(str(status_file))}",
            ";", "set-option", "-t", "chat", "remain-on-exit", "on",
        )  # fmt: skip

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, "-f", "/dev/null", *args],
            capture_output=True, text=True, timeout=30, check=True, env=self._env,
        )  # fmt: skip
        return done.stdout

    def screen(self) -> str:
        """Everything the pane has shown, wrapped lines joined."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def type(self, line: str) -> None:
        self._tmux("send-keys", "-t", "chat", "-l", line)
        self._tmux("send-keys", "-t", "chat", "Enter")

    def interrupt(self) -> None:
        self._tmux("send-keys", "-t", "chat", "C-c")

    def exit_status(self) -> int | None:
        """The command's exit status once it has ended (``None``: still running)."""
        try:
            text = self._status_file.read_text()
        except FileNotFoundError:
            return None
        return int(text) if text.endswith("\n") else None  # written whole, then a newline

    def pid(self) -> int:
        return int(self._tmux("display-message", "-p", "-t", "chat", "#{pane_pid}"))

    def wait_for(self, ready: Callable[[str], bool], what: str, limit: float = 120.0) -> str:
        """The screen once ``ready(screen)``; fails after ``limit`` seconds (checked every
        0.2 s, at most ``5 * limit`` times)."""
        deadline = time.monotonic() + limit
        screen = ""
        for _ in range(int(limit * 5)):
            screen = self.screen()
            if ready(screen) or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # the poll's interval: the screen has no event to wait on
        assert ready(screen), f"no {what} after {limit} s:\n{screen}"
        return screen

    def close(self) -> None:
        """Ends the tmux server (the command gets SIGHUP) and removes its socket."""
        path = subprocess.run(
            ["tmux", "-L", self.socket, "display-message", "-p", "#{socket_path}"],
            capture_output=True, text=True, timeout=30, env=self._env,
        ).stdout.strip()  # fmt: skip
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)
        if path:
            Path(path).unlink(missing_ok=True)


def descendants(pid: int) -> set[int]:
    """Processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def whole_model_answer(model: Path, messages: list[tuple[str, str]]) -> str:
    """The whole model's greedy answer to a conversation (in-process), up to end of turn."""
    with Tokenizer(model) as tokenizer:
        prompt = chat_ids(tokenizer, messages)
        whole = whole_model_greedy(model, [prompt], 64, EngineOptions())[0]
        tokens = until_stop(whole, tokenizer.eog_tokens)
        return tokenizer.decode([t for t in tokens if t not in tokenizer.eog_tokens])


def turns(screen: str) -> list[tuple[str, str]]:
    """``(what was typed at a prompt, what followed until the next prompt)``; the last is the
    prompt now waiting (``("", "")`` once an answer is complete)."""
    found: list[tuple[str, list[str]]] = []
    for line in screen.rstrip().splitlines():
        if line.startswith("dgr chat: "):  # progress on stderr ("prefilling 230 tokens")
            continue
        if line == ">" or line.startswith("> "):
            found.append((line[2:], []))
        elif found:
            found[-1][1].append(line)
    return [(typed, "\n".join(lines)) for typed, lines in found]


def answered(n: int) -> Callable[[str], bool]:
    """``n`` lines typed, each followed by its answer, and the next prompt waiting."""
    return lambda screen: len(turns(screen)) == n + 1 and turns(screen)[-1] == ("", "")


async def sessions_open(endpoints: list[str]) -> list[int]:
    return [(await describe(e, timeout=10)).capacity.sessions_open for e in endpoints]


@pytest.fixture()
def pane(smollm2_lane: RealLane, tmp_path: Path) -> Iterator[Pane]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: apt-get install -y tmux")
    lock, evidence = smollm2_lane.lock, smollm2_lane.evidence
    command = [
        sys.executable, "-m", "dgr_engine.cli", "chat", "--model", SMOLLM2, "--spawn", "2",
        "--lock", str(lock), "--evidence", str(evidence), "--system", SYSTEM,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    opened = Pane(command, env, tmp_path / "exit-status")
    try:
        yield opened
    finally:
        left = set(opened.watched)
        try:
            left |= descendants(opened.pid())
        finally:
            opened.close()
            for pid in left:  # a failed test leaves nothing behind either
                if running(pid):
                    os.kill(pid, 9)


def test_a_conversation_in_a_terminal(
    pane: Pane,
    smollm2_lane: RealLane,
) -> None:
    model = smollm2_lane.model
    system = [("system", SYSTEM)]
    first = whole_model_answer(model, [*system, ("user", FRANCE)])
    second = whole_model_answer(
        model, [*system, ("user", FRANCE), ("assistant", first), ("user", GERMANY)]
    )
    alone = whole_model_answer(model, [*system, ("user", GERMANY)])
    assert second != alone  # the second answer depends on the first turn

    screen = pane.wait_for(lambda s: "/reset starts a new conversation" in s, "banner")
    endpoints = re.findall(r"(127\.0\.0\.1:\d+) \[", screen)
    assert len(endpoints) == 2, screen
    workers = {pid for pid in descendants(pane.pid()) if b"worker" in cmdline(pid)}
    pane.watched |= workers
    assert len(workers) == 2, workers

    pane.type(FRANCE)
    pane.wait_for(answered(1), "first answer")
    pane.type(GERMANY)
    screen = pane.wait_for(answered(2), "second answer")
    assert turns(screen)[:2] == [(FRANCE, first), (GERMANY, second)], screen

    pane.type("/reset")
    pane.wait_for(answered(3), "reset")
    pane.type(GERMANY)
    screen = pane.wait_for(answered(4), "an answer without history")
    assert turns(screen)[2:4] == [("/reset", "(a new conversation)"), (GERMANY, alone)], screen

    pane.type(LONG)
    pane.wait_for(lambda s: len(turns(s)[-1][1]) > 40, "the long answer begins")
    pane.interrupt()
    screen = pane.wait_for(answered(5), "the stopped answer")
    typed, answer = turns(screen)[4]
    assert typed == LONG and answer.endswith(" [stopped]"), screen
    assert pane.exit_status() is None  # Ctrl-C stopped the answer, not the program
    assert all(running(pid) for pid in workers)  # nor the workers
    # its session was cancelled and every stage's session closed (closing is asynchronous)
    deadline = time.monotonic() + 30
    for _ in range(150):
        if asyncio.run(sessions_open(endpoints)) == [0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert asyncio.run(sessions_open(endpoints)) == [0, 0]

    pane.type(FRANCE)
    screen = pane.wait_for(answered(6), "an answer after the interruption")
    typed, answer = turns(screen)[5]
    assert typed == FRANCE and "Paris" in answer, screen

    pane.type("/exit")
    screen = pane.wait_for(lambda s: pane.exit_status() is not None, "the end", limit=60)
    assert pane.exit_status() == 0, screen
    screen = pane.screen()
    assert "Traceback" not in screen
    assert re.search(r"dgr chat: route closed in \d+\.\d s", screen), screen  # said, bounded
    assert [pid for pid in workers if running(pid)] == []
