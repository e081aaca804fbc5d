#!/usr/bin/env python3
"""Fetch, patch and build the pinned llama.cpp as static libraries (standard library only).

Usage::

    python native/build_llama.py [--force] [--print-prefix] [--cache-dir DIR]

or, from Python, ``ensure_llama(force=False, log=print) -> Path``.

Steps (see native/llama.cpp.manifest.json and shared/design/llama-cpp-notes.md):

1. Build key = sha256 over the manifest bytes, every ``patches/NNNN-*.patch`` (numeric order,
   name + bytes) and this script. The C ABI in native/src is compiled separately (cffi) and
   is not part of the key.
2. Prefix = ``<cache>/llama/<key[:16]>/`` with ``cache`` = ``$DGR_CACHE_DIR`` or
   ``~/.cache/dgr``. If it exists and its ``BUILD_INFO.json`` holds the same key, it is reused.
3. Otherwise: fetch the first source with a pinned sha256 (cached under ``<cache>/downloads``),
   verify it, extract only its llama.cpp tree into ``<repo>/.workspace/llama.cpp-<commit12>/``
   (fresh each build), apply the patches with ``git apply``, build target ``llama`` (and
   ``cmake.extra_targets``) with CMake (+ Ninja when available) in
   ``<repo>/.workspace/build-<key16>/``, link ``outputs.tools`` (``llama-gguf-split``) from the
   same tree against those libraries, and install ``lib/`` (static libs), ``bin/`` (tools),
   ``include/`` (public headers) and ``BUILD_INFO.json`` into the prefix atomically (build in a
   temp dir, then rename), all under ``fcntl.flock`` locks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Log = Callable[[str], None]

SCRIPT_PATH = Path(__file__).resolve()
REPO_ROOT = SCRIPT_PATH.parent.parent
MANIFEST_NAME = "llama.cpp.manifest.json"
PATCH_RE = re.compile(r"^(\d+)-.+\.patch$")
FAMILY_RE = re.compile(r"^Family:(.*)$")
"""A family patch's header line naming the one architecture it covers (``Family: gemma3``)."""
ARCH_RE = re.compile(r"^[a-z][a-z0-9_-]*$")
NINJA_PROGRESS_RE = re.compile(r"^\[(\d+)/(\d+)\]")
MAKE_PROGRESS_RE = re.compile(r"^\[\s*(\d+)%\]")
_CHUNK = 1 << 20
# Variables that would point `git apply` at some other repository.
_GIT_ENV_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_PREFIX")


class BuildError(RuntimeError):
    """Any failure to fetch, verify, patch, build or install llama.cpp."""


class ChecksumError(BuildError):
    """A downloaded or cached archive does not have the pinned sha256."""


class PatchError(BuildError):
    """A patch from patches/ does not apply to the pristine source tree."""


# --------------------------------------------------------------------------------------------
# Paths and inputs
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$DGR_CACHE_DIR`` or ``~/.cache/dgr``."""
    env = os.environ.get("DGR_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dgr"


@dataclass(frozen=True)
class BuildPaths:
    """Every location the build reads or writes; tests point these at temporary dirs."""

    repo_root: Path
    manifest: Path
    patches_dir: Path
    cache_dir: Path
    workspace: Path
    script: Path

    @classmethod
    def default(cls, repo_root: Path | None = None, cache_dir: Path | None = None) -> BuildPaths:
        root = (repo_root or REPO_ROOT).resolve()
        return cls(
            repo_root=root,
            manifest=root / "native" / MANIFEST_NAME,
            patches_dir=root / "patches",
            cache_dir=(cache_dir or default_cache_dir()).resolve(),
            workspace=root / ".workspace",
            script=SCRIPT_PATH,
        )

    @property
    def downloads(self) -> Path:
        return self.cache_dir / "downloads"

    @property
    def llama_root(self) -> Path:
        return self.cache_dir / "llama"


@dataclass(frozen=True)
class PatchFile:
    """A snapshot of one patch: the bytes hashed into the key are the bytes applied."""

    name: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def header(self) -> list[str]:
        """The patch's description: its lines before the first ``diff``/``---`` line."""
        lines = []
        for line in self.data.decode(errors="replace").splitlines():
            if line.startswith(("diff ", "--- ")):
                break
            lines.append(line)
        return lines

    @property
    def family(self) -> str | None:
        """The architecture a family patch covers (its header's ``Family:`` line); ``None`` for a
        patch of the base stack."""
        for line in self.header:
            match = FAMILY_RE.match(line)
            if match:
                return match.group(1).strip()
        return None

    @property
    def touched_paths(self) -> list[str]:
        """Every path the patch changes (its ``---``/``+++`` file headers, without the ``a/``,
        ``b/`` prefixes and ``/dev/null``), in order, each once."""
        paths: list[str] = []
        lines = self.data.decode(errors="replace").splitlines()
        for previous, line in zip(lines, lines[1:], strict=False):
            if not (previous.startswith("--- ") and line.startswith("+++ ")):
                continue
            for header in (previous[4:], line[4:]):
                path = header.split("\t", 1)[0].strip()
                if path != "/dev/null":
                    path = path.removeprefix("a/").removeprefix("b/")
                    if path not in paths:
                        paths.append(path)
        return paths


