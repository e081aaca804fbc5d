"""The pre-conversion step for DeepSeek V4 saved by ``transformers``: the bare pinned converter
refuses the save (the reason the step exists), and accepts what the step writes; each value it
restores comes from the config object; every tensor gets the release's name; the tokenizer is
checked against the converter's own table and keeps its token ids; a save it cannot map is
refused in one line with nothing left behind, in the output and in the fixture cache."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from dgr_engine.baseline import converter, tiny_hf, tiny_v4, v4_save
from dgr_engine.baseline.errors import ConversionFailed, TokenizerUnknownToConverter
from dgr_engine.baseline.errors import V4SaveUnmappable as Unmappable
from dgr_engine.baseline.prompts import CORPUS
from dgr_engine.fixtures import converted
from dgr_engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # transformers on the CPU: seconds a test, CI runs it

N_LAYER = 5


@pytest.fixture(scope="module")
def fixture() -> converted.ConvertedFixture:
    return converted.ensure_converted("hf-deepseek-v4")


@pytest.fixture()
def save(fixture: converted.ConvertedFixture, tmp_path: Path) -> Path:
    """A copy of the fixture's ``transformers`` save (``save_pretrained``'s config and
    safetensors, the tokenizer's ``save_pretrained``)."""
    return Path(shutil.copytree(fixture.hf_dir, tmp_path / "saved"))


def one_line(exc: pytest.ExceptionInfo[Exception]) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


def test_the_bare_converter_refuses_the_save_and_converts_it_after_the_step(
    save: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConversionFailed, match="KeyError: 'num_hash_layers'") as refused:
        converter.convert(save, tmp_path / "out" / "raw.gguf")
    assert "v4_save.prepare" in str(refused.value)  # the refusal says what to do
    assert list((tmp_path / "out").iterdir()) == []

    prepared = v4_save.prepare(save, tmp_path / "release")
    assert prepared.restored == {
        "compress_ratios": [0, 4, 128, 4, 0],
        "num_hash_layers": 2,
        "qk_rope_head_dim": 16,
    }
    assert prepared.experts == N_LAYER * 4 * 3  # 4 experts x gate, up, down per layer
    assert prepared.expert_rounding == 0.0  # on the MXFP4 grid: nothing lost
    assert prepared.pre_tokenizer == "gpt-2"

    gguf = tmp_path / "v4.gguf"
    converter.convert(prepared.directory, gguf, model_name="hf-deepseek-v4-mxfp4")
    fields = GGUFReader(gguf).fields
    assert fields["deepseek4.attention.compress_ratios"].contents() == [0, 4, 128, 4, 0]
    assert fields["deepseek4.hash_layer_count"].contents() == 2
    assert fields["deepseek4.rope.dimension_count"].contents() == 16
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    # the fixture is exactly this path: every tensor equal to the MXFP4 fixture's
    made = {t.name: t for t in GGUFReader(gguf).tensors}
    cached = GGUFReader(converted.ensure_converted("hf-deepseek-v4-mxfp4").gguf).tensors
    assert sorted(made) == sorted(t.name for t in cached)
    for t in cached:
        assert t.tensor_type == made[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(made[t.name].data)), t.name
    assert made["blk.0.ffn_gate_exps.weight"].tensor_type == GGMLQuantizationType.MXFP4


def v4_config(**overrides: Any) -> Any:
    import transformers

    config = dict(tiny_v4.V4_SPEC.config)
    config.update(overrides)
    return transformers.DeepseekV4Config(**config)


def test_restored_values_come_from_the_config_object() -> None:
    cfg = v4_config()
    assert cfg.layer_types[:3] == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert v4_save.restored_keys(cfg, cfg.to_dict()) == {
        "compress_ratios": [0, 4, 128, 4, 0],
        "num_hash_layers": 2,
        "qk_rope_head_dim": 16,
    }
    # from the modern fields too (no legacy keys given)
    modern = v4_config(
        compress_ratios=None,
        num_hash_layers=None,
        layer_types=["heavily_compressed_attention"] * 2 + ["sliding_attention"] * 3,
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 2,
        partial_rotary_factor=0.25,
        qk_rope_head_dim=None,
    )
    restored = v4_save.restored_keys(modern, modern.to_dict())
    assert restored == {"compress_ratios": [128, 128, 0, 0, 0], "num_hash_layers": 3,
                        "qk_rope_head_dim": 8}  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "drop", "match"),
    [
        ({}, "layer_types", "config.json lacks layer_types, which the step reads"),
        ({}, "mlp_layer_types", "config.json lacks mlp_layer_types"),
        (
            {"num_hash_layers": None, "mlp_layer_types": ["moe", "hash_moe", *["moe"] * 3]},
            None,
            "hash_moe after a moe layer",
        ),
        (
            {
                "compress_rates": {
                    "compressed_sparse_attention": 4,
                    "heavily_compressed_attention": 64,
                }
            },  # fmt: skip
            None,
            r"compress ratios \[0, 4, 64\]: llama.cpp builds only 0, 4, 128",
        ),
        ({"scoring_func": "sigmoid"}, None, "scoring_func 'sigmoid'"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            },  # fmt: skip
            None,
            r"rope_parameters\['compress'\] is 'yarn'",
        ),
    ],
)
def test_a_config_the_step_cannot_map_is_named_in_one_line(
    overrides: dict[str, Any], drop: str | None, match: str
) -> None:
    cfg = v4_config(**overrides)
    raw = cfg.to_dict()
    raw.pop(drop or "", None)
    with pytest.raises(Unmappable, match=match) as exc:
        v4_save.restored_keys(cfg, raw)
    one_line(exc)


