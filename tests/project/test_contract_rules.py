"""The data paths' one contract, as rules on the code (issue 47): gRPC's error model stays in
the gRPC rooms, and the session manager reads what its transport declares, never what it finds.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GRPC_ROOMS = (
    "dgr_engine/client/grpc_channel.py",  # the gRPC data path
    "dgr_engine/client/shard_client.py",  # the gRPC client of a worker's Shard service
    "dgr_engine/wire/status.py",  # the gRPC side of the status table
    "dgr_engine/wire/proto/",  # generated stubs
    "dgr_engine/security/tls.py",  # a gRPC channel's and server's credentials
    "dgr_engine/worker/server.py",  # the worker's gRPC server
    "dgr_engine/worker/calls/",  # its gRPC services
    "dgr_engine/worker/route/",  # its gRPC calls to the next stage
)
"""Where gRPC may be imported: the gRPC data path, the worker's gRPC services and the status
table's gRPC side."""


def _imports_grpc(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "grpc" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "grpc":
            return True
    return False


def test_grpc_stays_in_its_rooms() -> None:
    found = {
        str(path.relative_to(ROOT))
        for package in ("dgr_engine", "dgr_session")
        for path in sorted((ROOT / package).rglob("*.py"))
        if _imports_grpc(path)
    }
    outside = {p for p in found if not p.startswith(GRPC_ROOMS)}
    assert not outside, outside
    assert "dgr_session" not in {p.split("/")[0] for p in found}


def test_the_chained_transport_speaks_only_the_channel_interface() -> None:
    for path in sorted((ROOT / "dgr_engine/client/chained").glob("*.py")):
        assert not _imports_grpc(path), path
    for name in ("native_channel.py", "frame_link_channel.py", "channel.py"):
        assert not _imports_grpc(ROOT / "dgr_engine/client" / name), name
    assert not _imports_grpc(ROOT / "dgr_engine/wire/frame_link.py")


def test_the_manager_reads_what_its_transport_declares() -> None:
    tree = ast.parse((ROOT / "dgr_session/manager.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0])
            assert "transport" not in target, f"line {node.lineno}: {ast.unparse(node)}"
