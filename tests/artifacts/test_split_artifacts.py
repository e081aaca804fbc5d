"""Split GGUFs (made by the pinned llama.cpp's own llama-gguf-split): each shard provisions and
opens only the files of its own layers, and a chain of such shards, every other split file
absent, matches the whole single-file model bit for bit. A shard's files are hashed at load, so
a same-size swap with its mtime restored, or a hand-edited state vouching for a tampered file,
is refused before anything is loaded. Fixture evidence only."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from dgr_engine import ShardEngine
from dgr_engine.artifacts import provision, shard
from dgr_engine.artifacts.errors import ArtifactCorrupt, ArtifactMissing
from dgr_engine.artifacts.manifest import FileEntry
from dgr_engine.artifacts.sources import DirectorySource
from dgr_engine.artifacts.state import ArtifactState, FileRecord
from dgr_engine.errors import EngineError
from dgr_engine.fixtures.split import SPLITS, ensure_split, source_path
from dgr_engine.reference import InProcessRoute, split_points

ENGINE_KW = {"max_sessions": 2, "n_ctx_per_session": 128, "n_threads": 2, "n_batch": 64}
PROMPT = [int(t) for t in (np.arange(12) * 29 + 5) % 256]
N_DECODE = 8
CASES = [("tiny-llama-split", 4), ("tiny-v4-split", 6), ("hf-llama-gqa-split", 3)]


@pytest.mark.parametrize(("name", "n_layer"), CASES)
def test_a_split_fixture_has_a_metadata_file_and_files_of_some_layers(
    name: str, n_layer: int
) -> None:
    split = ensure_split(name)
    manifest = split.manifest
    assert 3 <= len(split.files) <= 6
    assert [f.name for f in manifest.files] == [p.name for p in split.files]
    assert manifest.files[0].tensors == () and manifest.n_layer == n_layer
    assert any(0 < len(f.layers) < n_layer for f in manifest.files[1:])
    for path, entry in zip(split.files, manifest.files, strict=True):
        assert tuple(sorted(t.name for t in GGUFReader(path).tensors)) == entry.tensors
    whole = GGUFReader(source_path(SPLITS[name].source))
    assert sorted(t for f in manifest.files for t in f.tensors) == sorted(
        t.name for t in whole.tensors
    )


def _reference(model: Path) -> tuple[list[int], list[np.ndarray]]:
    with ShardEngine(model, **ENGINE_KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        return chain.greedy(1, 0, PROMPT, N_DECODE, all_prefill_logits=False)


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def provisioned(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, list[shard.ShardArtifacts]]]:
    """Three shard roots of a split fixture, each holding only the files of its range."""
    name, n_layer = request.param
    split = ensure_split(name)
    manifest = split.manifest
    artifacts = []
    for layers in split_points(n_layer, 3):
        root = tmp_path_factory.mktemp(f"{name}-{layers[0]}-{layers[1]}")
        report = provision.fetch(manifest, DirectorySource(split.directory), root, layers=layers)
        assert report.ok
        held = sorted(p.name for p in root.glob("*.gguf"))
        assert held == sorted(f.name for f in manifest.files_for(layers))
        artifacts.append(shard.prepare(manifest, root, layers))
    yield name, artifacts


def test_each_shard_holds_fewer_files_than_the_model(
    provisioned: tuple[str, list[shard.ShardArtifacts]],
) -> None:
    name, artifacts = provisioned
    total = len(artifacts[0].manifest.files)
    assert all(len(a.files) < total for a in artifacts[:-1])
    # the converter writes output.weight beside token_embd, so its last shard needs every file
    assert name == "hf-llama-gqa-split" or len(artifacts[-1].files) < total
    assert all(a.verification.startswith("trusted state of 20") for a in artifacts)
    share = sum(a.bytes_on_disk for a in artifacts)
    assert share < len(artifacts) * artifacts[0].manifest.size  # less than a copy each


def test_shards_with_every_other_file_absent_match_the_whole_model_bit_for_bit(
    provisioned: tuple[str, list[shard.ShardArtifacts]],
) -> None:
    name, artifacts = provisioned
    tokens, logits = _reference(source_path(SPLITS[name].source))
    engines = [ShardEngine(a.first, layers=a.layers, **ENGINE_KW) for a in artifacts]
    try:
        chain = InProcessRoute(engines)
        chain.open(1, 0)
        got_tokens, got_logits = chain.greedy(1, 0, PROMPT, N_DECODE, all_prefill_logits=False)
    finally:
        for engine in engines:
            engine.close()
    assert got_tokens == tokens
    for want, got in zip(logits, got_logits, strict=True):
        assert np.array_equal(want, got)


def test_a_shard_missing_a_file_it_owns_is_refused_before_and_by_the_loader(
    tmp_path: Path,
) -> None:
    split = ensure_split("tiny-llama-split")
    manifest = split.manifest
    layers = (1, 3)
    provision.fetch(manifest, DirectorySource(split.directory), tmp_path, layers=layers)
    owned = next(f for f in manifest.files_for(layers) if 1 in f.layers)
    (tmp_path / owned.name).unlink()
    with pytest.raises(ArtifactMissing, match=f"^{owned.name}: missing from .*layers 1:3 need"):
        shard.prepare(manifest, tmp_path, layers)
    with pytest.raises(EngineError, match="DGR_E_MODEL_LOAD: llama.cpp could not load"):
        ShardEngine(tmp_path / manifest.files[0].name, layers=layers, **ENGINE_KW)


def test_a_whole_model_load_still_needs_every_file(tmp_path: Path) -> None:
    split = ensure_split("tiny-llama-split")
    for path in split.files[:-1]:
        shutil.copy(path, tmp_path / path.name)
    with pytest.raises(EngineError):
        ShardEngine(tmp_path / split.files[0].name, **ENGINE_KW)


def _tamper_same_size(path: Path, *, in_place: bool) -> None:
    """Flips one byte in the middle of ``path``, keeping its size, and puts its access and
    modification times back (``os.utime``): in place, or as a new file renamed over it."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    if in_place:
        with path.open("r+b") as stream:
            stream.write(data)
    else:
        swapped = path.with_name(path.name + ".swap")
        swapped.write_bytes(bytes(data))
        os.replace(swapped, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _owned_file(entries: tuple[FileEntry, ...]) -> FileEntry:
    return next(f for f in entries if f.layers)


def _serves_exactly(manifest_layers: tuple[int, int], root: Path, name: str) -> None:
    """Honest use beside the refusal: re-provisioned, the shard loads and its greedy run equals
    the whole single-file model bit for bit."""
    split = ensure_split(name)
    report = provision.fetch(
        split.manifest, DirectorySource(split.directory), root, layers=manifest_layers
    )
    assert report.ok
    artifacts = shard.prepare(split.manifest, root, manifest_layers)
    assert artifacts.verification.startswith("trusted state of 20")
    assert artifacts.verification.endswith(", re-hashed at start-up")
    tokens, logits = _reference(source_path(SPLITS[name].source))
    with ShardEngine(artifacts.first, layers=artifacts.layers, **ENGINE_KW) as engine:
        chain = InProcessRoute([engine])
        chain.open(1, 0)
        got_tokens, got_logits = chain.greedy(1, 0, PROMPT, N_DECODE, all_prefill_logits=False)
    assert got_tokens == tokens
    assert all(np.array_equal(w, g) for w, g in zip(logits, got_logits, strict=True))


@pytest.mark.parametrize("in_place", [True, False], ids=["written-in-place", "renamed-over"])
def test_a_same_size_swap_with_its_mtime_restored_is_refused_at_load(
    in_place: bool, tmp_path: Path
) -> None:
    name = "tiny-llama-split"
    split = ensure_split(name)
    manifest = split.manifest
    layers = (0, manifest.n_layer)
    provision.fetch(manifest, DirectorySource(split.directory), tmp_path, layers=layers)
    victim = _owned_file(manifest.files_for(layers))
    _tamper_same_size(tmp_path / victim.name, in_place=in_place)
    with pytest.raises(ArtifactCorrupt, match=f"^{victim.name}: chunk \\d+ has another sha256"):
        shard.prepare(manifest, tmp_path, layers)
    assert not (tmp_path / victim.name).exists()  # quarantined: never served
    assert len(list((tmp_path / provision.QUARANTINE_DIR).iterdir())) == 1
    _serves_exactly(layers, tmp_path, name)


@pytest.mark.parametrize("verifying", [False, True], ids=["finished", "interrupted"])
def test_an_edited_state_vouching_for_a_tampered_file_is_not_trusted(
    verifying: bool, tmp_path: Path
) -> None:
    name = "tiny-llama-split"
    split = ensure_split(name)
    manifest = split.manifest
    layers = (0, manifest.n_layer)
    provision.fetch(manifest, DirectorySource(split.directory), tmp_path, layers=layers)
    victim = _owned_file(manifest.files_for(layers))
    _tamper_same_size(tmp_path / victim.name, in_place=True)
    state = ArtifactState.load(tmp_path, manifest.sha256)
    for entry in manifest.files_for(layers):  # the forger records every file as it is now
        found = os.stat(tmp_path / entry.name)
        state.files[entry.name] = FileRecord.of(found, len(entry.chunks))
    state.verifying, state.verified_at = verifying, "2026-12-03T00:00:00+00:00"
    state.save()
    if not verifying:
        assert provision.trusted(manifest, tmp_path, layers) == state.verified_at  # fooled
    with pytest.raises(ArtifactCorrupt, match=f"^{victim.name}: chunk \\d+ has another sha256"):
        shard.prepare(manifest, tmp_path, layers)
    assert not (tmp_path / victim.name).exists()
    assert provision.trusted(manifest, tmp_path, layers) is None
    _serves_exactly(layers, tmp_path, name)
