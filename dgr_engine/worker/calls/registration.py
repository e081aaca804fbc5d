"""The ``Shard`` service's registration with lenient request parsing: bytes that are not a
valid message reach the servicer as :class:`Undecodable` (which it refuses with
``INVALID_ARGUMENT`` / ``DGR_E_FRAME`` and the ``dgr-status`` trailer) instead of failing
inside gRPC, which would answer ``UNKNOWN`` with no trailer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import grpc
from google.protobuf.message import DecodeError, Message

from dgr_engine.wire.proto import shard_pb2 as pb

SERVICE_NAME = "dgr.shard.v1.Shard"
"""Full gRPC service name (also the health service's per-service key)."""


@attrs.frozen
class Undecodable:
    """A request whose bytes did not parse; named like a request so refusals can log it."""

    what: str
    """Which message, and the parser's complaint."""
    session_id: str = ""
    epoch: int = 0
    step: int = 0


def lenient(message_type: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A deserializer that never raises: a message, or :class:`Undecodable`."""
    name = message_type.DESCRIPTOR.name

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Undecodable(f"{name}: {exc or 'not a valid message'}")

    return parse


def add_shard_service(servicer: Any, server: grpc.aio.Server) -> None:
    """Registers ``servicer``'s methods as the generated code would, but lenient."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.stream_stream_rpc_method_handler
    handlers = {
        "Describe": unary(
            servicer.Describe,
            request_deserializer=lenient(pb.DescribeRequest),
            response_serializer=pb.Advert.SerializeToString,
        ),
        "OpenSession": unary(
            servicer.OpenSession,
            request_deserializer=lenient(pb.OpenSessionRequest),
            response_serializer=pb.OpenSessionReply.SerializeToString,
        ),
        "Forward": unary(
            servicer.Forward,
            request_deserializer=lenient(pb.ForwardRequest),
            response_serializer=pb.ForwardReply.SerializeToString,
        ),
        "ForwardStream": stream(
            servicer.ForwardStream,
            request_deserializer=lenient(pb.ForwardRequest),
            response_serializer=pb.ForwardReply.SerializeToString,
        ),
        "CloseSession": unary(
            servicer.CloseSession,
            request_deserializer=lenient(pb.CloseSessionRequest),
            response_serializer=pb.CloseSessionReply.SerializeToString,
        ),
        "Usage": unary(
            servicer.Usage,
            request_deserializer=lenient(pb.UsageRequest),
            response_serializer=pb.UsageReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
