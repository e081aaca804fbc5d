"""Generated Protobuf/gRPC code of ``proto/dgr/shard/v1/shard.proto`` (package ``dgr.shard.v1``).

``shard_pb2`` (messages, with ``.pyi`` stubs) and ``shard_pb2_grpc`` (service stubs) are produced
by ``python scripts/gen_proto.py`` and committed; never edit them by hand. Import them as
``from dgr_engine.wire.proto import shard_pb2`` (this package imports nothing itself, so that the
generator runs even when the generated modules are missing or stale).
"""
