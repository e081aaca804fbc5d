"""The cffi out-of-line API build of ``dgr_engine._native``.

The C ABI header ``native/include/dgr_shard.h`` is the single source of the declarations: its
preprocessor lines and C++ guards are stripped and the rest is handed to ``ffi.cdef``. The module
compiles ``native/src/dgr_shard.cpp`` and ``native/src/dgr_link.cpp`` and links the static,
patched libllama that ``native/build_llama.py`` builds (or reuses from its cache) from the
manifest and ``patches/``, and Monocypher (the native links' sealing), fetched from its own
manifest (``native/monocypher.manifest.json``, a pinned sha256) into ``.workspace/``. Called by
the package build (``setup.py``: ``cffi_modules``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from cffi import FFI

ROOT = Path(__file__).resolve().parent
HEADER = ROOT / "native" / "include" / "dgr_shard.h"
SOURCES = [  # relative: setuptools wants relative sources
    str(Path("native") / "src" / "dgr_shard.cpp"),
    str(Path("native") / "src" / "dgr_link.cpp"),
    str(Path("native") / "src" / "dgr_monocypher.cpp"),
    str(Path("native") / "src" / "dgr_sampler.cpp"),
]
MANIFEST = ROOT / "native" / "llama.cpp.manifest.json"
CRYPTO_MANIFEST = ROOT / "native" / "monocypher.manifest.json"
STATIC_LIBS = ("libllama.a", "libggml.a", "libggml-cpu.a", "libggml-base.a")


def cdef_from_header(text: str) -> str:
    """The declarations of the header, in the subset of C that ``ffi.cdef`` parses."""
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    keep = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            match = re.match(r"\s*#define\s+(DGR_[A-Z0-9_]+)\s+(\d+)\s*$", line)
            if match:
                keep.append(f"#define {match.group(1)} {match.group(2)}")
            continue
        keep.append(line)
    return "\n".join(keep)


def _build_llama() -> Any:
    """``native/build_llama.py`` as a module."""
    sys.path.insert(0, str(ROOT / "native"))
    try:
        import build_llama
    finally:
        sys.path.pop(0)
    return build_llama


def llama_prefix(build_llama: Any) -> Path:
    """The installed prefix of the patched static libllama (built on first use, then cached)."""
    override = os.environ.get("DGR_LLAMA_PREFIX")
    if override:
        return Path(override)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    return Path(build_llama.ensure_llama(log=log, sanitize=bool(os.environ.get("DGR_SANITIZE"))))


def crypto_source_dir(build_llama: Any) -> Path:
    """Monocypher's files (``monocypher.c``, ``monocypher.h``): fetched from the first source
    of its manifest with a pinned sha256 (cached with llama.cpp's downloads), verified and
    extracted into ``.workspace/`` on first use."""
    manifest = json.loads(CRYPTO_MANIFEST.read_text())
    source = next(s for s in manifest["sources"] if s.get("sha256"))
    version, digest = manifest["upstream"]["version"], source["sha256"][:12]
    dest = ROOT / ".workspace" / f"monocypher-{version}-{digest}"
    if all((dest / name).is_file() for name in manifest["files"]):
        return dest
    log = lambda msg: print(msg.replace("llama.cpp:", "monocypher:"), file=sys.stderr, flush=True)  # noqa: E731
    paths = build_llama.BuildPaths.default(ROOT)
    chosen, archive = build_llama.fetch_source(manifest, paths.downloads, log)
    build_llama.extract_source(archive, chosen["inner_path"], dest)
    missing = [name for name in manifest["files"] if not (dest / name).is_file()]
    if missing:
        raise build_llama.BuildError(f"{archive.name} has no {', '.join(missing)}")
    return dest


def make_ffibuilder() -> FFI:
    build_llama = _build_llama()
    prefix = llama_prefix(build_llama)
    crypto = crypto_source_dir(build_llama)
    manifest = json.loads(MANIFEST.read_text())
    commit = manifest["upstream"]["commit"]
    flags = ";".join(f"{k}={v}" for k, v in sorted(manifest["cmake"]["options"].items()))
    # the stacks the library is built with (the build key covers every patch), stated by every
    # worker's advert: the base stack's hash, and each family patch's by its architecture
    patches = build_llama.read_patches(ROOT / "patches")
    build_llama.check_family_patches(patches)
    stack = build_llama.patch_stack_sha256(build_llama.base_patches(patches)).hex()
    families = ";".join(
        f"{arch}={digest.hex()}"
        for arch, digest in build_llama.family_patch_sha256s(patches).items()
    )
    # DGR_SANITIZE=1: dgr_shard.cpp with the sanitizers, linked against their libllama build
    # (scripts/sanitize.sh; never the installed module)
    sanitize = build_llama.SANITIZE_FLAGS.split() + ["-g"] if os.environ.get("DGR_SANITIZE") else []
    ffibuilder = FFI()
    ffibuilder.cdef(cdef_from_header(HEADER.read_text()))
    ffibuilder.set_source(
        "dgr_engine._native",
        '#include "dgr_shard.h"\n',
        sources=SOURCES,
        source_extension=".cpp",
        include_dirs=[str(ROOT / "native" / "include"), str(prefix / "include"), str(crypto)],
        extra_objects=[str(prefix / "lib" / name) for name in STATIC_LIBS],
        libraries=["gomp", "pthread", "m", "stdc++"],
        # no floating-point contraction: the sampler's arithmetic is docs/sampling.md's, op by op
        extra_compile_args=[
            "-std=c++17",
            "-O2",
            "-ffp-contract=off",
            "-fvisibility=hidden",
            *sanitize,
        ],
        extra_link_args=sanitize,
        define_macros=[
            ("DGR_LLAMA_COMMIT", f'"{commit}"'),
            ("DGR_PATCH_STACK_SHA256", f'"{stack}"'),
            ("DGR_FAMILY_PATCHES", f'"{families}"'),
            ("DGR_BUILD_FLAGS", f'"{flags}"'),
        ],
    )
    return ffibuilder


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
