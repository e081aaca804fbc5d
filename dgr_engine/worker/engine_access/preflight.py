"""What a worker checks before it allocates anything: the GGUF is whole, the context asked for
is within the model's training context, and the KV cache it implies fits the memory available.
Each refusal is one line naming what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

from dgr_engine.errors import InvalidArgument
from dgr_engine.gguf_check import GgufHeader, check_gguf

_KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV cache type, f16


def kv_bytes_estimate(header: GgufHeader, layers: int, n_ctx: int, max_sessions: int) -> int:
    """Rough KV cache size: K and V, f16, per layer, position and session (grouped-query
    heads counted; V4's compressed caches are smaller, so this errs high)."""
    width = header.n_embd or 0
    if header.n_head and header.n_head_kv:
        width = width * header.n_head_kv // header.n_head
    return 2 * _KV_BYTES_PER_VALUE * width * layers * n_ctx * max_sessions


def mem_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (``None`` where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def preflight(
    model: str | os.PathLike[str],
    layers: tuple[int, int],
    *,
    n_ctx_per_session: int,
    max_sessions: int,
) -> GgufHeader:
    """Checks ``model`` and the engine options against it; returns the header. Raises
    ``ModelLoadError`` (the file) or ``InvalidArgument`` (the options), naming the value."""
    header = check_gguf(model)
    trained = header.context_length
    if trained is not None and n_ctx_per_session > trained:
        raise InvalidArgument(
            f"--ctx {n_ctx_per_session} exceeds the model's training context ({trained})"
        )
    begin, end = layers
    n_layer = header.n_layer or 0
    owned = (n_layer if end < 0 else min(end, n_layer)) - begin
    need = kv_bytes_estimate(header, max(owned, 1), n_ctx_per_session, max_sessions)
    available = mem_available_bytes()
    if available is not None and need > available:
        raise InvalidArgument(
            f"--ctx {n_ctx_per_session} x --max-sessions {max_sessions} needs about "
            f"{need / 2**30:.1f} GiB of KV cache for {owned} layer(s); "
            f"{available / 2**30:.1f} GiB is available"
        )
    return header
