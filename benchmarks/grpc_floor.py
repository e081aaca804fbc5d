"""The floor under any gRPC seam on this machine: a bare grpc.aio echo, no dgr code at all.

A server process echoes raw bytes (no protobuf message, no checks, no engine) over one
bidirectional stream; before each reply it keeps its CPU busy for ``--busy-ms`` (as a stage
does while its engine computes), so the client sits idle in between, as a route session's
client does. With ``--servers N`` the client relays frames to N such servers in turn, as a
route session relays a token through its stages (each server idle while the others work);
``--idle-ms`` adds client idle time before each request. Busy work is ``memory`` (default:
reading a 256 MiB buffer, as an engine reads its weights, which leaves every cache cold for
the code that runs next) or ``spin`` (a loop that leaves the caches warm: the floor of an
idealised engine).

The client's round trip minus that busy time is the cheapest possible hop through gRPC-Python
on this machine: a dgr hop (checks, tensors, the engine call, the session's own
work) can only cost more. ``benchmarks/pipeline.py`` measures it side by side with the routes
to tell dgr's own overhead from the platform's.

    python -m benchmarks.grpc_floor [--bytes 4096 65536] [--busy-ms 0 4 8]
        [--servers 1] [--idle-ms 0] [--busy-kind memory spin] [--frames 300]

Fixture-free and model-free; the numbers are this machine's, nothing else's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import numpy as np

from dgr_engine.tooling.processes import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent

_METHOD = "/floor.Echo/Stream"
_OPTIONS = [  # a 4 x 4096 f32 row is 64 KiB; gRPC's default limit is 4 MiB
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def _same(data: bytes) -> bytes:
    return data


_BUSY_BYTES = 256 << 20
_SLICE = 1 << 20  # floats per read (4 MiB)


def serve(kind: str) -> None:
    """The echo server (a child process): prints ``LISTENING 127.0.0.1:PORT``."""
    weights = np.ones(_BUSY_BYTES // 4, dtype=np.float32) if kind == "memory" else None

    def busy_for(seconds: float) -> None:
        end = time.perf_counter() + seconds
        at = 0
        while time.perf_counter() < end:
            if weights is not None:
                weights[at : at + _SLICE].sum()
                at = (at + _SLICE) % (weights.size - _SLICE)

    async def echo(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        async for request in requests:
            # request = 8-byte busy time in µs + payload: keep the CPU busy (as an engine
            # does), then echo the payload
            busy_for(int.from_bytes(request[:8], "little") / 1e6)
            yield request[8:]

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            "floor.Echo",
            {"Stream": grpc.stream_stream_rpc_method_handler(echo, _same, _same)},
        )
        server = grpc.aio.server(options=_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"LISTENING 127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def spawn_floor(kind: str = "memory") -> WorkerProcess:
    """Starts the echo server process (stop it with ``.stop()``); ``kind``: its busy work,
    ``memory`` or ``spin``."""
    return WorkerProcess.launch(
        [sys.executable, "-m", "benchmarks.grpc_floor", "--serve", kind], 60.0, cwd=ROOT
    )


async def measure(
    addresses: Sequence[str],
    payload_bytes: int,
    busy_s: float,
    frames: int,
    idle_s: float = 0.0,
) -> list[float]:
    """Round trip minus the server's busy time (µs) of ``frames`` echoes after a warm-up, sent
    to ``addresses`` in turn (one stream each), as a route session relays a token through its
    stages; the client waits ``idle_s`` before each frame."""
    channels = [grpc.aio.insecure_channel(a, options=_OPTIONS) for a in addresses]
    try:
        streams = [
            c.stream_stream(_METHOD, request_serializer=_same, response_deserializer=_same)()
            for c in channels
        ]
        request = int(busy_s * 1e6).to_bytes(8, "little") + bytes(payload_bytes)
        warm = 10 * len(streams)
        values: list[float] = []
        for i in range(frames + warm):
            if idle_s:
                await asyncio.sleep(idle_s)
            stream = streams[i % len(streams)]
            began = time.perf_counter_ns()
            await stream.write(request)
            reply = await stream.read()
            rtt_us = (time.perf_counter_ns() - began) / 1000
            if len(reply) != payload_bytes:
                raise RuntimeError(f"echo returned {len(reply)} bytes, sent {payload_bytes}")
            if i >= warm:
                values.append(rtt_us - busy_s * 1e6)
        for stream in streams:
            await stream.done_writing()
    finally:
        for channel in channels:
            await channel.close()
    return values


def floor_us(
    addresses: Sequence[str],
    payload_bytes: int,
    busy_s: float,
    frames: int,
    idle_s: float = 0.0,
) -> float:
    """Median floor (µs per hop): see :func:`measure`."""
    values = asyncio.run(measure(addresses, payload_bytes, busy_s, frames, idle_s))
    return float(statistics.median(values))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--bytes", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 4.0, 8.0])
    parser.add_argument("--servers", type=int, default=1, help="echo servers relayed in turn")
    parser.add_argument("--idle-ms", type=float, default=0.0)
    parser.add_argument("--busy-kind", choices=("memory", "spin"), nargs="+", default=["memory"])
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--serve", choices=("memory", "spin"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    print(
        f"bare grpc.aio echo, µs per hop (median rtt - server busy time); {args.servers} "
        f"server(s) relayed in turn; the client idles {args.idle_ms} ms before each request"
    )
    print(f"{'busy kind':>9} {'bytes':>8} {'busy ms':>8} {'floor µs':>9}")
    for kind in args.busy_kind:
        servers = [spawn_floor(kind) for _ in range(args.servers)]
        try:
            addresses = [server.address for server in servers]
            for size in args.bytes:
                for busy in args.busy_ms:
                    frames = args.frames if busy <= 1 else max(50, args.frames // 3)
                    value = floor_us(addresses, size, busy / 1000, frames, args.idle_ms / 1000)
                    print(f"{kind:>9} {size:>8} {busy:>8.1f} {value:>9.0f}")
        finally:
            for server in servers:
                server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
