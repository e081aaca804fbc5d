"""Provisioning and verification: chunk by chunk against the manifest, resumable after an
interruption or a kill (verified chunks are not hashed again), corrupt copies quarantined and
fetched again, a source serving other bytes or cutting connections handled. Hostile roots and
manifests: links where the part file, the final file, the lock, the state or the quarantine
should be are never followed; a manifest that breaks its own rules touches nothing; a fetched
file that is no GGUF never gets its final name."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dgr_engine.artifacts import provision, shard
from dgr_engine.artifacts.errors import (
    ArtifactCorrupt,
    ArtifactMissing,
    ArtifactsBusy,
    ArtifactUnsafe,
    SourceMismatch,
    SourceUnavailable,
)
from dgr_engine.artifacts.manifest import FileEntry, Manifest, ManifestInvalid, build_manifest
from dgr_engine.artifacts.sources import DirectorySource, HttpSource, source_for
from dgr_engine.artifacts.state import ArtifactState, part_key, state_path
from dgr_engine.fixtures import ensure_fixture
from tests.artifacts.artifact_server import Behaviour, serving

CHUNK = 1 << 14


class Interrupted(Exception):
    """Raised from the progress callback: the run stops as if the process died there."""


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    """A source directory holding one fixture GGUF, and its manifest in 16 KiB chunks."""
    directory = tmp_path_factory.mktemp("origin")
    shutil.copy(ensure_fixture("tiny-llama"), directory / "model.gguf")
    manifest = build_manifest([directory / "model.gguf"], chunk_bytes=CHUNK)
    assert len(manifest.files[0].chunks) > 20
    return directory, manifest


def _stop_after(chunks: int) -> provision.ProgressFn:
    seen = [0]

    def progress(name: str, done: int, total: int) -> None:
        seen[0] += 1
        if seen[0] > chunks:
            raise Interrupted(name)

    return progress


def _done_bytes(line: str) -> int:
    match = re.search(r" (\d+)/(\d+) bytes", line)
    return int(match.group(1)) if match else 0


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_copies_verified_files_and_a_second_fetch_trusts_them(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    n = len(manifest.files[0].chunks)
    seen: list[tuple[int, int]] = []
    report = provision.fetch(
        manifest, DirectorySource(directory), tmp_path, progress=lambda _, d, t: seen.append((d, t))
    )
    assert report.ok and report.hashed_chunks == n and report.fetched_bytes == manifest.size
    assert _sha(tmp_path / "model.gguf") == manifest.files[0].sha256
    assert seen[-1] == (manifest.size, manifest.size) and len(seen) >= n
    assert not (tmp_path / part_key("model.gguf")).exists()
    again = provision.fetch(manifest, DirectorySource(directory), tmp_path)
    assert (again.hashed_chunks, again.trusted_chunks, again.fetched_bytes) == (0, n, 0)
    assert provision.trusted(manifest, tmp_path, None) is not None


def test_an_interrupted_fetch_resumes_without_rehashing(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    n = len(manifest.files[0].chunks)
    with pytest.raises(Interrupted):
        provision.fetch(manifest, DirectorySource(directory), tmp_path, progress=_stop_after(7))
    assert not (tmp_path / "model.gguf").exists()
    assert provision.trusted(manifest, tmp_path, None) is None
    resumed = provision.fetch(manifest, DirectorySource(directory), tmp_path)
    assert resumed.trusted_chunks == 7 and resumed.hashed_chunks == n - 7
    assert _sha(tmp_path / "model.gguf") == manifest.files[0].sha256


def test_an_interrupted_verify_resumes_and_a_finished_one_starts_over(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    n = len(manifest.files[0].chunks)
    provision.fetch(manifest, DirectorySource(directory), tmp_path)
    with pytest.raises(Interrupted):
        provision.verify(manifest, tmp_path, progress=_stop_after(5))
    assert ArtifactState.load(tmp_path, manifest.sha256).verifying
    assert provision.trusted(manifest, tmp_path, None) is None  # half-verified is not trusted
    resumed = provision.verify(manifest, tmp_path)
    assert resumed.ok and (resumed.trusted_chunks, resumed.hashed_chunks) == (5, n - 5)
    fresh = provision.verify(manifest, tmp_path)
    assert fresh.ok and (fresh.trusted_chunks, fresh.hashed_chunks) == (0, n)
    assert provision.trusted(manifest, tmp_path, None)


def test_a_flipped_byte_is_caught_quarantined_and_fetched_again(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    provision.fetch(manifest, DirectorySource(directory), tmp_path)
    stored = tmp_path / "model.gguf"
    data = bytearray(stored.read_bytes())
    data[3 * CHUNK + 17] ^= 0x01
    stored.write_bytes(bytes(data))
    assert provision.trusted(manifest, tmp_path, None) is None  # modified since verified
    report = provision.verify(manifest, tmp_path)
    (problem,) = report.problems
    assert isinstance(problem, ArtifactCorrupt)
    assert str(problem).startswith("model.gguf: chunk 3 has another sha256; quarantined to ")
    assert not stored.exists() and Path(problem.quarantined_to).is_file()
    assert isinstance(provision.verify(manifest, tmp_path).problems[0], ArtifactMissing)
    again = provision.fetch(manifest, DirectorySource(directory), tmp_path)
    assert again.ok and _sha(stored) == manifest.files[0].sha256


def test_a_wrong_size_is_quarantined_by_fetch_and_replaced(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    (tmp_path / "model.gguf").write_bytes(b"GGUF but short")
    report = provision.fetch(manifest, DirectorySource(directory), tmp_path)
    assert report.ok and len(report.quarantined) == 1
    assert _sha(tmp_path / "model.gguf") == manifest.files[0].sha256


def test_a_source_serving_other_bytes_is_refused_and_nothing_is_kept(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    bad = tmp_path / "bad-source"
    bad.mkdir()
    data = bytearray((directory / "model.gguf").read_bytes())
    data[10 * CHUNK + 5] ^= 0xFF
    (bad / "model.gguf").write_bytes(bytes(data))
    root = tmp_path / "root"
    with pytest.raises(SourceMismatch, match=r"^model.gguf: .* serves other bytes .* chunk 10 "):
        provision.fetch(manifest, DirectorySource(bad), root)
    assert not (root / "model.gguf").exists()
    part = root / part_key("model.gguf")
    assert part.stat().st_size == 10 * CHUNK  # only the verified chunks
    resumed = provision.fetch(manifest, DirectorySource(directory), root)
    assert resumed.trusted_chunks == 10 and _sha(root / "model.gguf") == manifest.files[0].sha256


def test_missing_sources_and_a_busy_root_are_refused(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    _, manifest = origin
    with pytest.raises(SourceUnavailable, match="^model.gguf: not readable in"):
        provision.fetch(manifest, DirectorySource(tmp_path / "nowhere"), tmp_path / "root")
    with pytest.raises(SourceUnavailable, match="not a directory nor an http"):
        source_for(str(tmp_path / "nowhere"))
    with provision.holding(tmp_path), pytest.raises(ArtifactsBusy, match="another fetch"):
        provision.verify(manifest, tmp_path)


def test_a_manifest_whose_tensor_map_disagrees_with_the_header_is_refused(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    entry = manifest.files[0]
    lying = Manifest(
        manifest.arch,
        manifest.n_layer,
        None,
        [
            type(entry)(
                entry.name,
                entry.size,
                entry.sha256,
                entry.chunk_bytes,
                entry.chunks,
                [t for t in entry.tensors if not t.startswith("blk.3.")],
                entry.types,
            )
        ],
    )
    with pytest.raises(ManifestInvalid, match="model.gguf: the manifest's tensor .* disagrees"):
        provision.fetch(lying, DirectorySource(directory), tmp_path)


def test_an_http_source_that_drops_the_connection_mid_file(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    behaviour = Behaviour()
    behaviour.drop_after = [3 * CHUNK + 100, 5 * CHUNK + 7]
    with serving(directory, behaviour) as url:
        report = provision.fetch(manifest, HttpSource(url), tmp_path)
    assert report.ok and _sha(tmp_path / "model.gguf") == manifest.files[0].sha256
    starts = [start for _, start in behaviour.requests]
    assert starts == [0, 3 * CHUNK, 8 * CHUNK]  # each retry asks from the first missing chunk
    assert report.fetched_bytes == manifest.size


def test_an_http_server_ignoring_ranges_cannot_resume(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    with pytest.raises(Interrupted):
        provision.fetch(manifest, DirectorySource(directory), tmp_path, progress=_stop_after(2))
    behaviour = Behaviour()
    behaviour.ignore_range = True
    with (
        serving(directory, behaviour) as url,
        pytest.raises(SourceUnavailable, match="ignored the range request"),
    ):
        provision.fetch(manifest, HttpSource(url), tmp_path)


def test_a_killed_fetch_process_resumes(origin: tuple[Path, Manifest], tmp_path: Path) -> None:
    directory, manifest = origin
    n = len(manifest.files[0].chunks)
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(manifest.text())
    root = tmp_path / "root"
    behaviour = Behaviour()
    behaviour.hold_after = 6 * CHUNK + 1000
    command = [sys.executable, "-m", "dgr_engine.cli", "artifacts", "fetch", str(manifest_path)]
    with serving(directory, behaviour) as url:
        child = subprocess.Popen(
            [*command, "--from", url, "--root", str(root), "--allow-temp-root"],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert behaviour.holding.wait(timeout=60), "the fetch never reached the held chunk"
            assert child.stderr is not None
            done_bytes = 0
            for _ in range(10_000):  # progress lines "... DONE/TOTAL bytes"
                line = child.stderr.readline()
                if not line or (done_bytes := _done_bytes(line)) >= 6 * CHUNK:
                    break
            assert done_bytes == 6 * CHUNK, f"no progress line for six chunks ({line!r})"
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert not (root / "model.gguf").exists()
    done = subprocess.run(
        [*command, "--from", str(directory), "--root", str(root), "--allow-temp-root"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"{n - 6} chunks hashed, 6 trusted" in done.stderr
    assert _sha(root / "model.gguf") == manifest.files[0].sha256


_KILLED_VERIFY = """
import os, signal, sys
from pathlib import Path
from dgr_engine.artifacts import provision
from dgr_engine.artifacts.manifest import load_manifest

