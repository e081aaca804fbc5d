"""Shared fixtures: generated GGUF models (built on demand, cached) and engine factories."""

from __future__ import annotations

import os

# OpenMP threads spin-wait by default; on a loaded 2-core machine two engines' spinning threads
# starve each other (chains 10-200x slower). Set before the engine's libgomp is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dgr_engine.certification.record import EVIDENCE_DIR_ENV
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.processes import dgr_command

# Nothing a test runs may write certification records into the checkout's evidence/: by
# default they go to (and workers read) an empty directory of this run. Tests that route over
# real workers use ``certified_fixtures``.
_RUN_EVIDENCE = tempfile.TemporaryDirectory(prefix="dgr-test-evidence-")
os.environ[EVIDENCE_DIR_ENV] = _RUN_EVIDENCE.name

CERTIFIED_FIXTURES = ("tiny-llama", "tiny-v4")
"""The fixtures whose lanes (``dgr certify``'s default engine options) the suite certifies."""


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return ensure_fixture("tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_tied() -> Path:
    return ensure_fixture("tiny-llama-tied")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return ensure_fixture("tiny-qwen2")


@pytest.fixture()
def closing() -> Iterator[list]:
    """Collects engines (or anything with ``close()``) and closes them after the test."""
    items: list = []
    yield items
    for item in items:
        item.close()


@pytest.fixture(scope="session")
def fixture_evidence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An evidence directory holding the records ``dgr certify`` made in this test run for the
    lanes of :data:`CERTIFIED_FIXTURES` on this machine (run as a user would: the CLI)."""
    root = tmp_path_factory.mktemp("evidence")
    for name in CERTIFIED_FIXTURES:
        done = subprocess.run(
            [dgr_command(), "certify", "--fixture", name, "--evidence", str(root)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"dgr certify --fixture {name}:\n{done.stdout}{done.stderr}"
        (root.parent / f"certify-{name}.log").write_text(done.stdout)
    return root


@pytest.fixture(scope="session")
def certified_fixtures(fixture_evidence: Path) -> Iterator[Path]:
    """Makes the suite's certification records the default evidence directory (what spawned
    workers read) for the rest of the run; yields it."""
    os.environ[EVIDENCE_DIR_ENV] = str(fixture_evidence)
    yield fixture_evidence
    os.environ[EVIDENCE_DIR_ENV] = _RUN_EVIDENCE.name
