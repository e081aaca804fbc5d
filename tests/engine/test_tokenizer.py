"""Text in, text out (issue 17, part 1): the vocabulary of a GGUF through llama.cpp (no
weights), streaming-safe detokenizing, chat templates, end-of-generation tokens, and ``dgr
generate --prompt TEXT`` over spawned workers on a converter-made fixture (a real tokenizer);
the generated fixtures, which have none, refuse text in one line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dgr_engine.client.text import prompt_ids
from dgr_engine.errors import InvalidArgument, UnsupportedFeature
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.fixtures.converted import ensure_converted
from dgr_engine.tokenizer import TextStream, Tokenizer
from dgr_engine.tooling.processes import dgr_command

BYTE_BASE = 3
"""The tiny tokenizer's byte pieces <0x00>..<0xFF> follow <unk>, <s>, </s>."""


@pytest.fixture(scope="module")
def converted() -> Path:
    return ensure_converted("hf-llama-gqa").gguf


@pytest.fixture(scope="module")
def tokenizer(converted: Path) -> Iterator[Tokenizer]:
    with Tokenizer(converted) as t:
        yield t


def test_text_round_trips_through_the_models_own_tokenizer(tokenizer: Tokenizer) -> None:
    info = tokenizer.info
    assert (info.n_vocab, info.bos, info.eos, info.add_bos) == (320, 1, 2, True)
    assert info.has_tokenizer and info.has_chat_template
    ids = tokenizer.encode("hello world, the cat")
    assert ids[0] == 1 and 1 not in ids[1:]  # the BOS the model wants, once
    assert tokenizer.decode(ids[1:]).strip() == "hello world, the cat"
    assert tokenizer.encode("hello", add_special=False)[0] != 1
    assert tokenizer.eog_tokens == frozenset({2}) and tokenizer.is_eog(2)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        tokenizer.piece(320)


def test_a_character_split_across_pieces_waits_for_its_last_byte(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer)
    first, second = "é".encode()
    assert tokenizer.piece(BYTE_BASE + first) == bytes([first])
    assert stream.push(BYTE_BASE + first) == ""  # half a character: held back
    assert stream.push(BYTE_BASE + second) == "é"
    assert stream.push(BYTE_BASE + first) == "" and stream.flush() == "\ufffd"  # never completed


def test_the_chat_template_of_the_gguf_is_applied(tokenizer: Tokenizer) -> None:
    text = tokenizer.chat([("system", "be brief"), ("user", "hi")])
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt_ids(tokenizer, "hi", chat=True) == tokenizer.encode(
        tokenizer.chat([("user", "hi")]), parse_special=True
    )


def test_a_model_without_a_tokenizer_takes_token_ids_only() -> None:
    with Tokenizer(ensure_fixture("tiny-llama")) as ids_only:
        assert not ids_only.info.has_tokenizer and not ids_only.info.has_chat_template
        with pytest.raises(UnsupportedFeature, match="no tokenizer"):
            ids_only.encode("hi")
        with pytest.raises(UnsupportedFeature, match="no chat template"):
            ids_only.chat([("user", "hi")])


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [dgr_command(), "generate", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # starts worker processes
def test_generate_takes_and_prints_text_and_refuses_it_without_a_tokenizer(
    converted: Path, tmp_path: Path
) -> None:
    certified = subprocess.run(
        [dgr_command(), "certify", "--model", str(converted), "--evidence", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert certified.returncode == 0, certified.stdout + certified.stderr
    common = ["--spawn", "2", "--model", str(converted), "--require", "fixture"]
    common += ["--evidence", str(tmp_path), "-n", "12"]
    done = _generate(*common, "--prompt", "hello world", "--check", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["state"] == "done" and out["whole_model_equal"] is True
    with Tokenizer(converted) as tokenizer:
        assert out["text"] == tokenizer.decode([t for t in out["tokens"] if t != 2])
    streamed = _generate(*common, "--prompt", "hello world", "--chat")
    assert streamed.returncode == 0, streamed.stderr
    assert "state done" in streamed.stderr and streamed.stdout.endswith("\n")
    refused = _generate("--spawn", "2", "--fixture", "tiny-llama", "--prompt", "hello")
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("dgr generate: tiny-llama-") and line.endswith(
        ".gguf has no tokenizer (token ids only, like the generated fixtures): give token ids "
        "with --ids"
    )
    ids = _generate("--spawn", "2", "--fixture", "tiny-llama", "--ids", "--prompt", "x y")
    assert ids.returncode == 2 and "with --ids the prompt is token ids" in ids.stderr


def test_a_split_models_first_file_carries_the_same_tokenizer(tokenizer: Tokenizer) -> None:
    from dgr_engine.fixtures.split import ensure_split

    split = ensure_split("hf-llama-gqa-split")
    assert split.manifest.files[0].tensors == ()  # metadata only: no weights to read
    with Tokenizer(split.first) as first:
        assert first.info == tokenizer.info
        text = "hello world, the cat"
        assert first.encode(text) == tokenizer.encode(text)
        assert first.chat([("user", "hi")]) == tokenizer.chat([("user", "hi")])
