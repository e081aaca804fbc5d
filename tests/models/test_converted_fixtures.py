"""Converter-made fixtures: tiny transformers models converted by llama.cpp's own converter at the
pinned commit, of every dense family dgr runs (Llama, Qwen 2 and 3, Phi-3, Gemma 3). They are
bit-reproducible, marked as fixtures, have their family's features on, and every split equals
the whole model bit for bit (prefill and decode) at the default and at the exact numerics."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from dgr_engine import ShardEngine
from dgr_engine.baseline import converter, tiny_families
from dgr_engine.certification.classify import FIXTURE_MARK_KEY
from dgr_engine.fixtures import converted
from dgr_engine.numerics import EXACT, Numerics
from dgr_engine.reference import InProcessRoute
from tests.engine.test_engine_parity import all_cuts

pytestmark = pytest.mark.slow  # transformers on the CPU: seconds a test, CI runs it

PROMPT = [int(t) for t in (np.arange(14) * 37 + 11) % 317 + 3]
N_DECODE = 12
KW = {"max_sessions": 1, "n_ctx_per_session": 64, "n_threads": 2, "n_batch": 32}
DENSE = tuple(name for name in converted.names() if name not in converted.V4_SPECS)
"""The dense families' converter-made fixtures (DeepSeek V4's have their own suite)."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def arch_of(name: str) -> str:
    return converter.COVERED[converted.lookup(name).model_class]


def n_layer_of(name: str) -> int:
    spec = converted.lookup(name)
    assert not isinstance(spec, converted.V4ConvertedSpec)
    return int(spec.config["num_hidden_layers"])


@pytest.fixture(scope="module", params=DENSE)
def fixture(request: pytest.FixtureRequest) -> converted.ConvertedFixture:
    return converted.ensure_converted(request.param)


def test_every_dense_family_has_a_fixture() -> None:
    assert {arch_of(name) for name in DENSE} == {"llama", "qwen2", "qwen3", "phi3", "gemma3"}


def test_the_family_covers_gqa_mqa_tied_and_an_odd_head_dim() -> None:
    heads = {}
    for name in converted.names("llama"):
        fields = GGUFReader(converted.ensure_converted(name).gguf).fields
        tensors = {t.name for t in GGUFReader(converted.ensure_converted(name).gguf).tensors}
        heads[name] = (
            fields["llama.attention.head_count"].contents(),
            fields["llama.attention.head_count_kv"].contents(),
            fields["llama.attention.key_length"].contents(),
            fields["llama.embedding_length"].contents(),
            "output.weight" in tensors,
        )
    assert heads["hf-llama-gqa"] == (4, 2, 16, 64, True)
    assert heads["hf-llama-mqa-tied"] == (4, 1, 16, 64, False)  # llama.cpp reuses token_embd
    assert heads["hf-llama-headdim"] == (4, 2, 32, 64, True)  # 32 != 64 / 4


def test_each_family_has_what_sets_it_apart_switched_on() -> None:
    def read(name: str) -> tuple[dict[str, object], dict[str, list[int]]]:
        reader = GGUFReader(converted.ensure_converted(name).gguf)
        fields = {k: f.contents() for k, f in reader.fields.items() if k.count(".") >= 1}
        return fields, {t.name: t.shape.tolist() for t in reader.tensors}

    fields, tensors = read("hf-qwen2-bias")
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= tensors.keys()
    assert "output.weight" in tensors
    fields, tensors = read("hf-qwen3-qknorm-tied")
    assert tensors["blk.0.attn_q_norm.weight"] == tensors["blk.0.attn_k_norm.weight"] == [32]
    assert fields["qwen3.attention.key_length"] == 32 and "output.weight" not in tensors
    fields, tensors = read("hf-phi-longrope")
    assert tensors["blk.0.attn_qkv.weight"] == [64, 64 + 2 * 2 * 16]  # fused q, k, v
    assert tensors["blk.0.ffn_up.weight"] == [64, 2 * 128]  # fused gate and up
    assert tensors["rope_factors_short.weight"] == tensors["rope_factors_long.weight"] == [8]
    assert fields["phi3.rope.scaling.original_context_length"] == 4096
    assert abs(float(fields["phi3.rope.scaling.attn_factor"]) - 1.0801) < 1e-4  # type: ignore[arg-type]
    assert "output.weight" in tensors
    fields, tensors = read("hf-gemma3-swa")
    window = fields["gemma3.attention.sliding_window"]
    assert window == tiny_families.GEMMA3_SLIDING_WINDOW and window < len(PROMPT)
    assert fields["gemma3.final_logit_softcapping"] == 10.0
    assert fields["gemma3.block_count"] == 7  # layer 5 global (llama.cpp's pattern of 6)
    assert "output.weight" not in tensors and "blk.6.post_ffw_norm.weight" in tensors


