"""One session, followed across stages (issue 17, part 3): every call carries the session id,
epoch and step in gRPC metadata, and the logs of every worker and of the client bind them, so
that a grep of one session id over all logs gives its whole story."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from loguru import logger

from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.client.shard_client import ShardClient
from dgr_engine.errors import ShardUnavailable
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.wire.frames import Expectations
from dgr_session import SessionState
from tests.harness import run_session

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)


def test_every_call_carries_the_session_in_its_metadata() -> None:
    seen: list[tuple[str, dict[str, str]]] = []

    def handler(method: str) -> grpc.RpcMethodHandler:
        async def answer(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            seen.append((method, dict(context.invocation_metadata() or ())))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "recorded")
            raise AssertionError("unreachable")

        return grpc.unary_unary_rpc_method_handler(answer)

    async def scenario() -> None:
        server = grpc.aio.server()
        generic = grpc.method_handlers_generic_handler(
            "dgr.shard.v1.Shard",
            {name: handler(name) for name in ("OpenSession", "CloseSession", "Forward")},
        )
        server.add_generic_rpc_handlers((generic,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            expect = Expectations(b"\0" * 32, 0, 4, 0)
            async with ShardClient(f"127.0.0.1:{port}", timeout=5.0, streaming=False) as client:
                for call in (
                    client.open("story", 3, expect),
                    client.forward("story", 3, 7, expect, [0], tokens=[1]),
                    client.close("story", 3),
                ):
                    with pytest.raises(ShardUnavailable):
                        await call
        finally:
            await server.stop(0)

    asyncio.run(scenario())
    assert [m for m, _ in seen] == ["OpenSession", "Forward", "CloseSession"]
    for _, metadata in seen:
        assert metadata["dgr-session"] == "story" and metadata["dgr-epoch"] == "3"
    assert seen[1][1]["dgr-step"] == "7"


@pytest.mark.usefixtures("certified_fixtures")
def test_grep_of_a_session_id_tells_its_story_on_every_worker_and_the_client(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_to_stderr("DEBUG")  # the programs' sink, on this process's stderr
    provider = LoopbackRouteProvider(
        tiny_llama, [(0, 2), (2, 4)], options=OPTIONS, worker_args=["--log-level", "DEBUG"]
    )

    try:
        result = run_session(provider, [5, 6, 7], 4, session_id="story")
        assert result.state is SessionState.DONE
    finally:
        logger.remove()
        logger.disable("dgr_session")  # as the libraries leave it
        logger.disable("dgr_engine")
    client = [line for line in capsys.readouterr().err.splitlines() if "session=story " in line]
    assert any(re.search(r"new -> opening on route_assigned", line) for line in client), client
    assert any("decoding -> done on finished" in line for line in client), client
    for worker in provider.workers:
        lines = [
            line for line in worker.process.stderr_text().splitlines() if "session=story " in line
        ]
        assert any("session opened" in line for line in lines), lines
        forwards = [line for line in lines if " forward " in line]
        assert len(forwards) == 4 and all("epoch=1" in line for line in forwards), lines
        assert re.search(r"step=0 .*forward 3 rows \(prefill\)", forwards[0]), forwards
        assert any("session closed" in line for line in lines), lines


def test_a_line_break_in_a_bound_field_never_forges_a_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log_to_stderr("INFO")  # the programs' sink, on this process's stderr
    forged = "12:00:00.000 INFO    stage=0:4 session=victim epoch=1 step=- session opened"
    try:
        logger.bind(session=f"evil\n{forged}", stage="0:4\r\x1b[2K").info("one line")
    finally:
        logger.remove()
        logger.configure(patcher=None)
        logger.disable("dgr_session")  # as the libraries leave it
        logger.disable("dgr_engine")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert f"session=evil\\n{forged} " in lines[0] and "stage=0:4\\r\\x1b[2K " in lines[0]
    assert lines[0].endswith("one line")
