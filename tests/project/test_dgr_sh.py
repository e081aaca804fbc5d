"""``./dgr.sh``'s first run says what it is doing: the llama.cpp build runs where its progress
shows (before the quiet ``pip install`` that would hide it), and a quiet step that goes on
says it is still running. Run on a copy of the script with stand-ins for the venv's programs,
which record their calls; the long install waits on the test, not on a clock."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMPED = (
    "pyproject.toml",
    "setup.py",
    "cffi_build.py",
    "native/llama.cpp.manifest.json",
    "native/build_llama.py",
    "native/include/dgr_shard.h",
    "native/src/dgr_shard.cpp",
    "patches/0001-x.patch",
)

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$DGR_TEST_CALLS"
case "$*" in
    "-c import dgr_engine._native") exit 1 ;;  # no binding yet: install
    *native/build_llama.py*)
        echo "llama.cpp: [  0:42]   build [120/240]  50%" >&2
        echo "/cache/llama/0123456789abcdef"  # the prefix, on stdout
        ;;
    *"-e .[test,baseline]"*) read -r _ < "$DGR_TEST_RELEASE" ;;  # until the test says
esac
"""


def fake_checkout(tmp: Path) -> Path:
    tmp.mkdir()
    shutil.copy(ROOT / "dgr.sh", tmp / "dgr.sh")
    for name in STAMPED:  # what the install's stamp is made of
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(name)
    bin_dir = tmp / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "dgr").write_text('#!/usr/bin/env bash\necho "dgr $*"\n')
    for program in bin_dir.iterdir():
        program.chmod(0o755)
    return tmp


def test_a_cold_dgr_sh_shows_the_build_and_says_a_long_install_is_still_running(
    tmp_path: Path,
) -> None:
    checkout = fake_checkout(tmp_path / "checkout")
    calls, release = tmp_path / "calls", tmp_path / "release"
    os.mkfifo(release)
    env = dict(os.environ, DGR_TEST_CALLS=str(calls), DGR_TEST_RELEASE=str(release))
    env["DGR_TICK_SECONDS"] = "1"
    env.pop("DGR_LLAMA_PREFIX", None)
    proc = subprocess.Popen(
        ["bash", str(checkout / "dgr.sh"), "demo", "--fixture", "tiny-llama"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        while not any(line.startswith("dgr: still installing dgr, ") for line in seen):
            line = lines.get(timeout=60)
            assert line is not None, seen  # the script ended before it said so
            seen.append(line)
        with release.open("w") as door:  # the install may end now
            door.write("done\n")
        assert proc.stdout is not None
        stuck = threading.Timer(60, os.killpg, (proc.pid, signal.SIGKILL))  # bounds the read
        stuck.start()
        try:
            out = proc.stdout.read()  # to its end (stderr is the reader's)
        finally:
            stuck.cancel()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    reader.join(10)
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    assert proc.returncode == 0, seen
    assert out == "dgr demo --fixture tiny-llama\n"  # the build's prefix is not the demo's output

    # the build's own progress reaches the user, between saying what it is and the install
    announce = seen.index(next(s for s in seen if s.startswith("dgr: llama.cpp at the pinned")))
    progress = seen.index("llama.cpp: [  0:42]   build [120/240]  50%")
    install = seen.index("dgr: installing dgr and its dependencies, building the binding")
    assert announce < progress < install, seen
    assert seen[-1].startswith("dgr: ready in "), seen

    made = calls.read_text().splitlines()
    build = made.index("native/build_llama.py --print-prefix")
    editable = next(i for i, c in enumerate(made) if "-e .[test,baseline]" in c)
    assert build < editable, made  # built where it shows, before pip -q would hide it
