"""Builds llama.cpp's own peers from the pinned, patched source: ``llama-bench``,
``ggml-rpc-server`` (llama.cpp's RPC server; target ``ggml-rpc-server`` in ``tools/rpc`` at the
pinned commit), ``llama-batched-bench`` and ``llama-server`` (its OpenAI-compatible HTTP server,
without its web UI): what the benchmarks and ``dgr certify``'s ``speed.vs_rpc`` measure dgr
against (``benchmarks.serve_latency``: ``dgr serve`` against ``llama-server``).

The source, its sha256 check, the extraction and the patch stack are ``native/build_llama.py``'s
own functions (imported, not copied), so the peers run exactly the llama.cpp that dgr's engines
link. On top of that stack, the peers' own source copy takes ``patches/peers/`` (numbered the
same way): fixes to the peer tools themselves, never to the library (0001: llama-batched-bench
drains its asynchronous log before exit, so its rows are never lost). The CMake options are
the main build's (Release, static, ``GGML_NATIVE=OFF``, ``GGML_OPENMP=ON``) plus
:data:`PEER_OPTIONS` (``GGML_RPC=ON``, the tools and their common library on), and only
:data:`TARGETS` are built.

Cache: ``<cache>/peers/<key16>/bin/`` (``<cache>``: ``$DGR_CACHE_DIR`` or ``~/.cache/dgr``), the
key a sha256 over the main build's key, these options, the targets and :data:`PEER_BUILD_VERSION`.
Work happens in ``<repo>/.workspace/peers-src-<commit12>/`` and ``.workspace/peers-build-<key16>/``
(git-ignored; never the main build's ``llama.cpp-*``/``build-*`` directories, which that build
wipes), under ``fcntl`` locks, and the result is installed atomically (temp dir, then rename).
An installation without dgr's source checkout cannot build them
(:class:`~dgr_engine.tooling.llama_build.CheckoutMissing`).

A cold build took 740 s on this 2-core machine while other builds and tests shared it (12 min
of CPU: 143 compile steps, llama.cpp's common library included); cached, a call takes a second.
The command line is ``python -m benchmarks.peer_build [--force] [--print-prefix]``.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import attrs

from dgr_engine.tooling.llama_build import CHECKOUT, CheckoutMissing, build_module
from dgr_session.errors import DgrError

Log = Callable[[str], None]

PEER_BUILD_VERSION: Final = 1
"""Bump when this module changes how the peers are built without changing options or targets."""

TARGETS: Final = ("llama-bench", "ggml-rpc-server", "llama-batched-bench", "llama-server")
"""The CMake targets built (and the names of the executables installed)."""

PEER_PATCHES_DIR: Final = "peers"
"""``patches/<this>/``: the patches applied to the peers' source copy after the main stack."""

PEER_OPTIONS: Final = {
    "GGML_RPC": "ON",
    "LLAMA_BUILD_TOOLS": "ON",  # tools/llama-bench, tools/batched-bench, tools/rpc
    "LLAMA_BUILD_COMMON": "ON",  # llama-bench-impl and batched-bench link llama-common
    "LLAMA_BUILD_SERVER": "ON",  # tools/server (llama-server)
    "LLAMA_BUILD_UI": "OFF",  # the server's web UI is built with npm: none, an empty table
    "LLAMA_USE_PREBUILT_UI": "OFF",  # ...and never downloaded
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
}
"""What the peers need on top of the main build's options (which stay as they are: Release,
``BUILD_SHARED_LIBS=OFF``, ``GGML_NATIVE=OFF``, ``GGML_OPENMP=ON``, no curl/openssl)."""


def peer_options(manifest: dict[str, Any]) -> dict[str, str]:
    """The main build's CMake options with :data:`PEER_OPTIONS` applied."""
    return {**manifest["cmake"]["options"], **PEER_OPTIONS}