seen = [0]
def progress(name, done, total):
    seen[0] += 1
    if seen[0] > int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)

provision.verify(load_manifest(sys.argv[1]), Path(sys.argv[2]), progress=progress)
"""


def test_a_killed_verify_process_resumes(origin: tuple[Path, Manifest], tmp_path: Path) -> None:
    directory, manifest = origin
    n = len(manifest.files[0].chunks)
    provision.fetch(manifest, DirectorySource(directory), tmp_path)
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(manifest.text())
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_VERIFY, str(manifest_path), str(tmp_path), "9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = provision.verify(manifest, tmp_path)  # callbacks: one at the start, one a chunk
    assert resumed.ok and (resumed.trusted_chunks, resumed.hashed_chunks) == (9, n - 9)


def _victim(tmp_path: Path) -> tuple[Path, bytes, int]:
    """A file outside the root that a link in the root points to, with its bytes and mtime."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious"
    victim.write_bytes(b"not yours to overwrite\n" * 100)
    return victim, victim.read_bytes(), victim.stat().st_mtime_ns


def _untouched(victim: Path, data: bytes, mtime_ns: int) -> bool:
    return victim.read_bytes() == data and victim.stat().st_mtime_ns == mtime_ns


def test_a_symlinked_part_is_refused_and_what_it_points_to_is_untouched(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    victim, data, mtime = _victim(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    part = root / part_key("model.gguf")
    part.symlink_to(victim)
    with pytest.raises(ArtifactUnsafe, match=r"^model.gguf.part: a symlink in .*; refused"):
        provision.fetch(manifest, DirectorySource(directory), root)
    assert _untouched(victim, data, mtime)
    assert not (root / "model.gguf").exists() and not (root / "model.gguf").is_symlink()
    assert part.is_symlink()  # left for the operator to look at, never followed
    part.unlink()  # honest use beside: once the link is gone the fetch is exact
    report = provision.fetch(manifest, DirectorySource(directory), root)
    assert report.ok and _sha(root / "model.gguf") == manifest.files[0].sha256
    assert not (root / "model.gguf").is_symlink() and _untouched(victim, data, mtime)


def test_a_hard_linked_part_is_refused_and_its_other_name_untouched(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    victim, data, mtime = _victim(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    os.link(victim, root / part_key("model.gguf"))
    with pytest.raises(ArtifactUnsafe, match=r"^model.gguf.part: a file with 2 hard links"):
        provision.fetch(manifest, DirectorySource(directory), root)
    assert _untouched(victim, data, mtime) and not (root / "model.gguf").exists()
    (root / part_key("model.gguf")).unlink()
    assert provision.fetch(manifest, DirectorySource(directory), root).ok


def test_a_symlinked_final_name_is_refused_by_fetch_verify_and_a_shard(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    victim, data, mtime = _victim(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    (root / "model.gguf").symlink_to(victim)
    with pytest.raises(ArtifactUnsafe, match=r"^model.gguf: a symlink in "):
        provision.fetch(manifest, DirectorySource(directory), root)
    (problem,) = provision.verify(manifest, root).problems
    assert isinstance(problem, ArtifactUnsafe)
    with pytest.raises(ArtifactUnsafe, match=r"^model.gguf: a symlink in "):
        shard.prepare(manifest, root, (0, manifest.n_layer))
    assert (root / "model.gguf").is_symlink() and _untouched(victim, data, mtime)
    assert not (root / provision.QUARANTINE_DIR).exists()  # nothing moved
    (root / "model.gguf").unlink()
    assert provision.fetch(manifest, DirectorySource(directory), root).ok
    assert shard.prepare(manifest, root, (0, manifest.n_layer)).first == root / "model.gguf"


def test_symlinked_lock_state_and_quarantine_are_never_followed(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    victim, data, mtime = _victim(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    (root / provision.LOCK_NAME).symlink_to(victim)
    with pytest.raises(ArtifactUnsafe, match=r"^\.dgr-artifacts\.lock: a symlink"):
        provision.verify(manifest, root)
    (root / provision.LOCK_NAME).unlink()
    state = state_path(root, manifest.sha256)
    state.symlink_to(victim)  # an unreadable state only costs hashing; saving replaces the link
    assert provision.fetch(manifest, DirectorySource(directory), root).ok
    assert not state.is_symlink() and _untouched(victim, data, mtime)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / provision.QUARANTINE_DIR).symlink_to(elsewhere, target_is_directory=True)
    stored = root / "model.gguf"
    flipped = bytearray(stored.read_bytes())
    flipped[5 * CHUNK] ^= 0x01
    stored.write_bytes(bytes(flipped))
    (problem,) = provision.verify(manifest, root).problems
    assert isinstance(problem, ArtifactUnsafe)
    assert str(problem).startswith(".quarantine: not a plain directory in ")
    assert list(elsewhere.iterdir()) == [] and stored.is_file()
    (root / provision.QUARANTINE_DIR).unlink()
    report = provision.verify(manifest, root)
    assert [type(p) for p in report.problems] == [ArtifactCorrupt]
    assert provision.fetch(manifest, DirectorySource(directory), root).ok
    assert _sha(stored) == manifest.files[0].sha256


def _hostile(manifest: Manifest, **change: object) -> str:
    data = json.loads(manifest.text())
    data["files"][0].update(change)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"size": -1, "chunks": []}, r"files\[0\]\.size: -1 bytes"),
        ({"size": 0, "chunks": []}, r"files\[0\]\.size: 0 bytes"),
        ({"size": 0, "chunks": ["00" * 32]}, r"files\[0\]\.size: 0 bytes"),
        ({"chunk_bytes": (256 << 20) + 1}, r"files\[0\]\.chunk_bytes: 268435457: chunks are"),
    ],
    ids=["negative", "zero", "zero-with-chunks", "chunk-above-cap"],
)
def test_a_hostile_manifest_given_to_verify_or_fetch_touches_nothing(
    change: dict[str, object],
    message: str,
    origin: tuple[Path, Manifest],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dgr_engine import cli

    directory, manifest = origin
    root = tmp_path / "root"
    assert provision.fetch(manifest, DirectorySource(directory), root).ok
    hostile = tmp_path / "hostile.json"
    hostile.write_text(_hostile(manifest, **change))
    before = sorted(p.name for p in root.iterdir())
    for command in (["verify"], ["fetch", "--from", str(directory)]):
        argv = ["artifacts", *command[:1], str(hostile), *command[1:], "--root", str(root)]
        assert cli.main([*argv, "--allow-temp-root"]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert re.search(message, line), line
    assert sorted(p.name for p in root.iterdir()) == before  # nothing quarantined nor written
    assert not (root / provision.QUARANTINE_DIR).exists()
    empty = tmp_path / "empty-root"
    assert (
        cli.main(
            ["artifacts", "fetch", str(hostile), "--from", str(directory)]
            + ["--root", str(empty), "--allow-temp-root"]
        )
        == 2
    )
    assert not empty.exists()  # refused before any work: not even the root was made
    honest = provision.verify(manifest, root)  # beside it, the honest manifest still verifies
    assert honest.ok and honest.hashed_chunks == len(manifest.files[0].chunks)
    assert _sha(root / "model.gguf") == manifest.files[0].sha256


def test_fetch_never_leaves_a_file_that_is_not_a_gguf_under_its_final_name(
    origin: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = origin
    source = tmp_path / "source"
    source.mkdir()
    blob = bytes(range(256)) * 200  # hashes match the manifest below, but it is no GGUF
    (source / "blob.gguf").write_bytes(blob)
    shutil.copy(directory / "model.gguf", source / "model.gguf")
    chunks = [hashlib.sha256(blob[i : i + CHUNK]).hexdigest() for i in range(0, len(blob), CHUNK)]
    entry = FileEntry("blob.gguf", len(blob), hashlib.sha256(blob).hexdigest(), CHUNK, chunks, [])
    lying = Manifest(manifest.arch, manifest.n_layer, None, [*manifest.files, entry])
    root = tmp_path / "root"
    with pytest.raises(ManifestInvalid, match=r"^blob.gguf: its bytes match the manifest but are"):
        provision.fetch(lying, DirectorySource(source), root)
    assert not (root / "blob.gguf").exists()
    assert _sha(root / "model.gguf") == manifest.files[0].sha256  # the honest file beside it
    assert provision.verify(manifest, root).ok
