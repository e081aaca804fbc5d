"""Tests of dgr_engine.fixtures: layout, determinism, cache, bad-input helpers.

mid-llama is never generated here (450 MB); its size arithmetic is checked instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from dgr_engine import cli, testing
from dgr_engine.fixtures import (
    FIXTURES,
    FixtureSpec,
    catalog,
    ensure_fixture,
    estimated_bytes,
    llama,
    spec_digest,
    write_fixture,
)
from dgr_engine.fixtures.catalog import HEADER_ALLOWANCE
from dgr_engine.fixtures.split import SPLITS
from dgr_engine.testing import write_corrupt_copy, write_truncated_copy

TINY = ["tiny-llama", "tiny-llama-tied", "tiny-qwen2"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def field(reader: GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("fixtures")
    return {name: ensure_fixture(name, directory) for name in TINY}


def test_public_names() -> None:
    assert set(FIXTURES) == {
        "tiny-llama",
        "tiny-llama-tied",
        "mid-llama",
        "tiny-qwen2",
        "tiny-smollm3",
        "tiny-v4",
        "tiny-v4-mtp",
        "v4-12",
        "v4-12-mtp",
    }
    for name, spec in FIXTURES.items():
        assert spec.name == name


def test_tiny_llama_hparams() -> None:
    s = FIXTURES["tiny-llama"]
    got = (s.arch, s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_ff, s.n_vocab)
    assert got == ("llama", 4, 64, 4, 2, 16, 128, 256)
    assert (s.n_ctx_train, s.matrix_dtype, s.tied_output) == (512, "f32", False)
    tied = FIXTURES["tiny-llama-tied"]
    assert attrs.evolve(tied, name=s.name, tied_output=False, description=s.description) == s


def test_mid_llama_hparams() -> None:
    s = FIXTURES["mid-llama"]
    assert (s.arch, s.n_layer, s.n_embd, s.n_head, s.n_head_kv) == ("llama", 24, 1024, 16, 8)
    assert s.matrix_dtype == "f16"


@pytest.mark.parametrize("name", TINY)
def test_same_name_gives_identical_bytes(name: str, tmp_path: Path) -> None:
    a = ensure_fixture(name, tmp_path / "a")
    b = write_fixture(FIXTURES[name], tmp_path / "b.gguf")
    assert a.name == f"{name}-{spec_digest(FIXTURES[name])}.gguf"
    assert sha256(a) == sha256(b)


def test_different_fixtures_differ(built: dict[str, Path]) -> None:
    digests = {sha256(p) for p in built.values()}
    assert len(digests) == len(built)
    seeds = {spec.seed for spec in FIXTURES.values()}
    assert len(seeds) == len(FIXTURES)


@pytest.mark.parametrize("name", TINY)
def test_reads_back_with_keys_and_shapes(name: str, built: dict[str, Path]) -> None:
    spec = FIXTURES[name]
    reader = GGUFReader(built[name])
    a = spec.arch
    assert field(reader, "general.architecture") == a
    assert field(reader, "general.name") == name
    assert field(reader, "tokenizer.ggml.model") == "none"
    expected = {
        f"{a}.context_length": spec.n_ctx_train,
        f"{a}.embedding_length": spec.n_embd,
        f"{a}.block_count": spec.n_layer,
        f"{a}.feed_forward_length": spec.n_ff,
        f"{a}.attention.head_count": spec.n_head,
        f"{a}.attention.head_count_kv": spec.n_head_kv,
        f"{a}.rope.dimension_count": spec.head_dim,
        f"{a}.vocab_size": spec.n_vocab,
    }
    for key, value in expected.items():
        assert field(reader, key) == value, key
    eps = field(reader, f"{a}.attention.layer_norm_rms_epsilon")
    assert eps == pytest.approx(spec.rms_eps, rel=1e-6)

    tensors = {t.name: t for t in reader.tensors}
    q, kv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    e, ff, v = spec.n_embd, spec.n_ff, spec.n_vocab
    # GGUF (ne) order: fastest dimension first, as llama.cpp's create_tensor calls list them.
    ne = {
        "token_embd.weight": [e, v],
        "output_norm.weight": [e],
        "blk.0.attn_q.weight": [e, q],
        "blk.0.attn_k.weight": [e, kv],
        "blk.0.attn_v.weight": [e, kv],
        "blk.0.attn_output.weight": [q, e],
        "blk.0.ffn_gate.weight": [e, ff],
        "blk.0.ffn_up.weight": [e, ff],
        "blk.0.ffn_down.weight": [ff, e],
        f"blk.{spec.n_layer - 1}.ffn_norm.weight": [e],
    }
    for tname, shape in ne.items():
        assert tensors[tname].shape.tolist() == shape, tname
    assert f"blk.{spec.n_layer}.attn_q.weight" not in tensors
    per_layer = 9 + (3 if spec.qkv_bias else 0)
    assert len(tensors) == 2 + (0 if spec.tied_output else 1) + spec.n_layer * per_layer
    assert {t.tensor_type for t in reader.tensors} == {GGMLQuantizationType.F32}


def test_tied_has_no_output(built: dict[str, Path]) -> None:
    untied = {t.name for t in GGUFReader(built["tiny-llama"]).tensors}
    tied = {t.name for t in GGUFReader(built["tiny-llama-tied"]).tensors}
    assert "output.weight" in untied
    assert "output.weight" not in tied
    assert untied - tied == {"output.weight"}


def test_qwen2_has_qkv_biases(built: dict[str, Path]) -> None:
    spec = FIXTURES["tiny-qwen2"]
    tensors = {t.name: t for t in GGUFReader(built["tiny-qwen2"]).tensors}
    kv = spec.n_head_kv * spec.head_dim
    assert tensors["blk.1.attn_q.bias"].shape.tolist() == [spec.n_embd]
    assert tensors["blk.1.attn_k.bias"].shape.tolist() == [kv]
    assert tensors["blk.1.attn_v.bias"].shape.tolist() == [kv]
    assert not any(t.name.endswith(".bias") for t in GGUFReader(built["tiny-llama"]).tensors)


def test_values_round_trip_and_are_scaled(built: dict[str, Path]) -> None:
    spec = FIXTURES["tiny-llama"]
    reader = GGUFReader(built["tiny-llama"])
    plans = {p.name: p for p in llama.tensor_plan(spec)}
    for t in reader.tensors:
        data = np.asarray(t.data)
        assert np.isfinite(data).all(), t.name
        expected = llama.make_tensor(spec, plans[t.name])
        assert np.array_equal(data.reshape(expected.shape), expected), t.name
    assert reader.tensors[1].name == "output_norm.weight"
    norm = np.asarray(reader.tensors[1].data)
    assert abs(float(norm.mean()) - 1.0) < 0.02 and float(norm.std()) < 0.05
    wq = llama.make_tensor(spec, plans["blk.2.attn_q.weight"])
    assert float(wq.std()) == pytest.approx(spec.n_embd**-0.5, rel=0.1)


def test_tensor_values_do_not_depend_on_order() -> None:
    spec = FIXTURES["tiny-llama"]
    plans = llama.tensor_plan(spec)
    last = llama.make_tensor(spec, plans[-1])
    again = [v for _, v in llama.iter_tensors(spec, list(reversed(plans)))][0]
    assert np.array_equal(last, again)
    k, v = (next(p for p in plans if p.name == f"blk.0.attn_{x}.weight") for x in "kv")
    assert k.shape == v.shape
    assert not np.array_equal(llama.make_tensor(spec, k), llama.make_tensor(spec, v))


def test_f16_spec_stores_f16_matrices_and_f32_norms(tmp_path: Path) -> None:
    spec = attrs.evolve(FIXTURES["tiny-llama"], name="tiny-f16", matrix_dtype="f16")
    reader = GGUFReader(write_fixture(spec, tmp_path / "f16.gguf"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.F16
    assert types["token_embd.weight"] == GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    assert (tmp_path / "f16.gguf").stat().st_size - estimated_bytes(spec) in range(
        1, HEADER_ALLOWANCE
    )


def test_cache_is_reused(tmp_path: Path) -> None:
    first = ensure_fixture("tiny-llama", tmp_path)
    before = first.stat()
    second = ensure_fixture("tiny-llama", tmp_path)
    after = second.stat()
    assert second == first
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp files left


def test_changed_spec_or_generator_changes_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = FIXTURES["tiny-llama"]
    assert spec_digest(spec) == spec_digest(attrs.evolve(spec))
    assert spec_digest(spec) != spec_digest(attrs.evolve(spec, n_layer=5))
    assert spec_digest(spec) == spec_digest(attrs.evolve(spec, description="other words"))
    old = spec_digest(spec)
    monkeypatch.setattr(catalog, "GENERATOR_VERSION", catalog.GENERATOR_VERSION + 1)
    assert spec_digest(spec) != old


def test_default_directory_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(catalog.FIXTURES_DIR_ENV, str(tmp_path / "env"))
    path = ensure_fixture("tiny-qwen2")
    assert path.parent == tmp_path / "env"
    assert path.is_file()


def test_default_directory_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(catalog.FIXTURES_DIR_ENV, raising=False)
    repo_root = Path(catalog.__file__).resolve().parents[2]
    assert catalog.default_fixtures_dir() == repo_root / "fixtures"


def test_unknown_fixture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-llama"):
        ensure_fixture("no-such-model", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_invalid_specs_are_refused() -> None:
    base = FIXTURES["tiny-llama"]
    with pytest.raises(ValueError, match="n_head"):
        attrs.evolve(base, n_head=3)
    with pytest.raises(ValueError, match="n_head_kv"):
        attrs.evolve(base, n_head_kv=3)
    with pytest.raises(ValueError):
        attrs.evolve(base, arch="deepseek4")
    with pytest.raises(ValueError, match="n_layer"):
        attrs.evolve(base, n_layer=0)


@pytest.mark.parametrize("name", TINY)
def test_estimated_bytes_matches_tiny_files(name: str, built: dict[str, Path]) -> None:
    overhead = built[name].stat().st_size - estimated_bytes(FIXTURES[name])
    assert 0 < overhead < HEADER_ALLOWANCE


def test_mid_llama_size_arithmetic() -> None:
    s = FIXTURES["mid-llama"]
    e, v, ff, layers = s.n_embd, s.n_vocab, s.n_ff, s.n_layer
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    f16, f32 = 2, 4
    per_layer = (e * q + 2 * e * kv + q * e + 3 * e * ff) * f16 + 2 * e * f32
    total = 2 * v * e * f16 + e * f32 + layers * per_layer
    assert estimated_bytes(s) == total == 448_991_232
    assert 300_000_000 <= estimated_bytes(s) <= 450_000_000


def test_truncated_copy(built: dict[str, Path], tmp_path: Path) -> None:
    src = built["tiny-llama"]
    data = src.read_bytes()
    dst = write_truncated_copy(src, tmp_path / "half.gguf", 0.5)
    cut = dst.read_bytes()
    assert len(cut) == len(data) // 2
    assert data.startswith(cut)
    with pytest.raises(ValueError):
        GGUFReader(dst)
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            write_truncated_copy(src, tmp_path / "x.gguf", bad)


@pytest.mark.parametrize(
    ("kind", "offset", "width"), [("magic", 0, 4), ("version", 4, 4), ("tensor_count", 8, 8)]
)
def test_corrupt_copy(
    kind: testing.CorruptionKind, offset: int, width: int, built: dict[str, Path], tmp_path: Path
) -> None:
    src = built["tiny-llama"]
    data = src.read_bytes()
    dst = write_corrupt_copy(src, tmp_path / f"{kind}.gguf", kind)
    bad = dst.read_bytes()
    assert len(bad) == len(data)
    changed = [i for i, (x, y) in enumerate(zip(data, bad, strict=True)) if x != y]
    assert changed and min(changed) >= offset and max(changed) < offset + width
    with pytest.raises((ValueError, IndexError)):
        GGUFReader(dst)


def test_corrupt_copy_refuses_non_gguf(tmp_path: Path) -> None:
    src = tmp_path / "not.gguf"
    src.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        write_corrupt_copy(src, tmp_path / "out.gguf")


def test_cli_build_and_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["fixtures", "build", "tiny-llama", "--dir", str(tmp_path)]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == tmp_path / catalog.fixture_filename(FIXTURES["tiny-llama"])
    assert printed.is_file()
    assert cli.main(["fixtures", "list"]) == 0
    out = capsys.readouterr().out
    for name in [*FIXTURES, *SPLITS]:
        assert name in out
    assert cli.main(["fixtures", "build", "tiny-llama-split", "--dir", str(tmp_path)]) == 0
    manifest = Path(capsys.readouterr().out.strip())
    assert manifest.name == "manifest.json" and manifest.parent.parent == tmp_path / "split"


def test_spec_is_frozen() -> None:
    spec: FixtureSpec = FIXTURES["tiny-llama"]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.n_layer = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        FIXTURES["x"] = spec  # type: ignore[index]
