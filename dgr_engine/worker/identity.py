"""What a worker's advert states about the files and the build it runs: computed once at start.

The GGUF's SHA-256 is streamed (the file may be far larger than memory); the tensor types come
from the GGUF header (``gguf.GGUFReader``, memory-mapped); the llama.cpp commit and the
patch-stack hash are the ones the binding was built with (``dgr_engine._binding``), never read
from a source tree that may have changed since.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import tomllib
from pathlib import Path

import attrs

from dgr_engine._binding import LLAMA_COMMIT, PATCH_STACK_SHA256

_CHUNK = 8 * 1024 * 1024
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def _hex(value: bytes) -> str:
    return value.hex()[:12] + ("…" if len(value) > 6 else "")


def file_sha256(path: str | os.PathLike[str]) -> bytes:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.digest()


def model_sha256(path: str | os.PathLike[str], cache_dir: Path | None = None) -> bytes:
    """SHA-256 of a model file, computed once per machine: cached under ``cache_dir`` (default
    ``$DGR_CACHE_DIR`` or ``~/.cache/dgr``) by absolute path, size and modification time, so a
    worker restart does not read every layer of a large GGUF it mostly does not own."""
    real = Path(path).resolve()
    stat = real.stat()
    root = cache_dir or Path(os.environ.get("DGR_CACHE_DIR") or Path.home() / ".cache" / "dgr")
    key = hashlib.sha256(f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    entry = root / "model-sha256" / key[:32]
    try:
        cached = bytes.fromhex(entry.read_text().strip())
        if len(cached) == 32:
            return cached
    except (OSError, ValueError):
        pass
    digest = file_sha256(real)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest.hex())
        tmp.replace(entry)
    except OSError:
        pass  # an unwritable cache only costs the next start a re-hash
    return digest


def gguf_tensor_types(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The tensor types present in a GGUF (e.g. ``("F16", "F32")``), sorted."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return tuple(sorted({t.tensor_type.name for t in reader.tensors}))


def dgr_version() -> str:
    """The installed distribution's version, else ``pyproject.toml``'s, else ``0+unknown``."""
    try:
        return importlib.metadata.version("dgr")
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = _PACKAGE_ROOT / "pyproject.toml"
    try:
        version = tomllib.loads(pyproject.read_text())["project"]["version"]
        return f"{version}+source"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0+unknown"


def hardware_class() -> str:
    """A coarse hardware class for the lane (the machine architecture)."""
    return platform.machine() or "unknown"


@attrs.frozen
class BuildIdentity:
    """The static half of an advert: the model file and the build serving it."""

    model_sha256: bytes = attrs.field(repr=_hex)
    quant_types: tuple[str, ...]
    llama_cpp_commit: str
    patch_stack_sha256: bytes = attrs.field(repr=_hex)
    dgr_version: str
    hardware: str
    backend: str = "cpu"
    kv_type: str = "f16"
    """llama.cpp's default KV type, which ``native/src/dgr_shard.cpp`` keeps."""

    @classmethod
    def of_model(cls, model: str | os.PathLike[str]) -> BuildIdentity:
        """Hashes and reads ``model`` (streaming); the build's half from the binding."""
        return cls(
            model_sha256=model_sha256(model),
            quant_types=gguf_tensor_types(model),
            llama_cpp_commit=LLAMA_COMMIT,
            patch_stack_sha256=PATCH_STACK_SHA256,
            dgr_version=dgr_version(),
            hardware=hardware_class(),
        )
