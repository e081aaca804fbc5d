"""A GGUF file checked before anything loads it: the header parsed with bounds, and every
tensor's data extent compared with the file's size, so that a truncated or corrupt file is
refused in one line naming the path and what is wrong (instead of numpy's reshape error from a
reader, or llama.cpp's after allocating).

Only what a worker needs before loading is kept (:class:`GgufHeader`); the engine still reads
the file itself. This is dgr's one reader of GGUF metadata outside the engine: array values (a
262,144-token vocabulary, its scores and types) are skipped, never decoded or materialised, so
a header costs a few MiB of reads and no memory that outlives the parse, whatever the
vocabulary (``gguf.GGUFReader`` maps the file and builds an object per token: about 600 MiB
and seconds for Gemma 3's).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import attrs

from dgr_engine.errors import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MOST_TENSORS = 1 << 20
_MOST_KV = 1 << 20
_MOST_STRING = 1 << 26
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@attrs.frozen
class GgufTensor:
    """One tensor's entry in the header: its name, shape (GGUF order: the row length first)
    and type name (``GGMLQuantizationType``'s, e.g. ``"Q4_K"``)."""

    name: str
    shape: tuple[int, ...]
    type_name: str


@attrs.frozen
class GgufHeader:
    """What a worker checks before loading."""

    arch: str
    context_length: int | None
    """``{arch}.context_length`` (the training context), if stated."""
    n_layer: int | None
    """``{arch}.block_count``: every block, MTP/nextn blocks included."""
    n_embd: int | None
    n_head: int | None
    n_head_kv: int | None
    n_tensors: int
    data_bytes: int
    """Bytes of tensor data the header describes."""
    tensor_types: tuple[str, ...] = ()
    """The tensor types present, sorted (``GGMLQuantizationType`` names, e.g. ``("F32",
    "Q4_K")``)."""
    strings: dict[str, str] = attrs.field(factory=dict, repr=False)
    """Every string-valued key of the metadata (``general.name``, a fixture's mark, ...)."""
    n_nextn: int = 0
    """``{arch}.nextn_predict_layers``: the MTP blocks at the end, never routed."""
    tensors: tuple[GgufTensor, ...] = attrs.field(default=(), repr=False)
    """Every tensor's entry, in the header's order."""

    @property
    def n_main_layers(self) -> int:
        """The layers a route splits: ``block_count`` less the MTP/nextn blocks (as the C
        engine counts them); 0 when the header states no block count."""
        return (self.n_layer or 0) - self.n_nextn

    @property
    def n_vocab(self) -> int | None:
        """The vocabulary's size: the token embedding's row count (``None``: no such
        tensor)."""
        for tensor in self.tensors:
            if tensor.name == "token_embd.weight" and tensor.shape:
                return tensor.shape[-1]
        return None

    def owns_mtp_block(self, layers: tuple[int, int]) -> bool:
        """Whether a shard over ``layers`` (``-1`` as the end: to the last layer) is the last
        stage of a deepseek4 model with an MTP block, the one that loads it
        (``docs/speculative.md``, the ownership contract)."""
        if self.arch != "deepseek4" or self.n_nextn <= 0:
            return False
        return layers[1] in (-1, self.n_main_layers)


class _Truncated(Exception):
    pass


class _Reader:
    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def take(self, n: int) -> bytes:
        data = self.stream.read(n)
        if len(data) != n:
            raise _Truncated(f"the header ends early (at byte {self.stream.tell()})")
        return data

    def scalar(self, code: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]

    def string_length(self) -> int:
        n = self.scalar("Q")
        if n > _MOST_STRING:
            raise ValueError(f"a string of {n} bytes at byte {self.stream.tell() - 8}")
        return int(n)

    def string(self) -> str:
        return self.take(self.string_length()).decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        """Moves past ``n`` bytes without reading them into memory."""
        self.stream.seek(n, os.SEEK_CUR)

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, count = self.scalar("I"), self.scalar("Q")
            if count > _MOST_STRING:
                raise ValueError(f"an array of {count} values")
            # skipped, never needed before loading: neither read into memory nor decoded (the
            # file's size bounds every skip: a tensor's extent past it is refused after)
            if element in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[element]))
            elif element == _STRING:
                for _ in range(count):
                    self.skip(self.string_length())
            else:
                for _ in range(count):
                    self.value(element)
            return None
        raise ValueError(f"unknown value type {kind} at byte {self.stream.tell() - 4}")


def check_gguf(path: str | os.PathLike[str]) -> GgufHeader:
    """Parses ``path``'s header and checks every tensor's extent against the file's size;
    raises :class:`ModelLoadError` naming the path and what is wrong."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as stream:
            reader = _Reader(stream)
            magic = reader.take(4)
            if magic != _MAGIC:
                raise ValueError(f"not a GGUF file (magic {magic!r}, expected {_MAGIC!r})")
            version, n_tensors, n_kv = reader.scalar("I"), reader.scalar("Q"), reader.scalar("Q")
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            if n_tensors > _MOST_TENSORS or n_kv > _MOST_KV:
                raise ValueError(f"{n_tensors} tensors and {n_kv} keys: not a plausible header")
            kv: dict[str, Any] = {}
            for _ in range(n_kv):
                key = reader.string()
                kv[key] = reader.value(reader.scalar("I"))
            tensors = []
            for _ in range(n_tensors):
                name = reader.string()
                n_dims = reader.scalar("I")
                if n_dims > 8:
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
                dims = [reader.scalar("Q") for _ in range(n_dims)]
                kind, offset = reader.scalar("I"), reader.scalar("Q")
                tensors.append((name, dims, kind, offset))
            alignment = int(kv.get("general.alignment") or _DEFAULT_ALIGNMENT)
            header_end = stream.tell()  # past the file's end where a skip ran over it
            start = -(-header_end // alignment) * alignment
    except _Truncated as exc:
        raise ModelLoadError(f"{path}: truncated GGUF: {exc}; the file has {size} bytes") from None
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: corrupt GGUF header: {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None

    if header_end > size:
        raise ModelLoadError(
            f"{path}: truncated GGUF: the header ends at byte {header_end}, the file has {size}"
        )
    end_of_data = start
    entries = []
    for name, dims, kind, offset in tensors:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            type_name = GGMLQuantizationType(kind).name
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: corrupt GGUF: tensor {name!r} has type {kind}") from None
        entries.append(GgufTensor(name, tuple(dims), type_name))
        elements = 1
        for dim in dims:
            elements *= dim
        end = start + offset + elements // block * type_size
        if end > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF: tensor {name!r} needs bytes up to {end}, "
                f"the file has {size}"
            )
        end_of_data = max(end_of_data, end)
    arch = str(kv.get("general.architecture", ""))

    def number(key: str) -> int | None:
        value = kv.get(f"{arch}.{key}")
        return int(value) if isinstance(value, int) else None

    return GgufHeader(
        arch=arch,
        context_length=number("context_length"),
        n_layer=number("block_count"),
        n_embd=number("embedding_length"),
        n_head=number("attention.head_count"),
        n_head_kv=number("attention.head_count_kv"),
        n_tensors=len(tensors),
        data_bytes=end_of_data - start,
        tensor_types=tuple(sorted({t.type_name for t in entries})),
        strings={k: v for k, v in kv.items() if isinstance(v, str)},
        n_nextn=number("nextn_predict_layers") or 0,
        tensors=tuple(entries),
    )
