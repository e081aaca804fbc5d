"""Model artifacts: the hashed manifest of a single or split GGUF.

  dgr artifacts manifest FILE... [--out MANIFEST] [--target-sha SHA] [--chunk-mib N]

Writes the canonical JSON manifest (each file's size, sha256, per-chunk hashes, tensors and
layers; the model's architecture and main layers) and prints its sha256, the model identity's
content hash of a split model. Files are given in split order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dgr_engine.argtypes import int_in


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="artifacts_command", required=True, metavar="SUBCOMMAND")
    manifest = sub.add_parser(
        "manifest",
        help="write the hashed manifest of GGUF files",
        description="Write the hashed manifest of one GGUF or of a split GGUF's files.",
    )
    manifest.add_argument("files", nargs="+", type=Path, metavar="FILE", help="GGUF files")
    manifest.add_argument("--out", type=Path, default=None, help="where (default: stdout)")
    manifest.add_argument("--target-sha", default=None, help="upstream model revision")
    manifest.add_argument(
        "--chunk-mib", type=int_in(1, 1024), default=16, help="chunk size (default 16 MiB)"
    )


def run(args: argparse.Namespace) -> int:
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
