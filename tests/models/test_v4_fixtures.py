"""The DeepSeek V4 fixtures: deterministic, the keys and tensors llama.cpp's deepseek4 loads."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from dgr_engine import ShardEngine
from dgr_engine.fixtures import (
    FIXTURES,
    deepseek4,
    ensure_fixture,
    estimated_bytes,
    fixture_filename,
    spec_digest,
    write_fixture,
)
from dgr_engine.fixtures.deepseek4 import Deepseek4Spec

V4 = ["tiny-v4", "v4-12"]


def field(reader: GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("v4")
    return {name: ensure_fixture(name, directory) for name in V4}


def test_specs() -> None:
    tiny, big = FIXTURES["tiny-v4"], FIXTURES["v4-12"]
    assert isinstance(tiny, Deepseek4Spec) and isinstance(big, Deepseek4Spec)
    assert (tiny.n_layer, tiny.hc_mult, tiny.hash_layer_count, tiny.n_swa) == (6, 4, 3, 32)
    assert set(tiny.compress_ratios) == {0, 4, 128} and set(big.compress_ratios) == {0, 4, 128}
    assert (tiny.n_head, tiny.head_dim, tiny.n_rot, tiny.indexer_head_dim) == (2, 128, 32, 64)
    assert big.n_layer >= 12 and big.hash_layer_count >= 2
    assert tiny.boundary_width == 4 * tiny.n_embd


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"compress_ratios": (0, 4, 64, 4, 0, 128)}, "0, 4 or 128"),
        ({"compress_ratios": (0, 4)}, "compress ratios for 6 layers"),
        ({"hc_mult": 2}, "hc_mult 4"),
        ({"indexer_head_dim": 96}, "power of two"),
        ({"o_groups": 3}, "divisible"),
        ({"hash_layer_count": 7}, "hash_layer_count"),
        ({"n_mtp": 2}, "one MTP block"),
        ({"byte_vocab": True, "n_vocab": 300}, "byte vocabulary"),
    ],
)
def test_bad_specs_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        attrs.evolve(FIXTURES["tiny-v4"], **change)


@pytest.mark.parametrize("name", V4)
def test_same_name_gives_identical_bytes(name: str, built: dict[str, Path], tmp_path: Path) -> None:
    again = write_fixture(FIXTURES[name], tmp_path / "again.gguf")
    assert built[name].name == fixture_filename(FIXTURES[name])
    digest = hashlib.sha256
    assert digest(built[name].read_bytes()).digest() == digest(again.read_bytes()).digest()
    assert spec_digest(FIXTURES[name]) != spec_digest(FIXTURES["tiny-llama"])


@pytest.mark.parametrize("name", V4)
def test_reads_back_with_keys_and_tensors(name: str, built: dict[str, Path]) -> None:
    spec = FIXTURES[name]
    assert isinstance(spec, Deepseek4Spec)
    reader = GGUFReader(built[name])
    a = "deepseek4"
    assert field(reader, "general.architecture") == a
    assert field(reader, f"{a}.block_count") == spec.n_layer
    assert field(reader, f"{a}.hyper_connection.count") == 4
    assert field(reader, f"{a}.hash_layer_count") == spec.hash_layer_count
    assert field(reader, f"{a}.expert_gating_func") == 4
    assert list(field(reader, f"{a}.attention.compress_ratios")) == list(spec.compress_ratios)
    assert len(field(reader, f"{a}.swiglu_clamp_exp")) == spec.n_layer
    assert f"{a}.nextn_predict_layers" not in reader.fields

    tensors = {t.name: t for t in reader.tensors}
    assert not any(".nextn." in n for n in tensors)
    assert len(tensors) == len(deepseek4.tensor_plan(spec))
    data_bytes = sum(deepseek4.padded(int(t.n_bytes)) for t in reader.tensors)
    assert data_bytes == estimated_bytes(spec)
    e, hc = spec.n_embd, spec.hc_mult
    assert tensors["output_hc_fn.weight"].shape.tolist() == [hc * e, hc]
    assert tensors["blk.0.hc_attn_fn.weight"].shape.tolist() == [hc * e, (2 + hc) * hc]
    for il, ratio in enumerate(spec.compress_ratios):
        names = {n for n in tensors if n.startswith(f"blk.{il}.")}
        assert (f"blk.{il}.attn_compressor_kv.weight" in names) == (ratio != 0)
        assert (f"blk.{il}.indexer.proj.weight" in names) == (ratio == 4)
        hashed = il < spec.hash_layer_count
        assert (f"blk.{il}.ffn_gate_tid2eid.weight" in names) == hashed
        assert (f"blk.{il}.exp_probs_b.bias" in names) == (not hashed)
        if ratio:
            c = 2 if ratio == 4 else 1
            ape = tensors[f"blk.{il}.attn_compressor_ape.weight"].shape.tolist()
            assert ape == [c * spec.head_dim, ratio]
    routing = tensors["blk.0.ffn_gate_tid2eid.weight"]
    assert routing.tensor_type == GGMLQuantizationType.I32
    assert routing.shape.tolist() == [spec.n_expert_used, spec.n_vocab]
    table = np.asarray(routing.data).reshape(spec.n_vocab, spec.n_expert_used)
    assert table.min() >= 0 and table.max() < spec.n_expert
    assert all(len(set(row)) == spec.n_expert_used for row in table.tolist())


def test_whole_model_loads_and_decodes_finite_logits(built: dict[str, Path]) -> None:
    prompt = np.arange(40) * 7 % FIXTURES["tiny-v4"].n_vocab
    with ShardEngine(built["tiny-v4"], n_threads=1) as engine:
        assert engine.info.arch == "deepseek4" and engine.info.is_first and engine.info.is_last
        engine.open_session(1, 0)
        logits = engine.forward(1, 0, np.arange(40), tokens=prompt, want=np.ones(40))
        assert logits.shape == (40, 256) and np.isfinite(logits).all()
        assert float(np.std(logits)) > 0.1


# the committed evidence names tiny-v4 by these bytes: adding the MTP option must not move them
TINY_V4_SHA256 = "c9284174e23e835aa59a3fa1092048b30589662727edd24305f573c86f04da7b"


def test_mtp_option_leaves_the_existing_fixtures_as_they_were(built: dict[str, Path]) -> None:
    assert hashlib.sha256(built["tiny-v4"].read_bytes()).hexdigest() == TINY_V4_SHA256
    assert fixture_filename(FIXTURES["tiny-v4"]) == "tiny-v4-110cc6a5597a.gguf"
    assert fixture_filename(FIXTURES["v4-12"]) == "v4-12-f0e95d2cfcdb.gguf"


def test_mtp_fixture_has_one_nextn_block_after_the_main_layers(tmp_path: Path) -> None:
    spec = FIXTURES["tiny-v4-mtp"]
    assert isinstance(spec, Deepseek4Spec) and spec.n_mtp == 1
    path = ensure_fixture("tiny-v4-mtp", tmp_path)
    reader = GGUFReader(path)
    a = "deepseek4"
    assert field(reader, f"{a}.block_count") == spec.n_layer + 1
    assert field(reader, f"{a}.nextn_predict_layers") == 1
    assert list(field(reader, f"{a}.attention.compress_ratios")) == [*spec.compress_ratios, 0]
    assert len(field(reader, f"{a}.swiglu_clamp_exp")) == spec.n_layer + 1
    # a byte vocabulary, so that llama-server can run it (tests/e2e/test_mtp_vs_llama_server.py)
    assert field(reader, "tokenizer.ggml.model") == "llama"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == spec.n_vocab
    tensors = {t.name: t for t in reader.tensors}
    n = spec.n_layer
    nextn = sorted(name for name in tensors if ".nextn." in name)
    assert nextn == [
        f"blk.{n}.nextn.{x}.weight"
        for x in ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_norm")
    ]
    assert tensors[f"blk.{n}.nextn.eh_proj.weight"].shape.tolist() == [2 * spec.n_embd, spec.n_embd]
    assert f"blk.{n}.exp_probs_b.bias" in tensors  # not hash-routed: graph_mtp requires it
    assert f"blk.{n}.attn_compressor_kv.weight" not in tensors  # plain attention only
    # the pinned loader takes it as a 6-layer model whose nextn block it skips unless asked
    with ShardEngine(path, n_threads=1) as engine:
        assert engine.info.n_layer == spec.n_layer
        engine.open_session(1, 0)
        logits = engine.forward(1, 0, np.arange(8), tokens=np.arange(8) * 5)
        assert logits.shape == (1, spec.n_vocab) and np.isfinite(logits).all()
