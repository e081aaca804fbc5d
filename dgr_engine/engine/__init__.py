"""The engine: one layer range of one GGUF model in the patched llama.cpp (``shard``:
:class:`ShardEngine`, its info, stats and batched forward items), and the binding of a native
link that runs a session's frames on the engine's own thread (``native_link``), and dgr's one
sampler, bound (``sampling``: ``docs/sampling.md``)."""

from __future__ import annotations

from dgr_engine.engine.native_link import (
    DEFAULT_BODY_TIMEOUT,
    LinkKeys,
    LinkSockets,
    LinkState,
    LinkStats,
    NativeLink,
)
from dgr_engine.engine.shard import EngineStats, FloatArray, ForwardItem, ShardEngine, ShardInfo

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "EngineStats",
    "FloatArray",
    "ForwardItem",
    "LinkKeys",
    "LinkSockets",
    "LinkState",
    "LinkStats",
    "NativeLink",
    "ShardEngine",
    "ShardInfo",
]
