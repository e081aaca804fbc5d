"""End to end over a split GGUF: three ``dgr worker --manifest`` processes on 127.0.0.1, each
with a storage root holding only the split files of its own layers (provisioned by ``dgr
artifacts fetch --layers``), chained over gRPC, match the whole single-file model bit for bit;
each advertises the manifest's hash as the model identity and how it checked its files.
A worker whose files were swapped for same-size bytes with the mtime put back refuses to start.
Fixture evidence only."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dgr_engine.artifacts.manifest import Manifest
from dgr_engine.artifacts.state import state_path
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.fixtures.split import SPLITS, ensure_split
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points, whole_model_reference
from dgr_engine.tooling.processes import WorkerProcess, dgr_command

pytestmark = pytest.mark.slow

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=128, n_batch=64, max_sessions=2)
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, size=10)]
N_TOKENS = 8


def _fetch(manifest_path: Path, source: Path, root: Path, layers: tuple[int, int]) -> None:
    done = subprocess.run(
        [dgr_command(), "artifacts", "fetch", str(manifest_path), "--from", str(source)]
        + ["--root", str(root), "--layers", f"{layers[0]}:{layers[1]}", "--allow-temp-root"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


def _worker_argv(manifest_path: Path, root: Path, layers: tuple[int, int]) -> list[str]:
    return [
        dgr_command(),
        "worker",
        "--manifest",
        str(manifest_path),
        "--root",
        str(root),
        "--allow-temp-root",
        "--layers",
        f"{layers[0]}:{layers[1]}",
        "--port",
        "0",
        *OPTIONS.worker_argv(),
    ]


async def _greedy(addresses: list[str], manifest: Manifest) -> tuple[list[int], list[np.ndarray]]:
    """The route's greedy tokens and each step's logits row, the client relaying boundaries."""
    clients = [ShardClient(address, timeout=30.0) for address in addresses]
    try:
        adverts = [await c.describe() for c in clients]
        for advert in adverts:
            assert advert.identity.content_hash == bytes.fromhex(manifest.sha256)
            assert advert.recipe.quant_types == manifest.quant_types
        statements = [advert.artifacts for advert in adverts]
        assert statements[0] == "verified at start-up"  # its state was removed
        assert all(s.startswith("trusted state of 20") for s in statements[1:])
        expects = [expectations_of(advert) for advert in adverts]
        for client, expect in zip(clients, expects, strict=True):
            await client.open("split", 1, expect)
        history, tokens, logits = list(PROMPT), [], []
        rows: np.ndarray | None = None
        for step in range(N_TOKENS):
            fed = history if step == 0 else history[-1:]
            start = 0 if step == 0 else len(history) - 1
            positions = list(range(start, start + len(fed)))
            for client, advert, expect in zip(clients, adverts, expects, strict=True):
                span = advert.span
                result = await client.forward(
                    "split",
                    1,
                    step,
                    expect,
                    positions,
                    tokens=fed if (span.is_first or span.needs_token_ids) else None,
                    boundary=None if span.is_first else rows,
                )
                rows = result.output
            assert rows is not None
            logits.append(rows[-1])
            tokens.append(int(np.argmax(rows[-1])))
            history.append(tokens[-1])
        for client in clients:
            await client.close("split", 1)
        return tokens, logits
    finally:
        for client in clients:
            await client.aclose()


@pytest.mark.parametrize("name", ["tiny-llama-split", "tiny-v4-split"])
def test_three_split_workers_each_with_only_its_files_match_the_whole_model(
    name: str, tmp_path: Path
) -> None:
    split = ensure_split(name)
    manifest = split.manifest
    ranges = split_points(manifest.n_layer, 3)
    roots = []
    for layers in ranges:
        root = tmp_path / f"root-{layers[0]}-{layers[1]}"
        _fetch(split.manifest_path, split.directory, root, layers)
        held = sorted(p.name for p in root.glob("*.gguf"))
        assert held == sorted(f.name for f in manifest.files_for(layers))
        assert len(held) < len(manifest.files)
        roots.append(root)
    state_path(roots[0], manifest.sha256).unlink()  # the first worker must verify at start-up
    ((want_tokens, want_logits),) = whole_model_reference(
        ensure_fixture(SPLITS[name].source), [PROMPT], N_TOKENS, OPTIONS
    )
    workers: list[WorkerProcess] = []
    try:
        for layers, root in zip(ranges, roots, strict=True):
            workers.append(WorkerProcess.launch(_worker_argv(split.manifest_path, root, layers)))
        tokens, logits = asyncio.run(
            asyncio.wait_for(_greedy([w.address for w in workers], manifest), 120)
        )
    finally:
        for worker in workers:
            worker.stop()
    assert tokens == want_tokens
    for want, got in zip(want_logits, logits, strict=True):
        assert np.array_equal(want, got)


def test_a_worker_whose_root_lacks_a_file_of_its_range_refuses_to_start(tmp_path: Path) -> None:
    split = ensure_split("tiny-llama-split")
    manifest = split.manifest
    layers = (2, 4)
    _fetch(split.manifest_path, split.directory, tmp_path, layers)
    last = manifest.files_for(layers)[-1]
    (tmp_path / last.name).unlink()
    done = subprocess.run(
        _worker_argv(split.manifest_path, tmp_path, layers),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"{last.name}: missing from {tmp_path}" in done.stderr
    assert "LISTENING" not in done.stdout


def test_a_worker_refuses_a_same_size_swap_with_its_mtime_restored(tmp_path: Path) -> None:
    """The issue's attack: a verified file swapped for same-size bytes, its mtime put back, was
    trusted and served. The worker now hashes its files at load and refuses to start; once the
    file is fetched again, a worker on the same root serves the whole model exactly."""
    name = "tiny-llama-split"
    split = ensure_split(name)
    manifest = split.manifest
    layers = (0, manifest.n_layer)
    root = tmp_path / "root"
    _fetch(split.manifest_path, split.directory, root, layers)
    victim = root / next(f for f in manifest.files_for(layers) if f.layers).name
    before = victim.stat()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with victim.open("r+b") as stream:
        stream.write(data)
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    done = subprocess.run(
        _worker_argv(split.manifest_path, root, layers), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert f"{victim.name}: chunk " in done.stderr and "has another sha256" in done.stderr
    assert "LISTENING" not in done.stdout and not victim.exists()  # quarantined, never served
    _fetch(split.manifest_path, split.directory, root, layers)
    state_path(root, manifest.sha256).unlink()  # so the worker verifies at start-up
    ((want_tokens, want_logits),) = whole_model_reference(
        ensure_fixture(SPLITS[name].source), [PROMPT], N_TOKENS, OPTIONS
    )
    worker = WorkerProcess.launch(_worker_argv(split.manifest_path, root, layers))
    try:
        tokens, logits = asyncio.run(asyncio.wait_for(_greedy([worker.address], manifest), 120))
    finally:
        worker.stop()
    assert tokens == want_tokens
    assert all(np.array_equal(w, g) for w, g in zip(want_logits, logits, strict=True))
