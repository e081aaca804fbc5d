"""Deterministic random-weight GGUF fixtures, built on demand and cached.

Fixtures are small dense models with random weights (fixed seed per fixture name) written with
the PyPI ``gguf`` package. They are fixture-class evidence only: they exercise the runtime, never
a real model. Generated files are git-ignored and rebuilt when their spec changes.

- ``tiny-llama``: 4-layer llama, GQA, f32, separate ``output`` head.
- ``tiny-llama-tied``: the same without ``output`` (llama.cpp reuses ``token_embd``).
- ``mid-llama``: 24-layer llama, f16 matrices, ~450 MB, for memory/speed benchmarks.
- ``tiny-qwen2``: a loadable non-llama architecture (q/k/v biases), for refusal tests.
- ``tiny-v4``: 6-layer DeepSeek V4 (hc 4, 3 hash-routed layers, compress ratios 0/4/128,
  sliding window 32, indexer), f32; ``v4-12``: the same family with 12 layers, for 10+ stages.

Command line::

    python -m dgr_engine.fixtures list
    python -m dgr_engine.fixtures build tiny-llama [--dir D]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
from gguf import GGUFWriter
from loguru import logger

from dgr_engine import _gguf_deepseek4, _gguf_llama
from dgr_engine._gguf_deepseek4 import Deepseek4Spec

GENERATOR_VERSION = 1
"""Bump when the bytes written for an unchanged spec change; cached files then rebuild."""

SUPPORTED_ARCHS = ("llama", "qwen2")
"""Architectures this generator can lay out (both dense, same tensor family)."""

FIXTURES_DIR_ENV = "DGR_FIXTURES_DIR"
"""Environment variable naming the fixture cache directory."""

HEADER_ALLOWANCE = 64 * 1024
"""Upper bound of a fixture file's header (metadata + tensor infos) in bytes."""

ProgressFn = Callable[[int, int], None]
"""Progress callback: ``(bytes_written, bytes_total)`` of tensor data."""

CorruptionKind = Literal["magic", "version", "tensor_count"]


def _check_dims(spec: FixtureSpec, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen
class FixtureSpec:
    """Everything that determines a fixture file's bytes (with ``GENERATOR_VERSION``)."""

    name: str
    """Public fixture name; also seeds the random weights."""
    arch: str = attrs.field(validator=attrs.validators.in_(SUPPORTED_ARCHS))
    """``general.architecture``."""
    n_layer: int = attrs.field(validator=_check_dims)
    n_embd: int = attrs.field(validator=_check_dims)
    n_head: int = attrs.field(validator=_check_dims)
    n_head_kv: int = attrs.field(validator=_check_dims)
    n_ff: int = attrs.field(validator=_check_dims)
    n_vocab: int = attrs.field(validator=_check_dims)
    n_ctx_train: int = attrs.field(validator=_check_dims)
    """``{arch}.context_length``."""
    matrix_dtype: Literal["f32", "f16"] = "f32"
    """Element type of the 2-D weights; norms and biases are always f32."""
    tied_output: bool = False
    """True: no ``output.weight`` tensor, llama.cpp uses ``token_embd`` as the output head."""
    qkv_bias: bool = False
    """Write ``attn_{q,k,v}.bias`` (qwen2 style)."""
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    description: str = ""
    """One line for ``list``; not part of the bytes nor of the cache key."""

    def __attrs_post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} not divisible by n_head {self.n_head}")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} not divisible by n_head_kv {self.n_head_kv}")

    @property
    def head_dim(self) -> int:
        """Per-head dimension, also ``rope.dimension_count``."""
        return self.n_embd // self.n_head

    @property
    def seed(self) -> int:
        """64-bit seed derived from the fixture name only."""
        digest = hashlib.sha256(f"dgr-fixture/{self.name}".encode()).digest()
        return int.from_bytes(digest[:8], "little")


AnySpec = FixtureSpec | Deepseek4Spec
"""A dense (llama-family) or a DeepSeek V4 fixture spec."""

_TINY_LLAMA = FixtureSpec(
    name="tiny-llama",
    arch="llama",
    n_layer=4,
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    n_ff=128,
    n_vocab=256,
    n_ctx_train=512,
    description="4-layer dense llama, GQA 4/2, f32, separate output head",
)
_TINY_V4 = Deepseek4Spec(
    name="tiny-v4",
    n_layer=6,
    n_embd=64,
    n_head=2,
    head_dim=128,
    n_rot=32,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    n_expert=4,
    n_expert_used=2,
    n_ff_exp=64,
    n_expert_shared=1,
    n_vocab=256,
    n_ctx_train=1024,
    n_swa=32,
    compress_ratios=(0, 4, 128, 4, 0, 128),
    hash_layer_count=3,
    description="6-layer DeepSeek V4: hc 4, 3 hash layers, ratios 0/4/128, SWA 32",
)

