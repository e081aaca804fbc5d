"""Converter-made fixtures: tiny transformers models converted by llama.cpp's own converter at the
pinned commit. They are bit-reproducible, marked as fixtures, and every split equals the whole
model bit for bit (prefill and decode) at the default and at the exact numerics."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from dgr_engine import ShardEngine
from dgr_engine.certification.classify import FIXTURE_MARK_KEY
from dgr_engine.baseline import converter
from dgr_engine.fixtures import converted
from dgr_engine.numerics import EXACT, Numerics
from dgr_engine.reference import LocalChain
from tests.engine.test_engine_parity import all_cuts

N_LAYER = 3
PROMPT = [int(t) for t in (np.arange(14) * 37 + 11) % 317 + 3]
N_DECODE = 12
KW = {"max_sessions": 1, "n_ctx_per_session": 64, "n_threads": 2, "n_batch": 32}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


DENSE = [name for arch in ("llama", "qwen2", "qwen3") for name in converted.names(arch)]
"""The dense families' converter-made fixtures: Llama, and the family patches' qwen2 and qwen3."""


def arch_of(name: str) -> str:
    spec = converted.lookup(name)
    return converter.COVERED[spec.model_class]


@pytest.fixture(scope="module", params=DENSE)
def fixture(request: pytest.FixtureRequest) -> converted.ConvertedFixture:
    return converted.ensure_converted(request.param)


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


def test_the_qwen_fixtures_carry_their_family_features() -> None:
    qwen2 = {t.name for t in GGUFReader(converted.ensure_converted("hf-qwen2-bias-tied").gguf).tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= qwen2
    assert "output.weight" not in qwen2  # tied head
    qwen3 = GGUFReader(converted.ensure_converted("hf-qwen3-qknorm").gguf)
    names = {t.name for t in qwen3.tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "output.weight"} <= names
    assert qwen3.fields["qwen3.attention.key_length"].contents() == 32  # != 64 / 4


def test_a_fixture_is_the_converters_output_marked(fixture: converted.ConvertedFixture) -> None:
    fields = GGUFReader(fixture.gguf).fields
    arch = arch_of(fixture.name)
    assert fields["general.architecture"].contents() == arch
    assert fields[FIXTURE_MARK_KEY].contents() == converted.fixture_mark(fixture.name)
    assert fields[f"{arch}.block_count"].contents() == N_LAYER
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
        chain = LocalChain(stages)
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


def test_every_split_equals_the_whole_model(pool: Pool) -> None:
    tokens, logits = pool.run((0, N_LAYER))
    assert len(tokens) == N_DECODE and logits[0].shape == (len(PROMPT), 320)
    for cut in all_cuts(N_LAYER)[1:]:
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
