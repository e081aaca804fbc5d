"""The cffi binding: ABI check at import, handle lifecycle, threads, zero-copy outputs."""

from __future__ import annotations

import importlib
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from dgr_engine import ShardEngine, _binding
from dgr_engine.errors import AbiMismatch


def test_abi_version_matches() -> None:
    assert int(_binding.lib.dgr_abi_version()) == _binding.ABI_VERSION
    assert len(_binding.LLAMA_COMMIT) == 40
    # held epoch 3, build flags 4, numerics 5, vocab 6, batch 7, family patches 8, ...,
    # native links 11, sealed native links 12, the one status vocabulary (statuses 16-28) 13,
    # a ring's sender named to its first stage (ring_in_hop) 14, the one sampler 15
    assert _binding.ABI_VERSION == 16
    assert int(_binding.lib.DGR_ABI_VERSION) == _binding.ABI_VERSION


def test_the_binding_names_its_architectures_and_their_family_patches() -> None:
    assert _binding.SUPPORTED_ARCHS == ("llama", "deepseek4", "gemma3", "phi3", "qwen2", "qwen3")
    for arch in ("gemma3", "phi3", "qwen2", "qwen3"):
        assert len(_binding.family_patch_sha256(arch)) == 32, arch
    for arch in ("llama", "deepseek4", "smollm3", ""):
        assert _binding.family_patch_sha256(arch) == b"", arch
    assert _binding.lib.dgr_family_patch_sha256(_binding.ffi.NULL) != _binding.ffi.NULL


def test_abi_mismatch_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _binding._native

    class FakeLib:
        DGR_ABI_VERSION = real.lib.DGR_ABI_VERSION

        def __getattr__(self, name: str) -> object:
            return getattr(real.lib, name)

        def dgr_abi_version(self) -> int:
            return _binding.ABI_VERSION + 1

    fake = types.SimpleNamespace(ffi=real.ffi, lib=FakeLib())
    monkeypatch.setitem(sys.modules, "dgr_engine._native", fake)
    monkeypatch.setattr("dgr_engine._native", fake, raising=False)
    with pytest.raises(AbiMismatch, match="ABI version"):
        importlib.reload(_binding)
    assert issubclass(AbiMismatch, ImportError)
    monkeypatch.undo()
    importlib.reload(_binding)


def test_output_buffer_is_filled_in_place(tiny_llama: Path, closing: list) -> None:
    engine = ShardEngine(tiny_llama, layers=(0, 2))
    closing.append(engine)
    engine.open_session(1, 0)
    out = np.full((3, engine.info.out_width), np.nan, dtype=np.float32)
    got = engine.forward(1, 0, [0, 1, 2], tokens=[1, 2, 3], out=out)
    assert np.shares_memory(got, out)
    assert np.isfinite(out).all()


def test_threads_on_one_handle_serialise_safely(tiny_llama: Path, closing: list) -> None:
    engine = ShardEngine(tiny_llama, max_sessions=4)
    closing.append(engine)
    prompts = {sid: [(sid * 31 + i * 7) % 256 for i in range(8)] for sid in range(4)}

    def run(sid: int, results: dict[int, list[np.ndarray]]) -> None:
        engine.open_session(sid, 0)
        logits = [engine.forward(sid, 0, np.arange(8), tokens=prompts[sid])]
        for step in range(10):
            token = int(np.argmax(logits[-1][-1]))
            logits.append(engine.forward(sid, 0, [8 + step], tokens=[token]))
        results[sid] = logits
        engine.close_session(sid, 0)

    sequential: dict[int, list[np.ndarray]] = {}
    for sid in prompts:
        run(sid, sequential)
    concurrent: dict[int, list[np.ndarray]] = {}
    threads = [threading.Thread(target=run, args=(sid, concurrent)) for sid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for sid in prompts:
        assert all(
            np.array_equal(a, b) for a, b in zip(concurrent[sid], sequential[sid], strict=True)
        )
    assert engine.stats().open_sessions == 0


def test_stats_count_work(tiny_llama: Path, closing: list) -> None:
    engine = ShardEngine(tiny_llama, layers=(1, 3))
    closing.append(engine)
    assert engine.info.in_width == engine.info.out_width == engine.info.n_embd
    engine.open_session(9, 4)
    engine.forward(9, 4, [0, 1], rows=np.zeros((2, 64), np.float32))
    s = engine.stats()
    assert s.rows_forwarded == 2 and s.forward_calls == 1 and s.open_sessions == 1
    assert s.weight_bytes > 0 and s.kv_bytes > 0 and s.rss_bytes > 0
    assert s.forward_seconds > 0
    assert "closed" not in repr(engine)