FIXTURES: Mapping[str, AnySpec] = types.MappingProxyType(
    {
        s.name: s
        for s in (
            _TINY_LLAMA,
            attrs.evolve(
                _TINY_LLAMA,
                name="tiny-llama-tied",
                tied_output=True,
                description="tiny-llama without output.weight (tied to token_embd)",
            ),
            FixtureSpec(
                name="mid-llama",
                arch="llama",
                n_layer=24,
                n_embd=1024,
                n_head=16,
                n_head_kv=8,
                n_ff=1792,
                n_vocab=8192,
                n_ctx_train=4096,
                matrix_dtype="f16",
                description="24-layer dense llama, f16 matrices, ~450 MB, for benchmarks",
            ),
            FixtureSpec(
                name="tiny-qwen2",
                arch="qwen2",
                n_layer=2,
                n_embd=64,
                n_head=4,
                n_head_kv=2,
                n_ff=128,
                n_vocab=256,
                n_ctx_train=512,
                qkv_bias=True,
                rms_eps=1e-6,
                rope_freq_base=1_000_000.0,
                description="2-layer qwen2 (q/k/v biases): an architecture dgr must refuse",
            ),
            _TINY_V4,
            attrs.evolve(
                _TINY_V4,
                name="v4-12",
                n_layer=12,
                compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128, 0, 4, 128, 4),
                description="12-layer DeepSeek V4 (tiny-v4 family), for 10+-stage chains",
            ),
        )
    }
)
"""The project's fixtures by public name."""


def estimated_bytes(spec: AnySpec) -> int:
    """Exact size of the tensor data section; the file adds under ``HEADER_ALLOWANCE``."""
    if isinstance(spec, Deepseek4Spec):
        return sum(_gguf_deepseek4.padded(p.nbytes) for p in _gguf_deepseek4.tensor_plan(spec))
    return sum(_gguf_llama.padded(p.nbytes) for p in _gguf_llama.tensor_plan(spec))


def spec_digest(spec: AnySpec) -> str:
    """Short content hash of the spec and ``GENERATOR_VERSION``: the cache key."""
    fields = attrs.asdict(spec, filter=lambda a, _: a.name != "description")
    payload = {"generator_version": GENERATOR_VERSION, **fields}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def fixture_filename(spec: AnySpec) -> str:
    return f"{spec.name}-{spec_digest(spec)}.gguf"


def default_fixtures_dir() -> Path:
    """``$DGR_FIXTURES_DIR`` if set, else ``<repo root>/fixtures`` (git-ignored)."""
    env = os.environ.get(FIXTURES_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "fixtures"


def _tensor_stream(spec: AnySpec, writer: GGUFWriter) -> tuple[int, int, Iterator[Any]]:
    """Adds the metadata and tensor infos of ``spec`` to ``writer``; returns the tensor count,
    the data bytes and the (plan, values) stream of the spec's layout."""
    if isinstance(spec, Deepseek4Spec):
        v4_plans = _gguf_deepseek4.tensor_plan(spec)
        _gguf_deepseek4.write_metadata(writer, spec)
        for p in v4_plans:
            writer.add_tensor_info(p.name, p.shape, p.dtype, p.nbytes)
        total = sum(p.nbytes for p in v4_plans)
        return len(v4_plans), total, _gguf_deepseek4.iter_tensors(spec, v4_plans)
    plans = _gguf_llama.tensor_plan(spec)
    _gguf_llama.write_metadata(writer, spec)
    for q in plans:
        writer.add_tensor_info(q.name, q.shape, q.dtype, q.nbytes)
    return len(plans), sum(q.nbytes for q in plans), _gguf_llama.iter_tensors(spec, plans)


def write_fixture(
    spec: AnySpec, path: str | os.PathLike[str], progress: ProgressFn | None = None
) -> Path:
    """Write the fixture to ``path`` (overwriting) and return it; tensors are streamed."""
    path = Path(path)
    log = logger.bind(fixture=spec.name)
    started = time.monotonic()

    writer = GGUFWriter(path, spec.arch)
    try:
        n_tensors, total, stream = _tensor_stream(spec, writer)
        log.debug("writing fixture to {} ({} tensors, {} data bytes)", path, n_tensors, total)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done = 0
        for p, values in stream:
            writer.write_tensor_data(values)
            done += p.nbytes
            if progress is not None:
                progress(done, total)
    finally:
        writer.close()
    elapsed = time.monotonic() - started
    log.debug("wrote {}: {} bytes in {:.1f} s", path, path.stat().st_size, elapsed)
    return path


def ensure_fixture(
    name: str,
    directory: str | os.PathLike[str] | None = None,
    progress: ProgressFn | None = None,
) -> Path:
    """Path of the named fixture, building it first if the cache lacks this exact spec.

    The file name carries :func:`spec_digest`, so a changed spec or generator builds a new
    file. Writing goes to a temporary file in the same directory, renamed into place, so a
    reader never sees a partial fixture and concurrent builders are harmless.
    """
    spec = lookup(name)
    directory = Path(directory) if directory is not None else default_fixtures_dir()
    target = directory / fixture_filename(spec)
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write_fixture(spec, tmp, progress)
        tmp.chmod(0o644)  # mkstemp creates 0600; fixtures are shared read-only data
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.bind(fixture=name).info("built fixture {}", target)
    return target


def lookup(name: str) -> AnySpec:
    """The spec of a public fixture name; ``ValueError`` naming the known ones otherwise."""
    try:
        return FIXTURES[name]
    except KeyError:
        raise ValueError(f"unknown fixture {name!r}; known: {', '.join(FIXTURES)}") from None


# --- bad-input helpers -------------------------------------------------------------------------


def write_truncated_copy(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], keep_fraction: float
) -> Path:
    """Copy the first ``keep_fraction`` (0 < f < 1) of ``src``'s bytes to ``dst``."""
    if not 0.0 < keep_fraction < 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1), got {keep_fraction}")
    data = Path(src).read_bytes()
    dst = Path(dst)
    dst.write_bytes(data[: int(len(data) * keep_fraction)])
    return dst


