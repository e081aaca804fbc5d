"""The hashed manifest of a model's artifact files (issue 14's first part).

One canonical JSON document names the model (architecture, main layers, upstream target SHA where
known) and, for each file of a single or split GGUF: its name, size, SHA-256, the SHA-256 of every
fixed-size chunk (so verification can run, and resume, chunk by chunk) and which tensors, and
hence which layers, it holds. The manifest's hash is the SHA-256 of its canonical JSON (sorted
keys, no insignificant whitespace); for a split model it is the model identity's content hash.

Refusals are :class:`ManifestInvalid`, one line naming the file and the field. A
:class:`FileEntry` or :class:`Manifest` that breaks a rule cannot be made at all (the checks run
when one is constructed, parsed or not), so nothing downstream ever acts on a manifest that
disagrees with itself: a negative or zero size, a chunk size above :data:`MAX_CHUNK_BYTES`, a
chunk list that does not fit the size, a name that is not a plain file name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from dgr_engine.errors import ModelLoadError
from dgr_engine.gguf_check import check_gguf
from dgr_session.errors import DgrError

MANIFEST_SCHEMA: Final = "dgr.manifest/1"
CHUNK_BYTES: Final = 16 << 20
"""Chunk size of the per-chunk hashes (16 MiB)."""
MAX_CHUNK_BYTES: Final = 256 << 20
"""The largest chunk a manifest may ask for (256 MiB): verifying reads one chunk at a time, so
this bounds the memory a manifest can make fetch or verify take."""
_PART_SUFFIX: Final = ".part"
_LAYER = re.compile(r"^blk\.(\d+)\.")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}$")
_INPUT_PREFIXES: Final = (
    "token_embd.",
    "token_embd_norm.",
    "token_types.",
    "per_layer_token_embd.",
)
_OUTPUT_PREFIXES: Final = ("output.", "output_norm.", "output_hc_", "cls.", "cls_out.")


class ManifestInvalid(DgrError, ValueError):
    """A manifest that does not parse, has another schema, or disagrees with itself."""

    def __init__(
        self, message: str, *, path: Path | str | None = None, field: str = "", reason: str = ""
    ) -> None:
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{message}")
        self.path = None if path is None else Path(path)
        self.field = field
        self.reason = reason or message
        """What is wrong, without the file and field."""


def _tuple(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(values)


@attrs.frozen
class FileEntry:
    """One artifact file."""

    name: str
    size: int
    sha256: str
    chunk_bytes: int
    chunks: tuple[str, ...] = attrs.field(converter=_tuple)
    """SHA-256 of each ``chunk_bytes`` chunk, in order (the last one may be shorter)."""
    tensors: tuple[str, ...] = attrs.field(converter=_tuple)
    """Names of the tensors whose data lies in this file, sorted."""
    types: tuple[str, ...] = attrs.field(converter=_tuple, default=())
    """Element types of those tensors (``F16``, ``Q8_0``...), sorted, each once."""

    def __attrs_post_init__(self) -> None:
        if problem := entry_problem(self):
            field, why = problem
            raise ManifestInvalid(f"{self.name!r}: {field}: {why}", field=field, reason=why)

    @property
    def layers(self) -> tuple[int, ...]:
        """Main layers (``blk.N.``) with a tensor in this file, sorted."""
        found = {int(m.group(1)) for t in self.tensors if (m := _LAYER.match(t))}
        return tuple(sorted(found))

    @property
    def shared(self) -> bool:
        """Holds tensors outside every layer (embedding, output head, norms)."""
        return any(_LAYER.match(t) is None for t in self.tensors)


def entry_problem(entry: FileEntry) -> tuple[str, str] | None:
    """What is wrong with ``entry`` as ``(field, why)``, or ``None``."""
    if not isinstance(entry.name, str) or not _SAFE_NAME.match(entry.name):
        return "name", f"{entry.name!r} is not a plain file name"
    if entry.name.endswith(_PART_SUFFIX):
        return "name", f"{entry.name!r} ends in {_PART_SUFFIX} (the name of a partial fetch)"
    for field in ("size", "chunk_bytes"):
        value = getattr(entry, field)
        if not isinstance(value, int) or isinstance(value, bool):
            return field, f"wrong type {value!r}"
    if entry.size <= 0:
        return "size", f"{entry.size} bytes: a GGUF file is never empty nor negative"
    if not 0 < entry.chunk_bytes <= MAX_CHUNK_BYTES:
        return "chunk_bytes", f"{entry.chunk_bytes}: chunks are 1 byte to {MAX_CHUNK_BYTES} bytes"
    for field in ("chunks", "tensors", "types"):
        if not all(isinstance(v, str) for v in getattr(entry, field)):
            return field, "not a list of strings"
    if not isinstance(entry.sha256, str):
        return "sha256", f"wrong type {entry.sha256!r}"
    needed = -(-entry.size // entry.chunk_bytes)
    if len(entry.chunks) != needed:
        return "chunks", (
            f"{len(entry.chunks)} chunk hashes for {entry.size} bytes in chunks of "
            f"{entry.chunk_bytes}"
        )
    return None


def tensor_role(name: str) -> str:
    """Which shards load a tensor outside the layers, as llama.cpp's loader (with dgr's patch
    0002) decides: ``input`` (the first shard), ``output`` (the last) or ``all``."""
    if name.startswith(_INPUT_PREFIXES):
        return "input"
    if name.startswith(_OUTPUT_PREFIXES):
        return "output"
    return "all"


@attrs.frozen
class Manifest:
    """A model's artifact files, hashed."""

    arch: str
    n_layer: int
    official_target_sha: str | None
    files: tuple[FileEntry, ...] = attrs.field(converter=_tuple)

    def __attrs_post_init__(self) -> None:
        if not self.files:
            raise ManifestInvalid("files: empty", field="files")
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ManifestInvalid("files: a file name appears twice", field="files")
        if isinstance(self.n_layer, bool) or not isinstance(self.n_layer, int) or self.n_layer < 0:
            raise ManifestInvalid(f"model.n_layer: {self.n_layer!r}", field="model.n_layer")

    def canonical(self) -> dict[str, Any]:
        """The JSON-ready canonical form (what the hash is taken of)."""
        return {
            "schema": MANIFEST_SCHEMA,
            "model": {
                "arch": self.arch,
                "n_layer": self.n_layer,
                "official_target_sha": self.official_target_sha,
            },
            "files": [
                {
                    "name": f.name,
                    "size": f.size,
                    "sha256": f.sha256,
                    "chunk_bytes": f.chunk_bytes,
                    "chunks": list(f.chunks),
                    "tensors": list(f.tensors),
                    "types": list(f.types),
                    "layers": list(f.layers),
                }
                for f in self.files
            ],
        }

    def text(self) -> str:
        """Canonical JSON: sorted keys, no insignificant whitespace."""
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of :meth:`text`."""
        return hashlib.sha256(self.text().encode()).hexdigest()

    @property
    def quant_types(self) -> tuple[str, ...]:
        """Every tensor type of the model, sorted."""
        return tuple(sorted({kind for f in self.files for kind in f.types}))

    @property
    def size(self) -> int:
        """Bytes of every file together."""
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry:
        """The entry named ``name``; :class:`ManifestInvalid` when there is none."""
        for entry in self.files:
            if entry.name == name:
                return entry
        raise ManifestInvalid(f"no file named {name!r} in the manifest", field="files")

    def files_for(self, layers: tuple[int, int] | None) -> tuple[FileEntry, ...]:
        """The files a shard owning main layers ``[begin, end)`` reads (``None``: the whole
        model): the first file (it holds the metadata), those holding its layers' tensors, those
        holding a tensor every shard loads, and, for the first and the last shard, those with
        the embedding and the output tensors (the token embedding too when it is the tied
        output head). Next-token (MTP) layers past ``n_layer`` belong to the last shard."""
        if layers is None:
            return self.files
        begin, end = layers
        end = self.n_layer if end < 0 else end
        first, last = begin == 0, end >= self.n_layer
        tied = not any("output.weight" in f.tensors for f in self.files)

        def needed(name: str) -> bool:
            if match := _LAYER.match(name):
                index = int(match.group(1))
                return begin <= index < end or (last and index >= self.n_layer)
            role = tensor_role(name)
            if role == "input":
                return first or (last and tied and name.startswith("token_embd."))
            return role == "all" or (role == "output" and last)

        return tuple(
            f for i, f in enumerate(self.files) if i == 0 or any(needed(t) for t in f.tensors)
        )


def _file_hashes(path: Path, chunk_bytes: int) -> tuple[int, str, tuple[str, ...]]:
    whole = hashlib.sha256()
    chunks: list[str] = []
    size = 0
    with path.open("rb") as stream:
        while block := stream.read(chunk_bytes):
            whole.update(block)
            chunks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
    return size, whole.hexdigest(), tuple(chunks)


def gguf_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files named, a directory standing for its ``*.gguf`` files in name order (the
    split order of ``NAME-0000i-of-0000n.gguf``)."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            inside = sorted(path.glob("*.gguf"))
            if not inside:
                raise ManifestInvalid("no *.gguf file in this directory", path=path)
            found.extend(inside)
        else:
            found.append(path)
    return found


def header_tensors(path: Path) -> tuple[str, ...]:
    """The tensor names in a GGUF's header, sorted (:class:`~dgr_engine.errors.ModelLoadError`
    for a file that is no whole GGUF)."""
    return tuple(sorted(t.name for t in check_gguf(path).tensors))


def build_manifest(
    paths: Sequence[str | os.PathLike[str]],
    *,
    official_target_sha: str | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Manifest:
    """The manifest of one GGUF or of every file of a split GGUF (in split order; a directory
    stands for its ``*.gguf`` files)."""
    if not paths:
        raise ManifestInvalid("no files given")
    entries: list[FileEntry] = []
    arch, n_layer = "", 0
    for path in gguf_files(paths):
        try:
            header = check_gguf(path)
        except ModelLoadError as exc:
            raise ManifestInvalid(str(exc), path=path) from None
        if not arch:
            if not header.arch:
                raise ManifestInvalid("no general.architecture", path=path)
            arch, n_layer = header.arch, header.n_main_layers
        size, sha, chunks = _file_hashes(path, chunk_bytes)
        tensors = sorted(t.name for t in header.tensors)
        types = sorted({t.type_name for t in header.tensors})
        entries.append(FileEntry(path.name, size, sha, chunk_bytes, chunks, tensors, types))
    return Manifest(arch, n_layer, official_target_sha, entries)


def _need(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise ManifestInvalid(f"{where}.{key}: missing", field=f"{where}.{key}")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ManifestInvalid(f"{where}.{key}: wrong type {value!r}", field=f"{where}.{key}")
    return value


def parse_manifest(text: str | bytes, *, path: Path | None = None) -> Manifest:
    """The manifest of a canonical JSON document; :class:`ManifestInvalid` naming the field."""
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestInvalid(f"not JSON: {exc}", path=path) from None
    try:
        if not isinstance(data, dict):
            raise ManifestInvalid("not a JSON object")
        schema = data.get("schema")
        if schema != MANIFEST_SCHEMA:
            raise ManifestInvalid(
                f"schema {schema!r}: this dgr reads {MANIFEST_SCHEMA!r}", field="schema"
            )
        model = _need(data, "model", dict, "manifest")
        target = model.get("official_target_sha")
        if target is not None and not isinstance(target, str):
            raise ManifestInvalid("model.official_target_sha: not a string or null")
        files: list[FileEntry] = []
        for index, entry in enumerate(_need(data, "files", list, "manifest")):
            where = f"files[{index}]"
            if not isinstance(entry, dict):
                raise ManifestInvalid(f"{where}: not an object", field=where)
            name = _need(entry, "name", str, where)
            if not _SAFE_NAME.match(name) or any(f.name == name for f in files):
                raise ManifestInvalid(
                    f"{where}.name: {name!r} is not a plain, unique file name",
                    field=f"{where}.name",
                )
            fields = {
                "size": _need(entry, "size", int, where),
                "sha256": _need(entry, "sha256", str, where),
                "chunk_bytes": _need(entry, "chunk_bytes", int, where),
                "chunks": _need(entry, "chunks", list, where),
                "tensors": _need(entry, "tensors", list, where),
                "types": _need(entry, "types", list, where),
            }
            try:
                item = FileEntry(name=name, **fields)
            except ManifestInvalid as exc:
                field = f"{where}.{exc.field}"
                raise ManifestInvalid(f"{field}: {exc.reason}", field=field) from None
            if list(item.layers) != entry.get("layers"):
                raise ManifestInvalid(
                    f"{where}.layers: {entry.get('layers')!r} disagrees with its tensors "
                    f"{list(item.layers)!r}",
                    field=f"{where}.layers",
                )
            files.append(item)
        manifest = Manifest(
            arch=_need(model, "arch", str, "model"),
            n_layer=_need(model, "n_layer", int, "model"),
            official_target_sha=target,
            files=files,
        )
    except ManifestInvalid as exc:
        if path is not None and exc.path is None:
            raise ManifestInvalid(str(exc), path=path, field=exc.field) from None
        raise
    return manifest


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Reads and parses a manifest file."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ManifestInvalid(f"not readable: {exc.strerror}", path=path) from None
    return parse_manifest(text, path=path)
