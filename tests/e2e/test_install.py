"""``pip install .`` into a new virtual environment outside the checkout gives a ``dgr`` that
serves a worker and runs a route from another directory, with no ``PYTHONPATH`` and nothing of
the checkout on its path.

The package is built from a copy of the checkout's files (as a fresh clone would be), so the
test sees what a user's ``pip install`` sees; the patched libllama comes from the build cache
(``~/.cache/dgr``) that the README's commands filled.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dgr_engine.tooling.processes import WorkerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = shutil.ignore_patterns(
    ".git", ".venv", ".workspace", "build", "dist", "*.egg-info", "__pycache__", "*.so",
    ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis",
)  # fmt: skip


def checkout_copy(target: Path) -> Path:
    """The checkout's files without what git ignores at its top (build outputs, caches)."""
    shutil.copytree(ROOT, target, ignore=LEFT_OUT)
    for ignored in ("fixtures", "benchmarks/out"):
        shutil.rmtree(target / ignored, ignore_errors=True)
    return target


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any path that leads to the checkout's code."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))
    )
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A new venv with ``pip install`` of a copy of the checkout; yields its ``bin``."""
    base = tmp_path_factory.mktemp("install")
    source = checkout_copy(base / "dgr-src")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(source)],
        capture_output=True,
        text=True,
        cwd=base,
        env=clean_env(),
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    shutil.rmtree(source)  # nothing of the source tree may be needed any more
    yield venv / "bin"


def test_the_installed_package_is_imported_from_the_venv(installed: Path, tmp_path: Path) -> None:
    code = (
        "import dgr_engine, dgr_engine.cli, dgr_engine.worker, dgr_engine.wire.proto, "
        "dgr_session.testing, dgr_engine._binding as b\n"
        "from dgr_engine.fixtures import default_fixtures_dir\n"
        "print(dgr_engine.__file__); print(b.LLAMA_COMMIT); print(default_fixtures_dir())\n"
    )
    done = subprocess.run(
        [str(installed / "python"), "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(XDG_CACHE_HOME=str(tmp_path / "cache")),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    where, commit, fixtures = done.stdout.splitlines()
    assert Path(where).is_relative_to(installed.parent), where
    assert len(commit) == 40
    assert Path(fixtures) == tmp_path / "cache" / "dgr" / "fixtures"  # not the checkout's


def test_the_installed_dgr_serves_a_worker_from_another_directory(
    installed: Path, tmp_path: Path, tiny_llama: Path
) -> None:
    worker = WorkerProcess.launch(
        [str(installed / "dgr"), "worker", "--model", str(tiny_llama), "--layers", "0:2"],
        120.0,
        cwd=tmp_path,
        env=clean_env(),
    )
    try:
        assert worker.address.startswith("127.0.0.1:")
    finally:
        code = worker.stop()
    assert code == 0, worker.stderr_text()
    assert worker.stdout_lines[-1] == "STOPPED sessions_closed=0"


def test_the_installed_dgr_certifies_and_generates_over_spawned_workers(
    installed: Path, tmp_path: Path, tiny_llama: Path
) -> None:
    # outside a checkout the lock is named (DGR_LOCK) and its time is the one it declares;
    # the installed dgr certifies its own lane, then routes over workers that load the record
    env = clean_env(
        DGR_LOCK=str(ROOT / "certification" / "lock.json"),
        DGR_EVIDENCE_DIR=str(tmp_path / "evidence"),
    )
    certify = subprocess.run(
        [str(installed / "dgr"), "certify", "--model", str(tiny_llama)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert certify.returncode == 0, certify.stdout[-4000:] + certify.stderr[-4000:]
    assert "(fixture evidence)" in certify.stdout
    done = subprocess.run(
        [str(installed / "dgr"), "generate", "--spawn", "2", "--model", str(tiny_llama)]
        + ["-n", "6", "--check", "--json", "--require", "fixture"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["state"] == "done" and len(report["tokens"]) == 6
    assert report["whole_model_equal"] is True
    assert len(report["stages"]) == 2


def test_the_installed_dgr_makes_an_operators_lock_outside_a_checkout(
    installed: Path, tmp_path: Path
) -> None:
    def dgr(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(installed / "dgr"), *argv],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={k: v for k, v in clean_env().items() if k != "DGR_LOCK"},
            timeout=120,
        )

    refused = dgr("lock", "new", "op.json")  # no checkout, no $DGR_LOCK: nothing to start from
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "no lock" in refused.stderr and "--lock FILE or $DGR_LOCK" in refused.stderr
    assert not (tmp_path / "op.json").exists()
    made = dgr("lock", "new", "op.json", "--from", str(ROOT / "certification" / "lock.json"))
    assert made.returncode == 0, made.stderr
    assert dgr("lock", "keygen", "me.pem").returncode == 0
    for step in (["declare-certifier", "--name", "me", "--key", "me.pem"], ["show"]):
        done = dgr("lock", *step, "--lock", "op.json")
        assert done.returncode == 0, done.stderr
    assert "certifier me: key ed25519:" in done.stdout