def parse_manifest(data: bytes) -> dict[str, Any]:
    """Parse and sanity-check the manifest."""
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise BuildError(f"{MANIFEST_NAME} is not valid JSON: {exc}") from exc
    try:
        commit = manifest["upstream"]["commit"]
        sources = manifest["sources"]
        target = manifest["cmake"]["target"]
        options = manifest["cmake"]["options"]
        libs = manifest["outputs"]["libs"]
        headers = manifest["outputs"]["headers"]
    except (KeyError, TypeError) as exc:
        raise BuildError(f"{MANIFEST_NAME} lacks a required field: {exc}") from exc
    if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit)):
        raise BuildError(f"{MANIFEST_NAME}: upstream.commit must be 40 hex digits, got {commit!r}")
    if not isinstance(sources, list) or not sources:
        raise BuildError(f"{MANIFEST_NAME}: sources must be a non-empty list")
    for src in sources:
        missing = [k for k in ("kind", "filename", "inner_path", "sha256") if k not in src]
        if missing:
            raise BuildError(f"{MANIFEST_NAME}: a source lacks {', '.join(missing)}: {src}")
    if not isinstance(target, str) or not isinstance(options, dict):
        raise BuildError(f"{MANIFEST_NAME}: cmake.target must be a string, options an object")
    if not libs or not headers:
        raise BuildError(f"{MANIFEST_NAME}: outputs.libs and outputs.headers must be non-empty")
    return dict(manifest)


def list_patches(patches_dir: Path) -> list[Path]:
    """``patches_dir/NNNN-*.patch`` sorted by number (then name).

    A ``*.patch`` file that does not follow the naming scheme is an error rather than being
    silently left out of the build.
    """
    if not patches_dir.is_dir():
        return []
    found: list[tuple[int, str, Path]] = []
    misnamed: list[str] = []
    for path in patches_dir.iterdir():
        if not path.name.endswith(".patch"):
            continue
        match = PATCH_RE.match(path.name)
        if match is None or not path.is_file():
            misnamed.append(path.name)
            continue
        found.append((int(match.group(1)), path.name, path))
    if misnamed:
        raise BuildError(
            f"{patches_dir}: patch file(s) not named NNNN-description.patch: "
            + ", ".join(sorted(misnamed))
        )
    found.sort(key=lambda item: (item[0], item[1]))
    return [path for _, _, path in found]


def read_patches(patches_dir: Path) -> list[PatchFile]:
    return [PatchFile(p.name, p.read_bytes()) for p in list_patches(patches_dir)]


def patch_stack_sha256(patches: Sequence[PatchFile]) -> bytes:
    """A patch stack's identity: SHA-256 over the patches in order, each its name, NUL, and the
    SHA-256 of its bytes. Empty for no patches. A worker's advert states that of the base stack
    (:func:`base_patches`), and of its architecture's family patches
    (:func:`family_patch_sha256s`) apart."""
    if not patches:
        return b""
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode() + b"\0" + hashlib.sha256(patch.data).digest())
    return digest.digest()