@pytest.mark.parametrize(
    ("saved", "release"),
    [
        ("model.embed_tokens.weight", "embed.weight"),
        ("model.norm.weight", "norm.weight"),
        ("head.weight", "head.weight"),
        ("model.hc_head.hc_fn", "hc_head_fn"),
        ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),
        ("model.layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.weight"),
        ("model.layers.1.attn.indexer.compressor.ape", "layers.1.attn.indexer.compressor.ape"),
        ("model.layers.2.ffn.experts.3.w2.weight", "layers.2.ffn.experts.3.w2.weight"),
        ("model.layers.0.ffn.gate.tid2eid", "layers.0.ffn.gate.tid2eid"),
        ("model.layers.4.hc_ffn_scale", "layers.4.hc_ffn_scale"),
    ],
)
def test_saved_names_become_the_release_names(saved: str, release: str) -> None:
    assert v4_save.release_name(saved) == release


def test_an_unknown_tensor_is_refused_before_anything_is_written(
    save: Path, tmp_path: Path
) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(save / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, save / "model.safetensors")
    with pytest.raises(Unmappable, match="'model.layers.0.mystery.weight' has no name") as exc:
        v4_save.prepare(save, tmp_path / "release")
    one_line(exc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_a_config_key_missing_leaves_nothing_behind(save: Path, tmp_path: Path) -> None:
    config = json.loads((save / "config.json").read_text())
    del config["mlp_layer_types"]
    (save / "config.json").write_text(json.dumps(config))
    with pytest.raises(Unmappable, match="lacks mlp_layer_types") as exc:
        v4_save.prepare(save, tmp_path / "release")
    one_line(exc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_a_tokenizer_the_converter_does_not_know_is_refused(save: Path, tmp_path: Path) -> None:
    # the tiny SentencePiece vocabulary of the Llama fixtures: its pre-tokenizer hash (over the
    # ids of the converter's fixed text) is in no table, and no pre-tokenizer edit can put it
    # there, since the ids depend on the vocabulary
    for path in save.glob("tokenizer*"):
        path.unlink()
    tiny_hf.write_tokenizer(save / "tokenizer.model")
    (save / "tokenizer_config.json").write_text(json.dumps(tiny_hf.TOKENIZER_CONFIG))
    with pytest.raises(TokenizerUnknownToConverter, match="does not know this tokenizer") as exc:
        v4_save.prepare(save, tmp_path / "release")
    one_line(exc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_the_tokenizer_gives_llama_cpp_the_same_ids_as_transformers(
    fixture: converted.ConvertedFixture,
) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(fixture.hf_dir)
    texts = [*CORPUS, "tabs\tand\nnewlines  3.14 -- naïve café 🦙", "<|endoftext|> is text here"]
    with Tokenizer(fixture.gguf) as llama:
        assert llama.info.n_vocab == tiny_v4.GPT2_VOCAB_SIZE
        assert llama.info.eos == tiny_v4.GPT2_ENDOFTEXT
        for text in texts:
            # transformers reads special tokens written in the text: so does llama.cpp, asked to
            ids = llama.encode(text, add_special=False, parse_special=True)
            assert ids == hf.encode(text), text


def test_nothing_half_built_in_the_fixture_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = dict(tiny_v4.V4_SPEC.config, num_hash_layers=None)
    config["mlp_layer_types"] = ["moe", "hash_moe", *["moe"] * 3]  # transformers builds it
    spec = converted.V4ConvertedSpec(
        "hf-deepseek-v4", attrs.evolve(tiny_v4.V4_SPEC, config=config), "f32"
    )
    monkeypatch.setitem(converted.V4_SPECS, spec.name, spec)
    with pytest.raises(Unmappable, match="hash_moe after a moe layer") as exc:
        converted.ensure_converted(spec.name, tmp_path)
    one_line(exc)
    assert list((tmp_path / "converted").iterdir()) == []


def test_a_rebuild_is_bit_identical(tmp_path: Path, fixture: converted.ConvertedFixture) -> None:
    def sha256(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    again = converted.build_into(converted.lookup("hf-deepseek-v4"), tmp_path)
    assert sha256(again.gguf) == sha256(fixture.gguf)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert sha256(again.hf_dir / name) == sha256(fixture.hf_dir / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.gguf"]
    fields = GGUFReader(again.gguf).fields
    assert fields["general.file_type"].contents() == 0  # ALL_F32: the experts were expanded
