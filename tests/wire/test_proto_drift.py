"""The committed generated code is exactly what grpcio-tools makes of the .proto today."""

from __future__ import annotations

import grpc_tools
import pytest

from dgr_engine.wire.proto import shard_pb2, shard_pb2_grpc
from scripts import gen_proto as generate


def test_generated_code_matches_the_proto_byte_for_byte() -> None:
    fresh = generate.generate()
    assert sorted(fresh) == sorted(generate.OUTPUTS)
    stale = [
        name for name, data in fresh.items() if (generate.PACKAGE_DIR / name).read_bytes() != data
    ]
    if stale:
        version = getattr(grpc_tools, "__version__", "?")
        pytest.fail(
            f"stale generated code {stale} (grpcio-tools {version}): edit the .proto, then run "
            "`python scripts/gen_proto.py` and commit the result"
        )


def test_grpc_module_imports_messages_from_this_package() -> None:
    text = (generate.PACKAGE_DIR / "shard_pb2_grpc.py").read_text()
    assert "from dgr_engine.wire.proto import shard_pb2 as" in text
    assert "from dgr.shard.v1" not in text


def test_service_and_package_are_versioned() -> None:
    assert shard_pb2.DESCRIPTOR.package == "dgr.shard.v1"
    assert shard_pb2.DESCRIPTOR.name == "dgr/shard/v1/shard.proto"
    service = shard_pb2.DESCRIPTOR.services_by_name["Shard"]
    assert [m.name for m in service.methods] == [
        "Describe",
        "OpenSession",
        "Forward",
        "ForwardStream",
        "CloseSession",
        "Usage",
    ]
    assert hasattr(shard_pb2_grpc, "ShardStub") and hasattr(shard_pb2_grpc, "ShardServicer")


def test_check_mode_reports_no_drift(capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--check"]) == 0
    assert capsys.readouterr().out == ""


def test_chained_routes_have_a_service_of_their_own() -> None:
    service = shard_pb2.DESCRIPTOR.services_by_name["Chain"]
    assert [m.name for m in service.methods] == ["Link", "ChainStream", "ChainOutput"]
    assert hasattr(shard_pb2_grpc, "ChainStub") and hasattr(shard_pb2_grpc, "ChainServicer")
