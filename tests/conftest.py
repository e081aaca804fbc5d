"""Shared fixtures: generated GGUF models (built on demand, cached) and engine factories."""

from __future__ import annotations

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
