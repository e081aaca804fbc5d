"""A ring of native links (``docs/native-link.md``) as a benchmark contender: one process per
stage (:mod:`benchmarks.link_stage`, a shard engine whose session's frames run on the native
link's thread), connected over 127.0.0.1, and this process as the client
(``client.link_route.LinkRoute``). ``benchmarks.peers --transports native`` times it beside
whole-model llama.cpp, llama.cpp RPC and dgr's other data paths, in the same rounds.

The stages are driven by this harness, not by ``dgr worker``'s control plane: the native link
is not yet offered by workers (issue 32), so what this measures is the data path itself, one
session epoch per run, with the same engines, layer split and settings as the other rows.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.first_token import TimedRun
from benchmarks.link_stage import HELLO
from benchmarks.pipeline import RouteRun
from dgr_engine.client.link_route import LinkRoute
from dgr_engine.options import EngineOptions

__all__ = ["NativeRingBench", "native_token_parts"]

_LINE_SECONDS = 120.0
"""Longest wait for a stage's answer (its engine's load included)."""
_TURN_SECONDS = 120.0


class NativeRingBench:
    """A ring of ``layout``'s stages over native links, kept up across runs (each run a new
    session epoch) so that its runs interleave with the other contenders'."""

    def __init__(
        self, path: Path, layout: Sequence[tuple[int, int]], options: EngineOptions
    ) -> None:
        self.path, self.layout, self.options = path, list(layout), options
        self.stages = len(layout)
        self._procs: list[asyncio.subprocess.Process] = []
        self._ports: list[int] = []
        self._epoch = 0

    async def start(self) -> None:
        for hop, (begin, end) in enumerate(self.layout):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "benchmarks.link_stage",
                "--model",
                str(self.path),
                "--layers",
                str(begin),
                str(end),
                "--hop",
                str(hop),
                *self.options.worker_argv(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            self._procs.append(proc)
        for proc in self._procs:
            self._ports.append(int((await self._read(proc))["port"]))

    async def _read(self, proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), _LINE_SECONDS)
        if not line:
            raise RuntimeError(f"a link stage ended (exit {await proc.wait()})")
        value: dict[str, Any] = json.loads(line)
        return value

    async def _say(self, proc: asyncio.subprocess.Process, command: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(command) + "\n").encode())
        await proc.stdin.drain()

    async def _stats(self) -> list[dict[str, Any]]:
        for proc in self._procs:
            await self._say(proc, {"stats": True})
        return [await self._read(proc) for proc in self._procs]

    async def timed_run(self, prompt: list[int], n_decode: int) -> TimedRun:
        """One greedy run on a new epoch: the prompt and its token (the prefill, timed to the
        first token), then ``n_decode`` tokens the ring makes by itself (the decode)."""
        self._epoch += 1
        epoch, n = self._epoch, self.stages
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(_LINE_SECONDS)
        first: socket.socket | None = None
        output: socket.socket | None = None
        try:
            out_port = listener.getsockname()[1]
            for hop, proc in enumerate(self._procs):
                last = hop == n - 1
                await self._say(
                    proc,
                    {
                        "run": epoch,
                        "out": out_port if last else self._ports[hop + 1],
                        "ring_out": self._ports[0] if last else None,
                        "ring_in": hop == 0,
                    },
                )
            first = await asyncio.to_thread(
                socket.create_connection, ("127.0.0.1", self._ports[0]), _LINE_SECONDS
            )
            first.sendall(HELLO.pack(b"i", epoch))
            accepted, _ = await asyncio.to_thread(listener.accept)
            output = accepted
            accepted.settimeout(_LINE_SECONDS)
            said = await asyncio.to_thread(accepted.recv, HELLO.size, socket.MSG_WAITALL)
            if len(said) != HELLO.size or HELLO.unpack(said) != (b"i", epoch):
                raise RuntimeError(f"the last stage introduced itself as {said!r}")
            for proc in self._procs:
                ready = await self._read(proc)
                if ready.get("ready") != epoch:
                    raise RuntimeError(f"a link stage answered {ready}")
            route = LinkRoute(first, accepted, epoch, ring=True)
            prefill = await asyncio.to_thread(route.generate, prompt, 0, 1, timeout=_TURN_SECONDS)
            before = await self._stats()
            decode = await asyncio.to_thread(
                route.generate,
                [prefill.tokens[-1]],
                prefill.next_pos,
                n_decode,
                timeout=_TURN_SECONDS,
            )
            after = await self._stats()
        finally:
            for sock in (first, output, listener):
                if sock is not None:
                    sock.close()
        run = RouteRun(
            prefill.seconds,
            decode.seconds,
            [*prefill.tokens, *decode.tokens],
            [],
            prefill.seconds,
            native_token_parts(before, after, decode.seconds, n_decode),
        )
        return TimedRun(run, prefill.seconds)

    async def aclose(self) -> None:
        for proc in self._procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self._procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        self._procs.clear()


def native_token_parts(
    before: Sequence[dict[str, Any]],
    after: Sequence[dict[str, Any]],
    decode_s: float,
    n_decode: int,
) -> dict[str, float]:
    """A native ring's decode token, ms, from its stages' counters: the engines (all inside
    llama.cpp: no Python around the call, though a wait for the engine's lock would count),
    the links' own work (a frame's checks, copies and sends), the transit (the rest of the
    wall time: the sockets and each stage's wake-up); the client is off the ring's path."""
    engine = sum(a["engine_ns"] - b["engine_ns"] for a, b in zip(after, before, strict=True))
    busy = sum(a["busy_ns"] - b["busy_ns"] for a, b in zip(after, before, strict=True))
    wall = 1000 * decode_s / n_decode
    engine_ms, busy_ms = engine / 1e6 / n_decode, busy / 1e6 / n_decode
    return {
        "engine": engine_ms,
        "llama.cpp": engine_ms,
        "worker": busy_ms - engine_ms,
        "transit": wall - busy_ms,
        "client": 0.0,
    }
