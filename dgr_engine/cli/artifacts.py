"""Model artifacts: the hashed manifest of a single or split GGUF, provisioning, verification.

  dgr artifacts manifest DIR|FILE... [--out MANIFEST] [--target-sha SHA] [--chunk-mib N]
  dgr artifacts fetch MANIFEST --from DIR|URL --root STORAGE [--layers A:B]
  dgr artifacts verify MANIFEST --root STORAGE [--layers A:B]

manifest writes the canonical JSON manifest (each file's size, sha256, per-chunk hashes,
tensors and layers; the model's architecture and main layers) and prints its sha256, the model
identity's content hash of a split model; files are given in split order, a directory stands for
its *.gguf files. fetch copies the files (with --layers, only those a shard of that
range reads) into the storage root, verifying every chunk as it lands and resuming an
interrupted run; verify re-hashes them in place, resuming an interrupted run, and
quarantines a file whose bytes disagree with the manifest (a manifest that breaks its own rules,
such as a negative size or a chunk above 256 MiB, is refused before anything is touched). No
link in the root is followed (a symlinked NAME.part or NAME is refused). The storage root is
--root or $DGR_STORAGE_ROOT, never under /home. Exit 0: done; 1: a file failed (one line each); 2: a
refusal before any work (bad manifest, storage policy, busy root).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dgr_engine.argtypes import int_in, layer_range

MAX_CHUNK_MIB = 256
"""The manifest's cap on chunk sizes (``manifest.MAX_CHUNK_BYTES``), in MiB."""


def _storage_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", type=Path, metavar="MANIFEST", help="the manifest (JSON)")
    p.add_argument("--root", default=None, help="storage root (default: $DGR_STORAGE_ROOT)")
    p.add_argument(
        "--layers",
        type=layer_range,
        default=None,
        help="only the files a shard of layers A:B reads (default: every file)",
    )
    p.add_argument(
        "--allow-temp-root",
        action="store_true",
        help="accept a storage root in a temporary directory (tests only)",
    )


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="artifacts_command", required=True, metavar="SUBCOMMAND")
    manifest = sub.add_parser(
        "manifest",
        help="write the hashed manifest of GGUF files",
        description="Write the hashed manifest of one GGUF or of a split GGUF's files.",
    )
    manifest.add_argument(
        "files", nargs="+", type=Path, metavar="DIR|FILE", help="GGUF files or a directory"
    )
    manifest.add_argument("--out", type=Path, default=None, help="where (default: stdout)")
    manifest.add_argument("--target-sha", default=None, help="upstream model revision")
    manifest.add_argument(
        "--chunk-mib",
        type=int_in(1, MAX_CHUNK_MIB),
        default=16,
        help=f"chunk size (default 16 MiB, at most {MAX_CHUNK_MIB})",
    )
    fetch = sub.add_parser(
        "fetch",
        help="copy a manifest's files into storage, verifying every chunk",
        description="Copy a manifest's files (or those of one layer range) from a directory "
        "or an HTTP(S) URL into the storage root, verifying each chunk; resumes.",
    )
    _storage_arguments(fetch)
    fetch.add_argument(
        "--from", dest="source", required=True, metavar="DIR|URL", help="where the files are"
    )
    verify = sub.add_parser(
        "verify",
        help="re-hash stored files against a manifest (resumes)",
        description="Re-hash the stored files against the manifest, chunk by chunk, resuming "
        "an interrupted run; quarantine any file that disagrees.",
    )
    _storage_arguments(verify)


def run(args: argparse.Namespace) -> int:
    if args.artifacts_command == "manifest":
        return _manifest(args)
    return _provision(args)


def _manifest(args: argparse.Namespace) -> int:
    from dgr_engine.artifacts.manifest import ManifestInvalid, build_manifest
    from dgr_engine.atomic import replacing

    try:
        manifest = build_manifest(
            args.files, official_target_sha=args.target_sha, chunk_bytes=args.chunk_mib << 20
        )
    except (ManifestInvalid, OSError, ValueError) as exc:
        print(f"dgr artifacts manifest: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        print(manifest.text())
    else:
        with replacing(args.out) as tmp:
            tmp.write_text(manifest.text())
        print(f"{args.out}", file=sys.stderr)
    print(f"manifest sha256 {manifest.sha256}", file=sys.stderr)
    return 0


def _provision(args: argparse.Namespace) -> int:
    from dgr_engine.artifacts import provision
    from dgr_engine.artifacts.errors import ArtifactError
    from dgr_engine.artifacts.manifest import ManifestInvalid, load_manifest
    from dgr_engine.artifacts.sources import source_for
    from dgr_engine.artifacts.storage import StorageRefused, storage_root
    from dgr_engine.cli._progress import progress_printer

    command = f"dgr artifacts {args.artifacts_command}"
    try:
        manifest = load_manifest(args.manifest)
        root = storage_root(args.root, allow_temp=args.allow_temp_root)
        source = source_for(args.source) if args.artifacts_command == "fetch" else None
    except (ManifestInvalid, StorageRefused, ArtifactError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    report_progress, finish = progress_printer(args.artifacts_command)
    try:
        if source is not None:
            report = provision.fetch(
                manifest, source, root, layers=args.layers, progress=report_progress
            )
        else:
            report = provision.verify(manifest, root, layers=args.layers, progress=report_progress)
    except (ManifestInvalid, ArtifactError) as exc:
        finish()
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the root or a file in it could not be read or written
        finish()
        print(f"{command}: {root}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except StorageRefused as exc:
        finish()
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    finish()
    for problem in report.problems:
        print(f"{command}: {problem}", file=sys.stderr)
    print(
        f"{command}: {len(report.files)} files in {root}: {report.hashed_chunks} chunks hashed, "
        f"{report.trusted_chunks} trusted, {report.fetched_bytes / 2**20:.1f} MiB fetched in "
        f"{report.seconds:.1f} s; manifest {manifest.sha256[:16]}"
        + ("" if report.ok else f"; {len(report.problems)} failed"),
        file=sys.stderr,
    )
    return 0 if report.ok else 1