def family_builder_paths(arch: str) -> tuple[str, ...]:
    """The files a family patch of ``arch`` may change: that architecture's own graph builder."""
    return (f"src/models/{arch}.cpp",)


def check_family_patches(patches: Sequence[PatchFile]) -> None:
    """:class:`PatchError` naming the patch when a family patch names no valid architecture or
    changes anything but its architecture's own builder (so it cannot change another
    architecture's bits, nor the base stack's)."""
    for patch in patches:
        arch = patch.family
        if arch is None:
            continue
        if not ARCH_RE.match(arch):
            raise PatchError(f"patch {patch.name}: 'Family: {arch}' names no architecture")
        allowed = family_builder_paths(arch)
        touched = patch.touched_paths
        if not touched:
            raise PatchError(f"patch {patch.name} (family {arch}) changes no file")
        for path in touched:
            if path not in allowed:
                raise PatchError(
                    f"patch {patch.name} (family {arch}) changes {path}: a family patch may "
                    f"change only {', '.join(allowed)}"
                )


def base_patches(patches: Sequence[PatchFile]) -> list[PatchFile]:
    """The base stack: the patches without a ``Family:`` line, in order."""
    return [p for p in patches if p.family is None]


def family_patch_sha256s(patches: Sequence[PatchFile]) -> dict[str, bytes]:
    """Each family's identity, by architecture (sorted): :func:`patch_stack_sha256` over that
    family's patches in order."""
    families: dict[str, list[PatchFile]] = {}
    for patch in patches:
        if patch.family is not None:
            families.setdefault(patch.family, []).append(patch)
    return {arch: patch_stack_sha256(families[arch]) for arch in sorted(families)}


SANITIZE_FLAGS = (
    "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
)
"""Compile and link flags of the sanitizer build (``--sanitize``): AddressSanitizer and
UndefinedBehaviorSanitizer, undefined behaviour fatal."""


def sanitized(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's build with the sanitizers on: the same source, patches and options, plus
    :data:`SANITIZE_FLAGS` for C, C++ and the link, with debug line info."""
    options = dict(manifest["cmake"]["options"])
    flags = f"{SANITIZE_FLAGS} -g"
    for key in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
        options[key] = f"{options.get(key, '')} {flags}".strip()
    for key in ("CMAKE_EXE_LINKER_FLAGS", "CMAKE_SHARED_LINKER_FLAGS"):
        options[key] = f"{options.get(key, '')} {SANITIZE_FLAGS}".strip()
    outputs = {k: v for k, v in manifest["outputs"].items() if k != "tools"}  # library only
    return {**manifest, "cmake": {**manifest["cmake"], "options": options}, "outputs": outputs}


def compute_key(manifest_bytes: bytes, patches: Sequence[PatchFile], script_bytes: bytes) -> str:
    """sha256 over the manifest, each patch (name + bytes, in order) and the build script."""
    h = hashlib.sha256()

    def feed(tag: str, data: bytes) -> None:
        h.update(f"{tag}\0{len(data)}\0".encode())
        h.update(data)

    feed("manifest", manifest_bytes)
    for patch in patches:
        feed(f"patch:{patch.name}", patch.data)
    feed("build_llama.py", script_bytes)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def __str__(self) -> str:
        return f"{time.monotonic() - self.start:6.1f}s"


@contextlib.contextmanager
def file_lock(path: Path, log: Log) -> Iterator[None]:
    """Exclusive ``fcntl.flock`` on ``path`` (created if needed); says so when it has to wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"llama.cpp: waiting for lock {path} (another build holds it)")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str, what: str) -> None:
    """Raise :class:`ChecksumError` (after deleting ``path``) unless its sha256 is ``expected``."""
    actual = sha256_file(path)
    if actual != expected.lower():
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"sha256 mismatch for {what} ({path}): expected {expected}, got {actual}. "
            "The file was deleted; refusing to build from an unverified archive."
        )


def _find_tool(name: str) -> str | None:
    """``name`` from this interpreter's environment (pip's cmake/ninja) or else from PATH."""
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    if name == "cmake" and importlib.util.find_spec("cmake") is not None:
        import cmake  # type: ignore[import-not-found,unused-ignore]

        candidate = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if candidate.is_file():
            return str(candidate)
    return None