def test_a_fixture_is_the_converters_output_marked(fixture: converted.ConvertedFixture) -> None:
    fields = GGUFReader(fixture.gguf).fields
    arch = arch_of(fixture.name)
    assert fields["general.architecture"].contents() == arch
    assert fields[FIXTURE_MARK_KEY].contents() == converted.fixture_mark(fixture.name)
    assert fields[f"{arch}.block_count"].contents() == n_layer_of(fixture.name)
    assert (fixture.hf_dir / "model.safetensors").is_file()
    assert (fixture.hf_dir / "tokenizer.model").is_file()
    assert sorted(p.name for p in fixture.gguf.parent.iterdir()) == ["hf", "model.gguf"]


def test_a_rebuild_is_bit_identical(tmp_path: Path) -> None:
    cached = converted.ensure_converted("hf-llama-gqa")
    again = converted.build_into(converted.lookup("hf-llama-gqa"), tmp_path)
    assert sha256(again.gguf) == sha256(cached.gguf)
    for name in ("model.safetensors", "config.json", "tokenizer.model"):
        assert sha256(again.hf_dir / name) == sha256(cached.hf_dir / name)


class Pool:
    def __init__(self, path: Path, numerics: Numerics) -> None:
        self.path, self.numerics = path, numerics
        self.engines: dict[tuple[int, int], ShardEngine] = {}

    def run(self, cut: tuple[int, ...]) -> tuple[list[int], list[np.ndarray]]:
        stages = []
        for rng in zip(cut[:-1], cut[1:], strict=True):
            if rng not in self.engines:
                self.engines[rng] = ShardEngine(self.path, layers=rng, numerics=self.numerics, **KW)
            stages.append(self.engines[rng])
        chain = InProcessRoute(stages)
        chain.open(7, 0)
        try:
            return chain.greedy(7, 0, PROMPT, N_DECODE)
        finally:
            chain.close(7, 0)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


@pytest.fixture(scope="module", params=[Numerics(), EXACT], ids=str)
def pool(request: pytest.FixtureRequest, fixture: converted.ConvertedFixture) -> Iterator[Pool]:
    p = Pool(fixture.gguf, request.param)
    yield p
    p.close()


def test_every_split_equals_the_whole_model(
    pool: Pool, fixture: converted.ConvertedFixture
) -> None:
    n_layer = n_layer_of(fixture.name)
    tokens, logits = pool.run((0, n_layer))
    assert len(tokens) == N_DECODE and logits[0].shape == (len(PROMPT), 320)
    for cut in all_cuts(n_layer)[1:]:
        split_tokens, split_logits = pool.run(cut)
        assert split_tokens == tokens, cut
        for a, b in zip(logits, split_logits, strict=True):
            assert np.array_equal(a, b), cut


def test_dgr_fixtures_lists_and_builds_them(capsys: pytest.CaptureFixture[str]) -> None:
    from dgr_engine import cli

    assert cli.main(["fixtures", "build", "hf-llama-headdim"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == converted.ensure_converted("hf-llama-headdim").gguf
    assert cli.main(["fixtures", "list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name} " in out for name in converted.names())
