"""Regenerates the Python code of ``proto/dgr/shard/v1/shard.proto`` into ``dgr_engine/wire/proto``.

The generated modules are committed; ``tests/wire/test_proto_drift.py`` regenerates them into a
temporary directory and compares byte for byte, so they cannot drift from the ``.proto``.
Run after editing the ``.proto`` (needs ``grpcio-tools``; the generated code names its exact
version, so use the pinned one)::

    python scripts/gen_proto.py          # rewrite the committed files
    python scripts/gen_proto.py --check  # exit 1 if they differ from a fresh run

protoc writes ``shard_pb2_grpc.py`` with ``from dgr.shard.v1 import shard_pb2``; that one line
is rewritten to import from the package (the only change made to protoc's output).
"""

from __future__ import annotations

import argparse
import importlib.resources
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "dgr_engine" / "wire" / "proto"
"""Where the committed generated modules live."""
PROTO_ROOT = ROOT / "proto"
"""The ``-I`` root: ``proto/`` at the top of the repository."""
PROTO_FILE = "dgr/shard/v1/shard.proto"
"""The one ``.proto``, relative to ``PROTO_ROOT`` (also its name in the descriptor pool)."""
OUTPUTS = ("shard_pb2.py", "shard_pb2.pyi", "shard_pb2_grpc.py")
"""Generated files, by name."""

_PROTOC_IMPORT = b"from dgr.shard.v1 import shard_pb2 as"
_PACKAGE_IMPORT = b"from dgr_engine.wire.proto import shard_pb2 as"


def generate() -> dict[str, bytes]:
    """Runs protoc (from grpcio-tools) and returns the generated files' bytes by name."""
    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="dgr-proto-") as tmp:
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{well_known}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(PROTO_ROOT / PROTO_FILE),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} on {PROTO_FILE}")
        out = Path(tmp) / Path(PROTO_FILE).parent
        files = {name: (out / name).read_bytes() for name in OUTPUTS}
    grpc_code = files["shard_pb2_grpc.py"]
    if grpc_code.count(_PROTOC_IMPORT) != 1:
        raise RuntimeError("protoc's shard_pb2_grpc.py no longer imports shard_pb2 as expected")
    files["shard_pb2_grpc.py"] = grpc_code.replace(_PROTOC_IMPORT, _PACKAGE_IMPORT)
    return files


def stale_files(directory: Path = PACKAGE_DIR) -> list[str]:
    """Names of the generated files in ``directory`` that differ from a fresh generation."""
    fresh = generate()
    return [
        name
        for name, data in fresh.items()
        if not (directory / name).is_file() or (directory / name).read_bytes() != data
    ]


def write(directory: Path = PACKAGE_DIR) -> list[Path]:
    """Regenerates the files into ``directory``; returns their paths."""
    paths = []
    for name, data in generate().items():
        path = directory / name
        path.write_bytes(data)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gen_proto.py")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on drift")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: dgr_engine/wire/proto/{name} (run python scripts/gen_proto.py)")
        return 1 if stale else 0
    for path in write():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
