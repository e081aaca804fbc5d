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
    from dgr_engine.tokenizer import Tokenizer

__all__ = ["EngineStats", "ShardEngine", "ShardInfo", "Tokenizer"]


def __getattr__(name: str) -> Any:
    if name == "Tokenizer":
        from dgr_engine import tokenizer

        return tokenizer.Tokenizer
    if name in __all__:
        from dgr_engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dgr_engine' has no attribute {name!r}")
