"""One stage of :mod:`benchmarks.link_ring`: a shard engine whose session runs over a native
link (``docs/native-link.md``), driven by its parent over stdin and stdout, one JSON line each
way. Loopback only; the parent's harness stands in for the worker's control plane (which
opens sessions and hands connected sockets to the link).

    python -m benchmarks.link_stage --model GGUF --layers A B --hop I [engine options]

It listens on 127.0.0.1 and prints ``{"port": P}``. Then, per command line:

``{"run": EPOCH, "out": PORT, "ring_out": PORT or null, "ring_in": bool}``
    ends the last epoch's link, opens the session at ``EPOCH``, connects to ``out`` (and
    ``ring_out``), each connection introduced by a 9-byte hello (role ``i`` or ``r``, the
    epoch), accepts its ``i`` (and ``r``) connection, starts the link and prints
    ``{"ready": EPOCH}``.
``{"stats": true}``
    prints the link's counters.

End of input ends the stage (its link, session and engine).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
from typing import Any

import attrs

from dgr_engine import ShardEngine
from dgr_engine.engine import LinkSockets, NativeLink
from dgr_engine.options import EngineOptions

HELLO = struct.Struct("<cQ")
"""A connection's introduction: its role (``i``: the link's input, ``r``: a ring's input) and
the epoch it is for."""
SESSION = 1
ACCEPT_SECONDS = 30.0


def hello(role: bytes, epoch: int, port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=ACCEPT_SECONDS)
    sock.sendall(HELLO.pack(role, epoch))
    return sock


def accept(listener: socket.socket, epoch: int, roles: set[bytes]) -> dict[bytes, socket.socket]:
    """The connections of ``roles`` for ``epoch`` (any other is closed unheard)."""
    got: dict[bytes, socket.socket] = {}
    while roles - got.keys():
        sock, _ = listener.accept()
        sock.settimeout(ACCEPT_SECONDS)
        data = b""
        while len(data) < HELLO.size:
            chunk = sock.recv(HELLO.size - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) == HELLO.size:
            role, said = HELLO.unpack(data)
            if said == epoch and role in roles and role not in got:
                got[role] = sock
                continue
        sock.close()
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, nargs=2, required=True)
    parser.add_argument("--hop", type=int, required=True)
    EngineOptions.add_arguments(parser)
    args = parser.parse_args(argv)
    options = attrs.evolve(EngineOptions.from_args(args), max_sessions=1)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(ACCEPT_SECONDS)

    def say(value: dict[str, Any]) -> None:
        print(json.dumps(value), flush=True)

    with ShardEngine(args.model, layers=tuple(args.layers), **options.engine_kwargs()) as engine:
        say({"port": listener.getsockname()[1]})
        link: NativeLink | None = None
        epoch = 0
        for line in sys.stdin:
            command = json.loads(line)
            if "run" in command:
                if link is not None:
                    link.close()
                    engine.close_session(SESSION, epoch)
                epoch = int(command["run"])
                engine.open_session(SESSION, epoch)
                out = hello(b"i", epoch, int(command["out"]))
                ring_out = None
                if command.get("ring_out") is not None:
                    ring_out = hello(b"r", epoch, int(command["ring_out"]))
                roles = {b"i", b"r"} if command.get("ring_in") else {b"i"}
                inbound = accept(listener, epoch, roles)
                sockets = LinkSockets(inbound[b"i"], out, inbound.get(b"r"), ring_out)
                link = engine.start_link(SESSION, epoch, hop=args.hop, sockets=sockets)
                say({"ready": epoch})
            elif "stats" in command:
                assert link is not None, "stats before a run"
                stats = link.stats()
                say({**attrs.asdict(stats), "state": stats.state.name})
        if link is not None:
            link.close()
    listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
