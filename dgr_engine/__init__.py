"""dgr data plane: the shard engine (cffi over the patched llama.cpp), fixtures, workers.

``ShardEngine`` and friends load the compiled binding on first use, so that fixture generation
and other pure-Python parts import without a native build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loguru import logger

logger.disable("dgr_engine")

if TYPE_CHECKING:
    from dgr_engine.engine import EngineStats, ShardEngine, ShardInfo

__all__ = ["EngineStats", "ShardEngine", "ShardInfo"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dgr_engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dgr_engine' has no attribute {name!r}")
