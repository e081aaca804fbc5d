"""Shared fixtures and hooks: generated GGUF models (built on demand, cached), engine
factories, the evidence directories, and the environment every test runs in.

Each test gets its environment from :func:`pytest_runtest_protocol`, through a monkeypatch
undone after it, never at import: ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP threads spin-wait by
default; on a loaded 2-core machine two engines' spinning threads starve each other), the
evidence directory its workers read (an empty one, or the run's certified records for a test
that uses ``certified_fixtures`` or ``certified_co_batch``), and, outside the slow set, a
``subprocess.Popen`` that refuses to start a worker process. Tests under ``tests/e2e/`` are
slow by their path. Helpers live in :mod:`tests.harness`."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dgr_engine.certification.record import EVIDENCE_DIR_ENV
from dgr_engine.cli._own_model import OPERATOR_HOME_ENV
from dgr_engine.fixtures import ensure_fixture
from tests.harness import GEMMA3, SMOLLM2, EvidenceDirs, EvidenceKit, RealLane, no_worker_popen

SLOW_FOLDERS = ("e2e",)
"""Folders of ``tests/`` whose every test is slow (end to end: real worker processes)."""

_DIRS = pytest.StashKey[EvidenceDirs]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_DIRS] = EvidenceDirs()


def pytest_unconfigure(config: pytest.Config) -> None:
    dirs = config.stash.get(_DIRS, None)
    if dirs is not None:
        dirs.remove()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        relative = item.path.relative_to(tests) if item.path.is_relative_to(tests) else None
        if relative is not None and relative.parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


def _evidence_for(item: pytest.Item) -> Path:
    dirs = item.config.stash[_DIRS]
    names = getattr(item, "fixturenames", ())
    if "certified_co_batch" in names:
        return dirs.co_batch()
    if "certified_fixtures" in names:
        return dirs.certified()
    return dirs.empty()


_PATCH = pytest.StashKey[pytest.MonkeyPatch]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        item.stash[_PATCH] = patch
        patch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        if item.get_closest_marker("slow") is None:
            patch.setattr(subprocess, "Popen", no_worker_popen(subprocess.Popen))
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    # in the setup phase, so that a failure is this test's error; under the Popen guard, so
    # that a fast test cannot ask for certified lanes (made by `dgr certify`)
    item.stash[_PATCH].setenv(EVIDENCE_DIR_ENV, str(_evidence_for(item)))
    # never the user's own operator home (~/.config/dgr/operator): one of this run's
    item.stash[_PATCH].setenv(OPERATOR_HOME_ENV, str(item.config.stash[_DIRS].operator_home()))
    return (yield)


@pytest.fixture(scope="session")
def smollm2_lane(request: pytest.FixtureRequest) -> RealLane:
    """SmolLM2-135M-Instruct's lane, certified in this run (about 30 s on 2 cores) under an
    operator lock of the run's own: slow tests only (it starts workers)."""
    return request.config.stash[_DIRS].real_lane(SMOLLM2)


@pytest.fixture(scope="session")
def gemma3_lane(request: pytest.FixtureRequest) -> RealLane:
    """Gemma 3 270M's lane (262k vocabulary), certified in this run as :func:`smollm2_lane`
    (about 1 min)."""
    return request.config.stash[_DIRS].real_lane(GEMMA3)


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return ensure_fixture("tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_tied() -> Path:
    return ensure_fixture("tiny-llama-tied")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return ensure_fixture("tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_smollm3() -> Path:
    """An architecture no patch covers (refused at open)."""
    return ensure_fixture("tiny-smollm3")


@pytest.fixture()
def closing() -> Iterator[list]:
    """Collects engines (or anything with ``close()``) and closes them after the test."""
    items: list = []
    yield items
    for item in items:
        item.close()


@pytest.fixture(scope="session")
def fixture_evidence(request: pytest.FixtureRequest) -> Path:
    """An evidence directory holding the records ``dgr certify`` made in this test run for the
    lanes of :data:`~tests.harness.CERTIFIED_FIXTURES` on this machine (run as a user would:
    the CLI)."""
    return request.config.stash[_DIRS].certified()


@pytest.fixture(scope="session")
def co_batch_evidence(request: pytest.FixtureRequest) -> Path:
    """:func:`fixture_evidence`'s records plus those of the co-batching lanes of
    :data:`~tests.harness.CO_BATCH_FIXTURES` (``dgr certify --batching co-batch``), in a
    directory of their own (the gates' tests count the plain records)."""
    return request.config.stash[_DIRS].co_batch()


@pytest.fixture()
def certified_fixtures(fixture_evidence: Path) -> Path:
    """The suite's certification records, which this test's workers read (the hook sets the
    evidence directory for a test that uses this fixture)."""
    return fixture_evidence


@pytest.fixture()
def certified_co_batch(co_batch_evidence: Path) -> Path:
    """:func:`certified_fixtures` with the co-batching lanes' records as well."""
    return co_batch_evidence


@pytest.fixture()
def kit(tmp_path: Path) -> EvidenceKit:
    return EvidenceKit(tmp_path)
