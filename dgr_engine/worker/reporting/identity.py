"""What a worker's advert states about the files and the build it runs: computed once at start.

The GGUF's SHA-256 is streamed (the file may be far larger than memory); the tensor types come
from the GGUF header (:func:`~dgr_engine.gguf_check.check_gguf`, arrays skipped; a worker
parses it once, in its preflight, and passes it whole); the llama.cpp commit, the base
patch-stack hash and the family patch hashes are the ones the binding was built with
(``dgr_engine._binding``), never read from a source tree that may have changed since.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from dgr_engine._binding import (
    BUILD_FLAGS,
    LLAMA_COMMIT,
    PATCH_STACK_SHA256,
    SYSTEM_INFO,
    family_patch_sha256,
)
from dgr_engine.artifacts.shard import ShardArtifacts
from dgr_engine.certification.classify import FIXTURE_MARK_KEY
from dgr_engine.certification.hardware import hardware_fingerprint
from dgr_engine.certification.lane import BATCHING_SESSION, LaneKey
from dgr_engine.numerics import Numerics

if TYPE_CHECKING:
    from dgr_engine.gguf_check import GgufHeader

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


@attrs.frozen
class GgufFacts:
    """What a worker reads from the GGUF's header (memory-mapped, no tensor data)."""

    quant_types: tuple[str, ...]
    """Tensor types present, sorted (e.g. ``("F16", "F32")``)."""
    fixture_mark: str | None
    """The fixture writers' ``dgr.fixture`` mark; ``None`` for any other GGUF."""

    @classmethod
    def of_header(cls, header: GgufHeader) -> GgufFacts:
        """The facts of a header already parsed."""
        return cls(header.tensor_types, header.strings.get(FIXTURE_MARK_KEY))


def gguf_facts(path: str | os.PathLike[str]) -> GgufFacts:
    """The tensor types and the fixture mark of a GGUF, from its header alone
    (:func:`~dgr_engine.gguf_check.check_gguf`: a bounded parse that skips array values, so a
    262k-token vocabulary costs a fraction of a second, where ``gguf.GGUFReader`` takes 10 s
    and more); :class:`~dgr_engine.errors.ModelLoadError` for a file that is not a whole
    GGUF."""
    from dgr_engine.gguf_check import check_gguf

    return GgufFacts.of_header(check_gguf(path))


def gguf_tensor_types(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The tensor types present in a GGUF (e.g. ``("F16", "F32")``), sorted."""
    return gguf_facts(path).quant_types


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


@attrs.frozen
class BuildIdentity:
    """The static half of an advert: the model file and the build serving it."""

    model_sha256: bytes = attrs.field(repr=_hex)
    quant_types: tuple[str, ...]
    llama_cpp_commit: str
    patch_stack_sha256: bytes = attrs.field(repr=_hex)
    dgr_version: str
    hardware: str
    build_flags: str = ""
    """cmake options of the patched libllama (``KEY=VALUE;...``)."""
    system_info: str = ""
    """What ggml was compiled to use (instruction sets, OpenMP)."""
    fixture_mark: str | None = None
    """The GGUF's ``dgr.fixture`` mark (``None``: not a generated fixture)."""
    backend: str = "cpu"
    kv_type: str = "f16"
    """llama.cpp's default KV type, which ``native/src/dgr_shard.cpp`` keeps."""
    flash_attn: str = "auto"
    """llama.cpp's default flash-attention mode, which ``native/src/dgr_shard.cpp`` keeps."""
    placement: str = "cpu"
    """Every owned layer runs on the CPU backend (the only one built)."""
    official_target_sha: str | None = None
    """The upstream model revision, where the split manifest names it."""
    batching: str = BATCHING_SESSION
    """``"co-batch"`` when the worker co-batches sessions (``LaneKey.batching``)."""
    artifacts: str = ""
    """How a split model's files were checked (``verified at start-up``, ``trusted state of
    ...``); empty for a single file, hashed whole at start-up."""

    @classmethod
    def of_model(
        cls, model: str | os.PathLike[str], header: GgufHeader | None = None
    ) -> BuildIdentity:
        """Hashes ``model`` (streaming, once per machine) and reads its header (``header``: the
        one already parsed); the build's half from the binding."""
        facts = gguf_facts(model) if header is None else GgufFacts.of_header(header)
        return cls._of_this_build(model_sha256(model), facts.quant_types, facts.fixture_mark)

    @classmethod
    def _of_this_build(
        cls, sha256: bytes, quant_types: tuple[str, ...], fixture_mark: str | None, **more: Any
    ) -> BuildIdentity:
        """A model's identity served by the build the binding was made from, on this machine."""
        return cls(
            model_sha256=sha256,
            quant_types=quant_types,
            llama_cpp_commit=LLAMA_COMMIT,
            patch_stack_sha256=PATCH_STACK_SHA256,
            dgr_version=dgr_version(),
            hardware=hardware_fingerprint(),
            build_flags=BUILD_FLAGS,
            system_info=SYSTEM_INFO,
            fixture_mark=fixture_mark,
            **more,
        )

    @classmethod
    def of_artifacts(cls, artifacts: ShardArtifacts) -> BuildIdentity:
        """A split model's identity: the manifest's hash and tensor types (the same for every
        shard of the model), the fixture mark of its first file, how the files were checked."""
        manifest = artifacts.manifest
        return cls._of_this_build(
            bytes.fromhex(manifest.sha256),
            manifest.quant_types,
            gguf_facts(artifacts.first).fixture_mark,
            official_target_sha=manifest.official_target_sha,
            artifacts=artifacts.verification,
        )

    def with_numerics(self, numerics: Numerics) -> BuildIdentity:
        """This build serving with ``numerics`` (the engine's KV type and flash-attention
        mode)."""
        return attrs.evolve(self, kv_type=numerics.kv_type, flash_attn=numerics.flash_attn)

    def lane_key(self, *, arch: str, n_layer: int, context_per_session: int) -> LaneKey:
        """The exact lane this build serves the model on, with this context per session: the
        base patch stack's hash and, for an architecture with a family patch, that patch's
        (from the binding)."""
        return LaneKey(
            backend=self.backend,
            llama_cpp_commit=self.llama_cpp_commit,
            patch_stack_sha256=self.patch_stack_sha256.hex(),
            dgr_version=self.dgr_version,
            build_flags=self.build_flags,
            system_info=self.system_info,
            hardware=self.hardware,
            model_sha256=self.model_sha256.hex(),
            arch=arch,
            n_layer=n_layer,
            quant_types=self.quant_types,
            kv_type=self.kv_type,
            flash_attn=self.flash_attn,
            context_per_session=context_per_session,
            placement=self.placement,
            batching=self.batching,
            family_patch_sha256=family_patch_sha256(arch).hex(),
        )