def run_streamed(cmd: Sequence[str], cwd: Path, log: Log, what: str, clock: _Clock) -> None:
    """Run ``cmd``; report Ninja ``[n/N]`` / Make ``[ p%]`` progress about every 10 %.

    On failure raise :class:`BuildError` carrying the last lines of output.
    """
    env = dict(os.environ, NINJA_STATUS="[%f/%t] ")
    tail: deque[str] = deque(maxlen=60)
    next_pct = 10.0
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    )
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            pct: float | None = None
            label = ""
            if m := NINJA_PROGRESS_RE.match(line):
                done, total = int(m.group(1)), int(m.group(2))
                pct = 100.0 * done / max(total, 1)
                label = f"[{done}/{total}]"
            elif m := MAKE_PROGRESS_RE.match(line):
                pct = float(m.group(1))
                label = f"[{pct:3.0f}%]"
            if pct is not None and pct >= next_pct:
                log(f"llama.cpp: [{clock}]   {what} {label} {pct:3.0f}%")
                next_pct = (pct // 10 + 1) * 10
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        raise BuildError(
            f"{what} failed (exit {rc}): {' '.join(cmd)}\n--- last output lines ---\n"
            + "\n".join(tail)
        )


# --------------------------------------------------------------------------------------------
# Fetch
# --------------------------------------------------------------------------------------------


def _download_url(url: str, dest: Path, log: Log) -> None:
    log(f"llama.cpp: downloading {url}")
    req = urllib.request.Request(url, headers={"User-Agent": "dgr-build-llama"})
    with urllib.request.urlopen(req, timeout=120) as resp, open(dest, "wb") as out:
        total = int(resp.headers.get("Content-Length") or 0)
        done = 0
        next_pct = 25
        while chunk := resp.read(_CHUNK):
            out.write(chunk)
            done += len(chunk)
            if total and 100 * done >= next_pct * total:
                log(f"llama.cpp:   {done / 1e6:.1f} / {total / 1e6:.1f} MB")
                next_pct += 25


def _download_pypi_json(src: dict[str, Any], tmpdir: Path, log: Log) -> Path:
    """Find the sdist's URL with PyPI's JSON API and download it with urllib."""
    api = f"https://pypi.org/pypi/{src['package']}/{src['version']}/json"
    log(f"llama.cpp: asking {api}")
    with urllib.request.urlopen(api, timeout=60) as resp:
        meta = json.load(resp)
    for entry in meta.get("urls", []):
        if entry.get("filename") == src["filename"]:
            listed = entry.get("digests", {}).get("sha256")
            if listed and listed != src["sha256"]:
                raise ChecksumError(
                    f"PyPI lists sha256 {listed} for {src['filename']}, the manifest pins "
                    f"{src['sha256']}; refusing to download it"
                )
            dest = tmpdir / str(src["filename"])
            _download_url(entry["url"], dest, log)
            return dest
    raise BuildError(f"PyPI has no file {src['filename']} for {src['package']}=={src['version']}")


def _download_pypi_sdist(src: dict[str, Any], tmpdir: Path, log: Log) -> Path:
    """``pip download`` the sdist with this interpreter; PyPI's JSON API as a last resort.

    pip prepares the sdist's metadata, which needs its build backend (scikit-build-core).
    With ``--no-build-isolation`` that is the one importable here (seconds). Without it,
    pip sets up an isolated build environment; ``--no-binary <package>`` (not ``:all:``)
    keeps that environment on wheels, whereas ``:all:`` would compile cmake from source.
    """
    spec = f"{src['package']}=={src['version']}"
    dest = tmpdir / str(src["filename"])
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    attempts: list[tuple[str, list[str]]] = []
    if importlib.util.find_spec("pip") is None:
        log("llama.cpp: pip is not importable here; using PyPI's JSON API")
    else:
        if importlib.util.find_spec("scikit_build_core") is not None:
            attempts.append(
                ("--no-build-isolation", ["--no-binary", ":all:", "--no-build-isolation"])
            )
        else:
            log("llama.cpp: scikit-build-core is not importable here; pip will isolate the build")
        attempts.append(("build isolation", ["--no-binary", src["package"]]))
    for label, extra in attempts:
        log(f"llama.cpp: pip download {spec} ({label})")
        cmd = [*base, *extra, spec, "-d", str(tmpdir)]
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        if res.returncode == 0 and dest.is_file():
            return dest
        log(
            f"llama.cpp: pip download ({label}) failed (exit {res.returncode}):\n"
            + "\n".join((res.stdout + res.stderr).strip().splitlines()[-10:])
        )
    return _download_pypi_json(src, tmpdir, log)


def download_source(src: dict[str, Any], tmpdir: Path, log: Log) -> Path:
    """Download one manifest source into ``tmpdir``; returns the file (not yet verified)."""
    if src["kind"] == "pypi-sdist":
        return _download_pypi_sdist(src, tmpdir, log)
    if src["kind"] == "url":
        dest = tmpdir / str(src["filename"])
        _download_url(src["url"], dest, log)
        return dest
    raise BuildError(f"unknown source kind {src['kind']!r}")


def fetch_source(
    manifest: dict[str, Any], downloads: Path, log: Log
) -> tuple[dict[str, Any], Path]:
    """Return ``(source, archive)`` for the first source with a pinned sha256, verified.

    A cached archive in ``downloads`` is used first; otherwise sources are downloaded in
    manifest order. A checksum mismatch is never skipped over: it raises at once.
    """
    pinned = [s for s in manifest["sources"] if s.get("sha256")]
    for src in pinned:
        cached = downloads / src["filename"]
        if cached.is_file():
            verify_sha256(cached, src["sha256"], f"cached {src['filename']}")
            return src, cached
    for src in manifest["sources"]:
        if not src.get("sha256"):
            log(
                f"llama.cpp: source {src['filename']} has no pinned sha256; skipped "
                "(verify it on first use, then pin it in the manifest)"
            )
    if not pinned:
        raise BuildError("the manifest has no source with a pinned sha256")
    downloads.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    for src in pinned:
        with tempfile.TemporaryDirectory(prefix=".download-", dir=downloads) as tmp:
            try:
                got = download_source(src, Path(tmp), log)
            except ChecksumError:
                raise
            except (BuildError, OSError, ValueError, KeyError) as exc:
                failures.append(f"{src['filename']}: {exc}")
                log(f"llama.cpp: could not fetch {src['filename']}: {exc}")
                continue
            verify_sha256(got, src["sha256"], f"downloaded {src['filename']}")
            dest = downloads / src["filename"]
            os.replace(got, dest)
            log(f"llama.cpp: verified sha256 {src['sha256'][:16]}..., cached at {dest}")
            return src, dest
    raise BuildError("could not fetch llama.cpp from any source:\n  " + "\n  ".join(failures))


# --------------------------------------------------------------------------------------------
# Extract and patch
# --------------------------------------------------------------------------------------------


def extract_source(archive: Path, inner_path: str, dest: Path) -> int:
    """Extract only ``inner_path`` of ``archive`` into a fresh ``dest``; returns member count.

    The leading ``inner_path`` is stripped, a top-level ``.git`` (the sdist's submodule link)
    is dropped, and ``tarfile``'s ``"data"`` filter refuses anything unsafe.
    """
    if not hasattr(tarfile, "data_filter"):
        raise BuildError("tarfile extraction filters are needed (Python >= 3.11.4)")
    prefix = inner_path.strip("/") + "/"
    partial = dest.with_name(dest.name + ".partial")
    for stale in (dest, partial):
        if stale.exists():
            shutil.rmtree(stale)
    partial.mkdir(parents=True)
    try:
        with tarfile.open(archive, "r:*") as tf:
            members: list[tarfile.TarInfo] = []
            for member in tf.getmembers():
                name = member.name.removeprefix("./")
                if not name.startswith(prefix):
                    continue
                rel = name[len(prefix) :]
                if not rel or rel == ".git" or rel.startswith(".git/"):
                    continue
                changes: dict[str, Any] = {"name": rel}
                if member.islnk():
                    changes["linkname"] = member.linkname.removeprefix("./").removeprefix(prefix)
                members.append(member.replace(**changes, deep=False))
            if not members:
                raise BuildError(f"{archive.name} holds nothing under {inner_path}/")
            try:
                tf.extractall(partial, members=members, filter="data")
            except tarfile.FilterError as exc:
                raise BuildError(f"{archive.name}: unsafe archive member refused: {exc}") from exc
        partial.rename(dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return len(members)


def apply_patches(src_dir: Path, patches: Sequence[PatchFile], log: Log) -> None:
    """Apply ``patches`` in order with ``git apply`` (checked first); fail loudly by name.

    ``GIT_CEILING_DIRECTORIES`` keeps git from discovering an enclosing repository (the
    workspace lives inside the dgr checkout): inside one, ``git apply`` would treat paths as
    relative to that repository and silently skip them, still exiting 0.
    """
    if not patches:
        log("llama.cpp: no patches in patches/")
        return
    git = shutil.which("git")
    if git is None:
        raise BuildError("git is needed to apply patches/ (git apply) but is not on PATH")
    env = {k: v for k, v in os.environ.items() if k not in _GIT_ENV_VARS}
    env["GIT_CEILING_DIRECTORIES"] = str(src_dir.resolve().parent)
    applied: list[str] = []
    for patch in patches:
        for check in (True, False):
            cmd = [git, "apply", "--verbose", "--whitespace=nowarn"]
            if check:
                cmd.append("--check")
            res = subprocess.run(cmd, cwd=src_dir, input=patch.data, capture_output=True, env=env)
            out = (res.stdout + res.stderr).decode(errors="replace").strip()
            if res.returncode != 0 or "Skipped patch" in out:
                after = f" (after {', '.join(applied)})" if applied else ""
                stage = "does not apply" if check else "failed to apply"
                raise PatchError(
                    f"patch {patch.name} {stage} to the pristine llama.cpp tree{after}.\n"
                    f"--- git apply output ({src_dir}) ---\n{out}"
                )
        applied.append(patch.name)
        log(f"llama.cpp: applied {patch.name}")


# --------------------------------------------------------------------------------------------
# Build and install
# --------------------------------------------------------------------------------------------


def run_cmake(
    src_dir: Path, build_dir: Path, manifest: dict[str, Any], log: Log, clock: _Clock
) -> dict[str, Any]:
    """Configure and build the manifest's target; returns facts for BUILD_INFO.json."""
    cmake = _find_tool("cmake")
    if cmake is None:
        raise BuildError("cmake not found (neither in this Python environment nor on PATH)")
    ninja = _find_tool("ninja")
    version_out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    cmake_version = version_out.split("\n", 1)[0].removeprefix("cmake version ").strip()
    options: dict[str, str] = manifest["cmake"]["options"]
    configure = [cmake, "-S", str(src_dir), "-B", str(build_dir)]
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    configure += [f"-D{k}={v}" for k, v in options.items()]
    generator = "Ninja" if ninja else "default"
    log(f"llama.cpp: [{clock}] configure (cmake {cmake_version}, {generator})")
    res = subprocess.run(configure, capture_output=True, text=True, errors="replace")
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-60:])
        raise BuildError(f"cmake configure failed (exit {res.returncode}):\n{tail}")
    jobs = os.cpu_count() or 1
    targets = [manifest["cmake"]["target"], *manifest["cmake"].get("extra_targets", [])]
    log(f"llama.cpp: [{clock}] build targets {' '.join(targets)} with {jobs} jobs")
    build = [cmake, "--build", str(build_dir), "--target", *targets, "-j", str(jobs)]
    run_streamed(build, build_dir, log, "build", clock)
    return {"cmake": cmake, "cmake_version": cmake_version, "generator": generator, "jobs": jobs}


