"""dgr's one reader of GGUF metadata (``dgr_engine.gguf_check``): the facts a worker needs,
equal to what ``gguf.GGUFReader`` reads, with every array skipped, so that a worker's start
costs no memory that depends on the vocabulary; and no other reader in the worker's path."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import pytest

from dgr_engine.errors import ModelLoadError
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.gguf_check import check_gguf
from dgr_engine.reference import arch_of, n_layer_of, owns_mtp_block

PACKAGE = Path(__file__).resolve().parents[2] / "dgr_engine"
WRITERS = ("baseline", "fixtures")
"""Rooms that make GGUFs or compare against reference frameworks, never run by a worker."""


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-v4", "tiny-v4-mtp"])
def test_the_header_holds_what_gguf_reader_reads(name: str) -> None:
    from gguf import GGUFReader

    path = ensure_fixture(name)
    header = check_gguf(path)
    reader = GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    nextn = reader.fields.get(f"{arch}.nextn_predict_layers")
    n_nextn = int(nextn.contents()) if nextn is not None else 0
    assert header.arch == arch
    assert header.n_nextn == n_nextn
    assert header.n_main_layers == int(reader.fields[f"{arch}.block_count"].contents()) - n_nextn
    assert [(t.name, t.shape, t.type_name) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type.name) for t in reader.tensors
    ]
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert header.n_vocab == int(embd.shape[-1])
    # the helpers every command uses read the same header
    assert (arch_of(path), n_layer_of(path)) == (arch, header.n_main_layers)
    last = (0, header.n_main_layers)
    assert owns_mtp_block(path, last) == (arch == "deepseek4" and n_nextn > 0)
    assert owns_mtp_block(path, (0, -1)) == owns_mtp_block(path, last)
    assert not owns_mtp_block(path, (0, 1))


def _gguf_with_strings(path: Path, strings: list[bytes], *, claimed: int | None = None) -> None:
    """A GGUF of no tensors whose one key is an array of ``strings`` (its count ``claimed``)."""

    def string(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    body += string(b"general.architecture") + struct.pack("<I", 8) + string(b"llama")
    body += string(b"tokenizer.ggml.tokens") + struct.pack("<II", 9, 8)
    body += struct.pack("<Q", len(strings) if claimed is None else claimed)
    body += b"".join(string(s) for s in strings)
    path.write_bytes(body)


def test_a_string_array_is_skipped_undecoded_and_its_end_checked(tmp_path: Path) -> None:
    path = tmp_path / "vocab.gguf"
    _gguf_with_strings(path, [b"\xff\xfe not utf-8", b"ok", b""] * 1000)
    header = check_gguf(path)
    assert (header.arch, header.tensors, header.n_vocab) == ("llama", (), None)
    # an array that claims more strings than the file holds: one line, nothing materialised
    _gguf_with_strings(path, [b"a", b"b"], claimed=10)
    with pytest.raises(ModelLoadError, match="truncated GGUF"):
        check_gguf(path)
    # a string whose length runs past the end of the file
    body = path.read_bytes()
    path.write_bytes(body[: body.rindex(b"b") - 8] + struct.pack("<Q", 1 << 20) + b"b")
    with pytest.raises(ModelLoadError, match="truncated GGUF"):
        check_gguf(path)


def test_no_module_a_worker_imports_parses_a_gguf_with_gguf_reader() -> None:
    """``gguf.GGUFReader`` builds an object per vocabulary entry: only the rooms that write
    fixtures or run reference frameworks may use it."""
    users = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in WRITERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "gguf":
                if any(alias.name == "GGUFReader" for alias in node.names):
                    users.append(str(relative))
    assert users == [], users