def write_corrupt_copy(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], kind: CorruptionKind = "magic"
) -> Path:
    """Copy ``src`` to ``dst`` with a damaged header; the rest is unchanged.

    - ``magic``: the 4-byte ``GGUF`` magic becomes ``XXXX``.
    - ``version``: the format version becomes 0xFFFF (unsupported).
    - ``tensor_count``: the tensor count becomes 2**62 (more than the file can hold).
    """
    data = bytearray(Path(src).read_bytes())
    if data[:4] != b"GGUF":
        raise ValueError(f"{src} is not a GGUF file")
    if kind == "magic":
        data[0:4] = b"XXXX"
    elif kind == "version":
        data[4:8] = (0xFFFF).to_bytes(4, "little")
    elif kind == "tensor_count":
        data[8:16] = (1 << 62).to_bytes(8, "little")
    else:
        raise ValueError(f"unknown corruption kind {kind!r}")
    dst = Path(dst)
    dst.write_bytes(bytes(data))
    return dst


# --- command line ------------------------------------------------------------------------------


_PROGRESS_MIN_BYTES = 16 * 1024 * 1024


def _print_progress(name: str) -> ProgressFn:
    """Progress lines on stderr every 10 %, for fixtures big enough to take a while."""
    last = [-1]

    def report(done: int, total: int) -> None:
        if total < _PROGRESS_MIN_BYTES:
            return
        step = 10 * done // total
        if step != last[0]:
            last[0] = step
            print(f"{name}: {10 * step:3d}% of {total / 1e6:.0f} MB", file=sys.stderr)

    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_engine.fixtures", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the fixtures")
    build = sub.add_parser("build", help="build (or find cached) fixtures; print their paths")
    build.add_argument("names", nargs="+", choices=sorted(FIXTURES), metavar="NAME")
    build.add_argument("--dir", type=Path, default=None, help="cache directory")
    args = parser.parse_args(argv)

    if args.command == "list":
        for spec in FIXTURES.values():
            if isinstance(spec, Deepseek4Spec):
                shape = (
                    f"H={spec.n_head}x{spec.head_dim} X={spec.n_expert}/{spec.n_expert_used} "
                    f"V={spec.n_vocab} f32"
                )
            else:
                shape = (
                    f"H={spec.n_head}/{spec.n_head_kv} FF={spec.n_ff} V={spec.n_vocab} "
                    f"{spec.matrix_dtype}"
                )
            print(
                f"{spec.name:<16} {spec.arch:<6} L={spec.n_layer} E={spec.n_embd} {shape} "
                f"~{estimated_bytes(spec) / 1e6:.1f} MB  {spec.description}"
            )
        return 0
    for name in args.names:
        print(ensure_fixture(name, args.dir, progress=_print_progress(name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