def _cxx_compiler(build_dir: Path) -> str:
    """The C++ compiler CMake chose for this build (from its cache)."""
    try:
        for line in (build_dir / "CMakeCache.txt").read_text().splitlines():
            if line.startswith("CMAKE_CXX_COMPILER:"):
                return line.split("=", 1)[1]
    except OSError:
        pass
    found = shutil.which("c++") or shutil.which("g++")
    if found is None:
        raise BuildError("no C++ compiler found to link the tools")
    return found


def build_tools(
    stage: Path, src_dir: Path, build_dir: Path, manifest: dict[str, Any], log: Log, clock: _Clock
) -> list[str]:
    """Compiles each of ``outputs.tools`` (a llama.cpp command-line tool whose only needs are
    libllama and the build-info library) from the patched tree into ``stage/bin``: one source
    file, linked with the static libraries just built. Returns the tool names."""
    tools: dict[str, dict[str, Any]] = manifest["outputs"].get("tools", {})
    if not tools:
        return []
    bin_dir = stage / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    cxx = _cxx_compiler(build_dir)
    includes = [f"-I{src_dir / d}" for d in ("include", "ggml/include", "common")]
    libs = [str(stage / "lib" / name) for name in manifest["outputs"]["libs"]]
    for name, tool in tools.items():
        extra = [str(_find_one(build_dir, lib)) for lib in tool.get("libs", [])]
        sources = [str(src_dir / s) for s in tool["sources"]]
        out = bin_dir / name
        command = [cxx, "-O2", "-std=c++17", *includes, *sources, "-o", str(out), *extra, *libs]
        command += ["-fopenmp", "-lpthread", "-lm"]
        log(f"llama.cpp: [{clock}] link tool {name}")
        res = subprocess.run(command, capture_output=True, text=True, errors="replace")
        if res.returncode != 0:
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-40:])
            raise BuildError(f"building tool {name} failed (exit {res.returncode}):\n{tail}")
    return sorted(tools)


