"""What one hop of each data path costs on this machine, against a bare TCP echo of the same
bytes (the physical floor): issue 32's "per-hop cost ≤ 0.3 ms above the bare TCP echo".

The bytes are one decode frame as a stage sends it on (a serialized ``ForwardRequest``: one
row of ``--width`` f32, its position, token id, session secret and expectations). A server
process echoes each frame back, and the client times the round trip; a hop (one way) is half
of it:

* **tcp echo**: a blocking socket in a thread on each end, ``recv`` and ``sendall`` of the same
  bytes (length-prefixed): no framing library, no event loop: the floor.
* **frame link**: ``dgr_engine.wire.frame_link`` (the client's ``FrameLinkCall``) to a
  ``FrameLinkServer`` whose servicer echoes each frame as the reply (no checks, no engine: the
  path alone, its framing, protobuf and event loop on both ends).
* **grpc**: a ``grpc.aio`` bidirectional stream of the same bytes to an echo handler
  (``benchmarks/grpc_floor.py``'s server, with no busy time): the gRPC path's floor.

Interleaved rounds (``--rounds``), each path ``--frames`` round trips after a warm-up; figures
are medians. Prints the table and saves ``benchmarks/out/hop_cost.json``.

    python -m benchmarks.hop_cost [--width 576] [--frames 400] [--rounds 3]

Model-free; the numbers are this machine's (2 shared cores: every process of the benchmark
and whatever else runs share them, so the figures move with the load; the ratios of one run
are what to read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from loguru import logger

from benchmarks.grpc_floor import measure as grpc_measure
from benchmarks.grpc_floor import spawn_floor
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.wire import frame_link as fl
from dgr_engine.wire.frames import Expectations, encode_forward
from dgr_engine.wire.proto import shard_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
TARGET_ABOVE_ECHO_MS = 0.3
_LEN = struct.Struct("!I")


def frame_bytes(width: int) -> pb.ForwardRequest:
    """One decode frame of one row of ``width`` f32, as a stage sends it on."""
    expect = Expectations(model_sha256=bytes(32), layer_begin=8, layer_end=16, boundary_width=width)
    rows = np.random.default_rng(0).standard_normal((1, width)).astype(np.float32)
    request = encode_forward(
        "bench-session",
        1,
        7,
        expect,
        range(40, 41),
        boundary=rows,
        tokens=np.array([5]),
        session_secret=bytes(32),
    )
    return request


# --- servers (child processes) -----------------------------------------------------------------


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return bytes(out)


def serve_tcp() -> None:
    """The bare echo: one thread per connection, blocking sockets."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"LISTENING 127.0.0.1:{listener.getsockname()[1]}", flush=True)

    def echo(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                while True:
                    (n,) = _LEN.unpack(_recv_exactly(conn, 4))
                    conn.sendall(_LEN.pack(n) + _recv_exactly(conn, n))
            except (ConnectionError, OSError):
                return

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


class _EchoCalls:
    """A ``ChainStream`` that answers each frame with itself (the path alone)."""

    async def ChainStream(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for request in requests:
            yield request

    async def ChainOutput(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        yield request


def serve_frame_link() -> None:
    from dgr_engine.worker.calls.frame_link_server import FrameLinkServer
    from dgr_engine.worker.config import WorkerConfig

    async def main() -> None:
        server = FrameLinkServer(
            _EchoCalls(),  # type: ignore[arg-type]
            logger,
            tls=None,
            max_message_bytes=64 << 20,
            max_connections=8,
            introductions=WorkerConfig().introduction_gate(),
        )
        port = await server.start("127.0.0.1", 0)
        print(f"LISTENING 127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def _spawn(kind: str) -> WorkerProcess:
    return WorkerProcess.launch(
        [sys.executable, "-m", "benchmarks.hop_cost", "--serve", kind], 60.0, cwd=ROOT
    )


# --- clients -------------------------------------------------------------------------------------


def tcp_rtts(address: str, payload: bytes, frames: int) -> list[float]:
    host, port = fl.split_endpoint(address)
    with socket.create_connection((host, port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out: list[float] = []
        message = _LEN.pack(len(payload)) + payload
        for i in range(frames + 20):
            began = time.perf_counter_ns()
            conn.sendall(message)
            (n,) = _LEN.unpack(_recv_exactly(conn, 4))
            if len(_recv_exactly(conn, n)) != len(payload):
                raise RuntimeError("the echo changed the frame")
            if i >= 20:
                out.append((time.perf_counter_ns() - began) / 1000)
        return out


async def frame_link_rtts(address: str, request: pb.ForwardRequest, frames: int) -> list[float]:
    host, port = fl.split_endpoint(address)
    call = fl.FrameLinkCall(fl.FrameLinkTarget(host, port), "ChainStream", (), pb.ForwardRequest)
    out: list[float] = []
    try:
        for i in range(frames + 20):
            began = time.perf_counter_ns()
            await call.write(request)
            reply = await call.read()
            if reply.ByteSize() != request.ByteSize():
                raise RuntimeError("the echo changed the frame")
            if i >= 20:
                out.append((time.perf_counter_ns() - began) / 1000)
        await call.done_writing()
    finally:
        call.cancel()
    return out


def measure(width: int, frames: int, rounds: int) -> dict[str, Any]:
    """Each path's hop (ms, one way) in interleaved rounds, and how far above the echo."""
    request = frame_bytes(width)
    payload = request.SerializeToString()
    servers = {
        "tcp echo": _spawn("tcp"),
        "frame link": _spawn("frame"),
        "grpc": spawn_floor("spin"),
    }
    rtts: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for round_ in range(rounds):
            names = list(servers)
            names = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in names:
                address = servers[name].address
                if name == "tcp echo":
                    got = tcp_rtts(address, payload, frames)
                elif name == "frame link":
                    got = asyncio.run(frame_link_rtts(address, request, frames))
                else:
                    got = asyncio.run(grpc_measure([address], len(payload), 0.0, frames))
                rtts[name].append(statistics.median(got))
    finally:
        for server in servers.values():
            server.stop()
    echo = statistics.median(rtts["tcp echo"]) / 2000
    rows = []
    for name, values in rtts.items():
        hop = statistics.median(values) / 2000
        rows.append(
            {
                "path": name,
                "hop_ms": hop,
                "above_echo_ms": hop - echo,
                "rounds_hop_ms": [v / 2000 for v in values],
                "met": name == "tcp echo" or hop - echo <= TARGET_ABOVE_ECHO_MS,
            }
        )
    return {
        "frame_bytes": len(payload),
        "width": width,
        "frames": frames,
        "rounds": rounds,
        "rows": rows,
    }


def print_rows(result: dict[str, Any]) -> None:
    print(
        f"one hop of a {result['frame_bytes']}-byte decode frame (width {result['width']}), "
        f"medians of {result['rounds']} interleaved rounds of {result['frames']} round trips, "
        f"against a bare TCP echo of the same bytes (target: <= {TARGET_ABOVE_ECHO_MS} ms "
        "above it); the path alone, no checks, no engine:"
    )
    print()
    print("| path | hop ms | above echo ms | target | rounds (hop ms) |")
    print("|---|---|---|---|---|")
    for row in result["rows"]:
        target = "-" if row["path"] == "tcp echo" else ("met" if row["met"] else "missed")
        rounds = " ".join(f"{v:.3f}" for v in row["rounds_hop_ms"])
        print(
            f"| {row['path']} | {row['hop_ms']:.3f} | {row['above_echo_ms']:.3f} | {target} | "
            f"{rounds} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--serve", choices=("tcp", "frame"), help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=576, help="row width (SmolLM2's: 576)")
    parser.add_argument("--frames", type=int, default=400, help="round trips per path per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)
    if args.serve == "tcp":
        serve_tcp()
        return 0
    if args.serve == "frame":
        serve_frame_link()
        return 0
    result = measure(args.width, args.frames, args.rounds)
    print_rows(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hop_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nsaved {args.out / 'hop_cost.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
