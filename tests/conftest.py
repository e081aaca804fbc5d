"""Shared fixtures: generated GGUF models (built on demand, cached) and engine factories."""

from __future__ import annotations

import os

# OpenMP threads spin-wait by default; on a loaded 2-core machine two engines' spinning threads
# starve each other (chains 10-200x slower). Set before the engine's libgomp is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator
from pathlib import Path

import pytest

from dgr_engine.fixtures import ensure_fixture


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