def _find_one(root: Path, name: str) -> Path:
    hits = sorted(p for p in root.rglob(name) if p.is_file())
    if len(hits) != 1:
        where = ", ".join(str(p) for p in hits) or "nowhere"
        raise BuildError(f"expected exactly one {name} under {root}, found {where}")
    return hits[0]


def install_into(stage: Path, src_dir: Path, build_dir: Path, manifest: dict[str, Any]) -> None:
    """Copy the static libs and public headers into ``stage/lib`` and ``stage/include``."""
    lib_dir, inc_dir = stage / "lib", stage / "include"
    lib_dir.mkdir(parents=True, exist_ok=True)
    inc_dir.mkdir(parents=True, exist_ok=True)
    for name in manifest["outputs"]["libs"]:
        shutil.copy2(_find_one(build_dir, name), lib_dir / name)
    copied: dict[str, Path] = {}
    for pattern in manifest["outputs"]["headers"]:
        for header in sorted(src_dir.glob(pattern)):
            if not header.is_file():
                continue
            previous = copied.get(header.name)
            if previous is not None and previous.read_bytes() != header.read_bytes():
                raise BuildError(f"two different headers named {header.name}: {previous}, {header}")
            shutil.copy2(header, inc_dir / header.name)
            copied[header.name] = header
    for required in ("llama.h", "ggml.h"):
        if required not in copied:
            raise BuildError(f"{required} not found in the source tree ({src_dir})")