def peer_key(main_key: str, options: dict[str, str], peer_patches: list[Any]) -> str:
    """sha256 over the main build's key, the peers' options (sorted), their own patches, the
    targets and the version."""
    text = json.dumps(
        {
            "main_key": main_key,
            "peer_patches": [[p.name, p.sha256] for p in peer_patches],
            "options": dict(sorted(options.items())),
            "targets": list(TARGETS),
            "version": PEER_BUILD_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _is_cached(prefix: Path, key: str) -> bool:
    try:
        info = json.loads((prefix / "BUILD_INFO.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("key") != key:
        return False
    return all(os.access(prefix / "bin" / name, os.X_OK) for name in TARGETS)


def _inputs(build: ModuleType) -> tuple[Any, dict[str, Any], list[Any], str, dict[str, str], str]:
    """(paths, manifest, patches, main key, peer options, peer key); ``patches`` are the main
    stack followed by the peers' own (``patches/peers/``)."""
    paths = build.BuildPaths.default(repo_root=CHECKOUT)
    manifest_bytes = paths.manifest.read_bytes()
    manifest = build.parse_manifest(manifest_bytes)
    patches = build.read_patches(paths.patches_dir)
    main_key = build.compute_key(manifest_bytes, patches, paths.script.read_bytes())
    options = peer_options(manifest)
    peer_patches = build.read_patches(Path(paths.patches_dir) / PEER_PATCHES_DIR)
    key = peer_key(main_key, options, peer_patches)
    return paths, manifest, [*patches, *peer_patches], main_key, options, key


def peers_prefix() -> Path:
    """Where the peers of the current sources are (or would be) installed."""
    build = build_module()
    paths, *_, key = _inputs(build)
    return Path(paths.cache_dir) / "peers" / key[:16]


def ensure_peers(force: bool = False, log: Log = print) -> Path:
    """The prefix holding ``bin/<target>`` for every one of :data:`TARGETS`, built if needed."""
    build = build_module()
    paths, manifest, patches, main_key, options, key = _inputs(build)
    key16 = key[:16]
    root = Path(paths.cache_dir) / "peers"
    prefix = root / key16
    if not force and _is_cached(prefix, key):
        log(f"peers: cached build {key16} at {prefix}")
        return prefix
    with build.file_lock(root / f".{key16}.lock", log):
        if not force and _is_cached(prefix, key):  # built while we waited
            log(f"peers: cached build {key16} at {prefix}")
            return prefix
        workspace = Path(paths.workspace)
        with build.file_lock(workspace / ".peers-build.lock", log):
            _build(build, paths, manifest, patches, main_key, options, key, prefix, log)
    return prefix


def _build(
    build: ModuleType,
    paths: Any,
    manifest: dict[str, Any],
    patches: list[Any],
    main_key: str,
    options: dict[str, str],
    key: str,
    prefix: Path,
    log: Log,
) -> None:
    clock = build._Clock()
    began = time.monotonic()
    commit: str = manifest["upstream"]["commit"]
    key16 = key[:16]
    log(
        f"peers: [{clock}] building {key16} (llama.cpp {commit[:12]}, {len(patches)} patches, "
        f"targets {' '.join(TARGETS)})"
    )
    src, archive = build.fetch_source(manifest, paths.downloads, log)
    workspace = Path(paths.workspace)
    src_dir = workspace / f"peers-src-{commit[:12]}"
    count = build.extract_source(archive, src["inner_path"], src_dir)
    log(f"peers: [{clock}] extracted {count} entries of {archive.name} to {src_dir}")
    build.apply_patches(src_dir, patches, log)
    build_dir = workspace / f"peers-build-{key16}"
    for old in workspace.glob("peers-build-*"):  # earlier keys: never reused, only disk
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    build_dir.mkdir(parents=True)
    peer_manifest = {
        **manifest,
        "cmake": {"target": TARGETS[0], "extra_targets": list(TARGETS[1:]), "options": options},
    }
    facts = build.run_cmake(src_dir, build_dir, peer_manifest, log, clock)
    seconds = time.monotonic() - began
    root = prefix.parent
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".tmp-{key16}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    stage = Path(tempfile.mkdtemp(prefix=f".tmp-{key16}-", dir=root))
    try:
        (stage / "bin").mkdir()
        for name in TARGETS:
            shutil.copy2(build._find_one(build_dir / "bin", name), stage / "bin" / name)
        info = {
            "key": key,
            "main_key": main_key,
            "commit": commit,
            "source": {k: src.get(k) for k in ("kind", "filename", "sha256", "inner_path")},
            "patches": [{"name": p.name, "sha256": p.sha256} for p in patches],
            "targets": list(TARGETS),
            "cmake_options": options,
            "cmake_version": facts.get("cmake_version"),
            "generator": facts.get("generator"),
            "jobs": facts.get("jobs"),
            "build_seconds": round(seconds, 1),
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": platform.machine(),
        }
        (stage / "BUILD_INFO.json").write_text(json.dumps(info, indent=2) + "\n")
        stage.chmod(0o755)
        if prefix.exists():
            old = prefix.with_name(f".old-{key16}-{os.getpid()}")
            prefix.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        stage.rename(prefix)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    log(f"peers: [{clock}] done in {seconds:.0f} s: {prefix}")


def tool(name: str, log: Log = print) -> Path:
    """The path of one peer executable (built if needed)."""
    if name not in TARGETS:
        raise ValueError(f"{name!r} is not one of {', '.join(TARGETS)}")
    return ensure_peers(log=log) / "bin" / name


def build_seconds(prefix: Path) -> float | None:
    """How long the build at ``prefix`` took (from its BUILD_INFO.json)."""
    try:
        return float(json.loads((prefix / "BUILD_INFO.json").read_text())["build_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached_prefix() -> Path | None:
    """The prefix of the peers of the current sources when they are built and cached, else
    ``None`` (nothing is built; a second at most)."""
    build = build_module()
    paths, *_, key = _inputs(build)
    prefix = Path(paths.cache_dir) / "peers" / key[:16]
    return prefix if _is_cached(prefix, key) else None


BUILD_COMMAND: Final = "dgr certify --rpc build (or: python -m benchmarks.peer_build)"
"""What builds the peers, as a reason that they are missing names it."""


class PeerUse(enum.StrEnum):
    """When ``dgr certify`` runs llama.cpp RPC beside the route (``--rpc``)."""

    AUTO = "auto"
    """When the peers are cached, or when the evidence is real-model or above (then built
    first if missing)."""
    BUILD = "build"
    """Always: built first if missing; a failed build refuses the run."""
    OFF = "off"
    """Never (quick demo certifications): ``speed.vs_rpc`` is not measured."""


class PeersUnavailable(DgrError, RuntimeError):
    """The peers were required (``--rpc build``) and cannot be had: no source checkout, or the
    build failed. Nothing was measured."""


@attrs.frozen
class Peers:
    """Where the peers are, or why there are none."""

    prefix: Path | None
    """The prefix holding ``bin/<target>``; ``None`` when not available."""
    reason: str = ""
    """Why ``prefix`` is ``None`` (empty when it is not)."""


def find_peers(use: PeerUse, *, build_when_missing: bool, log: Log) -> Peers:
    """The peers as ``use`` asks: :attr:`PeerUse.AUTO` takes the cached build, and builds a
    missing one only when ``build_when_missing`` (progress on ``log``; a cold build is about 12
    minutes on 2 cores); a failure is the reason. :attr:`PeerUse.BUILD` builds when missing
    and raises :class:`PeersUnavailable` when it cannot."""
    if use is PeerUse.OFF:
        return Peers(None, "dgr certify --rpc off: llama.cpp RPC was not run")
    required = use is PeerUse.BUILD
    try:
        failures: tuple[type[BaseException], ...] = (build_module().BuildError, OSError)
        prefix = cached_prefix()
    except CheckoutMissing as exc:
        if required:
            raise PeersUnavailable(f"--rpc build: {exc}") from exc
        return Peers(None, f"llama.cpp's peers cannot be built here: {exc}")
    if prefix is not None:
        return Peers(prefix)
    if not (required or build_when_missing):
        return Peers(
            None,
            "llama.cpp's peers (llama-bench, ggml-rpc-server) are not built in this workspace "
            f"and fixture evidence does not build them: {BUILD_COMMAND} builds them (about "
            "12 min on 2 cores), then certify measures RPC",
        )
    log("peers: llama-bench and ggml-rpc-server are not built yet: building them now (a cold")
    log("peers: build takes about 12 minutes on 2 cores; cached in <cache>/peers after)")
    try:
        return Peers(ensure_peers(log=log))
    except failures as exc:  # the build script's BuildError, a full disk
        if required:
            raise PeersUnavailable(f"--rpc build: building the peers failed: {exc}") from exc
        return Peers(None, f"building llama.cpp's peers failed: {exc}")
