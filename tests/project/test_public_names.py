"""Names users import keep working after the rooms moved their modules: each moved name is
importable from ``dgr_engine`` and is the very object its new module defines."""

from __future__ import annotations

import importlib

import pytest

import dgr_engine


@pytest.mark.parametrize("name", sorted(dgr_engine.MOVED))
def test_a_moved_name_is_importable_from_the_package(name: str) -> None:
    module = importlib.import_module(dgr_engine.MOVED[name])
    assert getattr(dgr_engine, name) is getattr(module, name)
    assert name in dgr_engine.__all__


def test_the_binding_names_are_there_too() -> None:
    from dgr_engine.engine import ShardEngine
    from dgr_engine.tokenizer import Tokenizer

    assert dgr_engine.ShardEngine is ShardEngine and dgr_engine.Tokenizer is Tokenizer


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'chain_transport'"):
        _ = dgr_engine.chain_transport  # type: ignore[attr-defined]


def test_the_shard_client_module_name_still_imports() -> None:
    from dgr_engine.client import ShardClient, session_metadata
    from dgr_engine.client.shard_client import ShardClient as Moved
    from dgr_engine.wire.metadata import session_metadata as shared

    assert ShardClient is Moved and session_metadata is shared