def is_cached(prefix: Path, key: str, manifest: dict[str, Any]) -> bool:
    """True when ``prefix`` holds a complete build for ``key``."""
    try:
        info = json.loads((prefix / "BUILD_INFO.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("key") != key:
        return False
    libs = manifest["outputs"]["libs"]
    tools = manifest["outputs"].get("tools", {})
    return (
        all((prefix / "lib" / n).is_file() for n in libs)
        and all((prefix / "bin" / n).is_file() for n in tools)
        and (prefix / "include").is_dir()
    )


def build_prefix(
    paths: BuildPaths,
    manifest: dict[str, Any],
    patches: Sequence[PatchFile],
    key: str,
    prefix: Path,
    log: Log,
) -> None:
    """Fetch, extract, patch, build and install into ``prefix`` (caller holds the locks)."""
    clock = _Clock()
    commit: str = manifest["upstream"]["commit"]
    key16 = key[:16]
    log(f"llama.cpp: [{clock}] building {key16} (commit {commit[:12]}, {len(patches)} patches)")

    src, archive = fetch_source(manifest, paths.downloads, log)
    log(f"llama.cpp: [{clock}] source {archive.name} (sha256 verified)")

    src_dir = paths.workspace / f"llama.cpp-{commit[:12]}"
    count = extract_source(archive, src["inner_path"], src_dir)
    log(f"llama.cpp: [{clock}] extracted {count} entries to {src_dir}")

    apply_patches(src_dir, patches, log)

    build_dir = paths.workspace / f"build-{key16}"
    for old in paths.workspace.glob("build-*"):  # earlier keys: never reused, only disk
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    build_dir.mkdir(parents=True)
    facts = run_cmake(src_dir, build_dir, manifest, log, clock)
    build_seconds = time.monotonic() - clock.start
    log(f"llama.cpp: [{clock}] built; installing into {prefix}")

    paths.llama_root.mkdir(parents=True, exist_ok=True)
    for stale in paths.llama_root.glob(f".tmp-{key16}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    stage = Path(tempfile.mkdtemp(prefix=f".tmp-{key16}-", dir=paths.llama_root))
    try:
        install_into(stage, src_dir, build_dir, manifest)
        tools = build_tools(stage, src_dir, build_dir, manifest, log, clock)
        info = {
            "key": key,
            "commit": commit,
            "source": {k: src.get(k) for k in ("kind", "filename", "sha256", "inner_path")},
            "patches": [{"name": p.name, "sha256": p.sha256} for p in patches],
            "cmake_target": manifest["cmake"]["target"],
            "cmake_options": manifest["cmake"]["options"],
            "cmake_version": facts.get("cmake_version"),
            "generator": facts.get("generator"),
            "jobs": facts.get("jobs"),
            "libs": sorted(p.name for p in (stage / "lib").iterdir()),
            "tools": tools,
            "headers": sorted(p.name for p in (stage / "include").iterdir()),
            "build_seconds": round(build_seconds, 1),
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
    log(f"llama.cpp: [{clock}] done: {prefix}")


def ensure_llama(
    force: bool = False,
    log: Log = print,
    paths: BuildPaths | None = None,
    *,
    sanitize: bool = False,
) -> Path:
    """Return the prefix of a build of the pinned, patched llama.cpp, building it if needed;
    ``sanitize``: the ASan + UBSan build (its own key and prefix, ``asan-<key>``)."""
    paths = paths or BuildPaths.default()
    try:
        manifest_bytes = paths.manifest.read_bytes()
    except OSError as exc:
        raise BuildError(f"cannot read the manifest {paths.manifest}: {exc}") from exc
    manifest = parse_manifest(manifest_bytes)
    patches = read_patches(paths.patches_dir)
    check_family_patches(patches)
    if sanitize:
        manifest = sanitized(manifest)
        manifest_bytes += f"\0sanitize:{SANITIZE_FLAGS}".encode()
    key = compute_key(manifest_bytes, patches, paths.script.read_bytes())
    key16 = key[:16]
    prefix = paths.llama_root / (f"asan-{key16}" if sanitize else key16)
    if not force and is_cached(prefix, key, manifest):
        log(f"llama.cpp: cached build {key16} at {prefix}")
        return prefix
    with file_lock(paths.llama_root / f".{key16}.lock", log):
        if not force and is_cached(prefix, key, manifest):  # built while we waited
            log(f"llama.cpp: cached build {key16} at {prefix}")
            return prefix
        with file_lock(paths.workspace / ".build.lock", log):
            build_prefix(paths, manifest, patches, key, prefix, log)
    return prefix


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch, patch and build the pinned llama.cpp into the dgr cache."
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument(
        "--print-prefix",
        action="store_true",
        help="print only the prefix path on stdout (progress goes to stderr)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, help="cache directory (default $DGR_CACHE_DIR or ~/.cache/dgr)"
    )
    parser.add_argument(
        "--sanitize",
        action="store_true",
        help="the AddressSanitizer + UndefinedBehaviorSanitizer build (cached apart)",
    )
    args = parser.parse_args(argv)
    stream = sys.stderr if args.print_prefix else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=stream, flush=True)

    try:
        prefix = ensure_llama(
            force=args.force,
            log=log,
            paths=BuildPaths.default(cache_dir=args.cache_dir),
            sanitize=args.sanitize,
        )
    except BuildError as exc:
        print(f"llama.cpp: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("llama.cpp: interrupted", file=sys.stderr, flush=True)
        return 130
    if args.print_prefix:
        print(prefix, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
