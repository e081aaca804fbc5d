"""The wire against a hostile client (issue 28, items 4 and 6): what a caller sends is refused
as the caller's, and never makes a healthy worker look faulty.

Two real ``dgr worker`` processes serve the tiny-llama as a two-stage route; an honest session
is relayed across them by hand (one step between every hostile call) and must produce the whole
model's tokens. A hostile client sends frames with enum values the schema does not define (a
boundary dtype of 77, a row kind of 77, ...), over ``Forward``, ``ForwardStream`` and the chained
``ChainStream``, and session ids that break the shared rule (a newline, a non-ASCII letter,
empty, too long) to every RPC that takes one. Each is refused INVALID_ARGUMENT with
``dgr-status: DGR_E_FRAME`` (the dtype 77 got INTERNAL ``DGR_E_INTERNAL`` with a traceback in the
log and moved ``recent_errors`` 0 -> 10); the workers' advertised health stays at 0 errors; no
traceback reaches their logs; and a newline in a session id never writes a line of its own
into a worker's log, not even on a worker that requires grants.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.security.grants import public_pem
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.wire.frames import Expectations, encode_forward, expectations_to_proto
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import STATUS_KEY
from tests.harness import run

T = TypeVar("T")
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=128, n_batch=32, max_sessions=4)
ARGS = ["--max-sessions", "16", "--admission-wait", "0"]
PROMPT = [5, 17, 2, 99, 41]
STEPS = 40
FORGED = "FORGED-LINE 12:00:00.000 INFO    stage=0:4 session=victim epoch=1 step=- session opened"
BAD_SESSION_IDS = {
    "newline": "evil\n" + FORGED,
    "carriage return": "evil\r" + FORGED,
    "non-ascii": "sessi\u00f3n",
    "space": "a b",
    "empty": "",
    "too long": "x" * 129,
}


@pytest.fixture(scope="module")
def stages(tiny_llama: Path) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    with (
        WorkerProcess.spawn(tiny_llama, (0, 2), options=OPTIONS, extra_args=ARGS) as first,
        WorkerProcess.spawn(tiny_llama, (2, 4), options=OPTIONS, extra_args=ARGS) as last,
    ):
        yield first, last


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[int]:
    ((tokens, _),) = whole_model_reference(tiny_llama, [PROMPT], STEPS, OPTIONS)
    return tokens


class Honest:
    """A session relayed by hand over the two stages, one token per :meth:`step`."""

    def __init__(self, stages: tuple[WorkerProcess, WorkerProcess], session_id: str) -> None:
        self.addresses = [stage.address for stage in stages]
        self.session_id = session_id
        self.tokens: list[int] = []
        self.clients: list[ShardClient] = []
        self.expect: list[Expectations] = []

    async def __aenter__(self) -> Honest:
        for address in self.addresses:
            client = ShardClient(address, timeout=20.0, streaming=False)
            await client.__aenter__()
            self.clients.append(client)
            self.expect.append(expectations_of(await client.describe()))
            await client.open(self.session_id, 1, self.expect[-1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self.clients:
            await client.close(self.session_id, 1)
            await client.aclose()

    async def step(self) -> None:
        if len(self.tokens) >= STEPS:
            return
        if not self.tokens:
            rows, at = PROMPT, 0
        else:
            rows, at = [self.tokens[-1]], len(PROMPT) + len(self.tokens) - 1
        positions = range(at, at + len(rows))
        step = len(self.tokens)
        first, last = self.clients
        mid = await first.forward(self.session_id, 1, step, self.expect[0], positions, tokens=rows)
        out = await last.forward(
            self.session_id, 1, step, self.expect[1], positions, boundary=mid.output
        )
        self.tokens.append(int(np.argmax(out.output[-1])))


def status_of(error: grpc.aio.AioRpcError) -> str | None:
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


async def health(address: str) -> tuple[int, int]:
    async with ShardClient(address, timeout=10.0) as client:
        advert = await client.describe()
    return advert.health.recent_errors, advert.health.total_errors


async def raw_open(address: str, session_id: str, expect: pb.Expectations) -> bytes:
    """Opens ``session_id`` at epoch 1 by a raw call; its session secret."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary("/dgr.shard.v1.Shard/OpenSession")
        request = pb.OpenSessionRequest(session_id=session_id, epoch=1, expect=expect)
        reply = pb.OpenSessionReply.FromString(
            await call(request.SerializeToString(), timeout=10.0)
        )
    return bytes(reply.session_secret)


async def refused(address: str, service: str, method: str, *messages: Any) -> grpc.aio.AioRpcError:
    """Sends ``messages`` to ``method`` (unary when one message and the method is unary);
    the refusal (``AssertionError`` if the call was answered)."""
    path = f"/dgr.shard.v1.{service}/{method}"
    payloads = [m.SerializeToString() for m in messages]
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            if method in ("ForwardStream", "ChainStream"):
                async for _ in channel.stream_stream(path)(iter(payloads), timeout=10.0):
                    pass
            elif method == "ChainOutput":
                async for _ in channel.unary_stream(path)(payloads[0], timeout=10.0):
                    pass
            else:
                await channel.unary_unary(path)(payloads[0], timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            return exc
    raise AssertionError(f"{method} answered {messages!r}")


def assert_the_callers_refusal(error: grpc.aio.AioRpcError, *needles: str) -> None:
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert status_of(error) == "DGR_E_FRAME", error
    for needle in needles:
        assert needle in (error.details() or ""), error


def assert_no_tracebacks(*workers: WorkerProcess) -> None:
    for worker in workers:
        log = worker.stderr_text()
        assert "Traceback" not in log and "DGR_E_INTERNAL" not in log, log[-4000:]


def spoiled(
    session_id: str, secret: bytes, expect: Expectations, field: str, value: int
) -> pb.ForwardRequest:
    """An otherwise correct frame of ``session_id`` for the last stage, ``field`` set to
    ``value``."""
    rows = np.ones((1, expect.boundary_width), dtype=np.float32)
    request = encode_forward(
        session_id, 1, 0, expect, [0], boundary=rows, session_secret=secret, kind="prefill"
    )
    if field == "dtype":
        request.boundary.dtype = value  # type: ignore[assignment]  # an open enum: any int32
    else:
        request.kind = value  # type: ignore[assignment]
    return request


UNDEFINED = [("dtype", 77), ("dtype", -1), ("dtype", 2**31 - 1), ("kind", 77), ("kind", -7)]


def test_undefined_enum_values_are_the_callers_refusal_and_an_honest_session_stays_exact(
    stages: tuple[WorkerProcess, WorkerProcess], want: list[int]
) -> None:
    first, last = stages

    async def scenario() -> None:
        assert await health(last.address) == (0, 0)
        async with (
            Honest(stages, "honest-enums") as honest,
            grpc.aio.insecure_channel(last.address) as channel,
        ):
            await honest.step()
            expect = honest.expect[1]
            secret = await raw_open(last.address, "attacker", expectations_to_proto(expect))
            # the attacker's output stream on the last stage, so that its chained frames are
            # taken there (and checked like any frame)
            output = channel.unary_stream("/dgr.shard.v1.Chain/ChainOutput")(
                pb.ChainOutputRequest(
                    session_id="attacker", epoch=1, session_secret=secret
                ).SerializeToString(),
                timeout=60.0,
            )
            assert await output.read() == b""  # registered (an empty first message)
            for field, value in UNDEFINED:
                frame = spoiled("attacker", secret, expect, field, value)
                for service, method in (
                    ("Shard", "Forward"),
                    ("Shard", "ForwardStream"),
                    ("Chain", "ChainStream"),
                ):
                    error = await refused(last.address, service, method, frame)
                    assert_the_callers_refusal(error, f"{field} {value} is not defined by schema 1")
                    if method == "ChainStream":  # the refusing stage is named: this one
                        assert dict(error.trailing_metadata() or ())["dgr-chain-hop"] == "0"
                    await honest.step()
            output.cancel()
            # a defined dtype that schema 1 does not carry: refused, named, not counted either
            frame = spoiled("attacker", secret, expect, "dtype", pb.DTYPE_F16)
            error = await refused(last.address, "Shard", "Forward", frame)
            assert_the_callers_refusal(error, "dtype DTYPE_F16 not supported")
            while len(honest.tokens) < STEPS:
                await honest.step()
            assert honest.tokens == want
        for stage in stages:
            assert await health(stage.address) == (0, 0)  # the caller's doing: no fault

    run(scenario(), limit=120.0)
    assert first.proc.poll() is None and last.proc.poll() is None
    assert_no_tracebacks(first, last)


def _requests(session_id: str, expect: Expectations) -> dict[str, tuple[str, Any]]:
    """A request naming ``session_id`` for every RPC that takes a session id."""
    rows = np.ones((1, expect.boundary_width), dtype=np.float32)
    frame = encode_forward(session_id, 1, 0, expect, [0], boundary=rows)
    hop = pb.ChainHop(endpoint="127.0.0.1:9", expect=expectations_to_proto(expect))
    return {
        "OpenSession": (
            "Shard",
            pb.OpenSessionRequest(
                session_id=session_id, epoch=1, expect=expectations_to_proto(expect)
            ),
        ),
        "Forward": ("Shard", frame),
        "ForwardStream": ("Shard", frame),
        "CloseSession": ("Shard", pb.CloseSessionRequest(session_id=session_id, epoch=1)),
        "Usage": ("Shard", pb.UsageRequest(session_id=session_id)),
        "Link": ("Chain", pb.LinkRequest(session_id=session_id, epoch=1, next=hop)),
        "ChainOutput": ("Chain", pb.ChainOutputRequest(session_id=session_id, epoch=1)),
        "ChainStream": ("Chain", frame),
    }


def test_session_ids_that_break_the_rule_are_refused_at_every_rpc_and_forge_no_log_line(
    stages: tuple[WorkerProcess, WorkerProcess], want: list[int]
) -> None:
    first, last = stages

    async def scenario() -> None:
        async with Honest(stages, "honest-ids") as honest:
            await honest.step()
            for what, session_id in BAD_SESSION_IDS.items():
                for method, (service, request) in _requests(session_id, honest.expect[1]).items():
                    error = await refused(last.address, service, method, request)
                    assert_the_callers_refusal(error, "invalid session id")
                    await honest.step()
                assert (what, await health(last.address)) == (what, (0, 0))
            while len(honest.tokens) < STEPS:
                await honest.step()
            assert honest.tokens == want

    run(scenario(), limit=120.0)
    assert_no_tracebacks(first, last)
    log = wait_for_line(last, "evil\\n" + FORGED)
    assert not [line for line in log if FORGED in line and "evil\\" not in line], log
    assert not [line for line in log if line.startswith("FORGED-LINE")]


def wait_for_line(worker: WorkerProcess, needle: str, limit: float = 10.0) -> list[str]:
    """The worker's log lines, once one holds ``needle`` (bounded: ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while True:
        lines = worker.stderr_text().splitlines()
        if any(needle in line for line in lines):
            return lines
        assert time.monotonic() < deadline, f"no log line holds {needle!r}:\n" + "\n".join(lines)
        time.sleep(0.05)


def test_a_newline_session_id_forges_no_log_line_on_a_worker_that_requires_grants(
    tiny_llama: Path, tmp_path: Path
) -> None:
    pem = tmp_path / "tracker.pem"
    pem.write_bytes(public_pem(Ed25519PrivateKey.generate()))
    args = [*ARGS, "--grant-key", f"k1={pem}"]
    with WorkerProcess.spawn(tiny_llama, (0, 4), options=OPTIONS, extra_args=args) as worker:

        async def scenario() -> None:
            async with ShardClient(worker.address, timeout=10.0) as client:
                expect = expectations_to_proto(expectations_of(await client.describe()))
            request = pb.OpenSessionRequest(
                session_id=BAD_SESSION_IDS["newline"], epoch=1, expect=expect
            )
            error = await refused(worker.address, "Shard", "OpenSession", request)
            assert_the_callers_refusal(error, "invalid session id", "'\\n'")
            # a valid id without a grant: refused for the grant, one line bound to its id
            request = pb.OpenSessionRequest(session_id="no-grant", epoch=1, expect=expect)
            error = await refused(worker.address, "Shard", "OpenSession", request)
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED, error
            assert await health(worker.address) == (0, 0)

        run(scenario())
        lines = wait_for_line(worker, "session=no-grant ")
        lines = wait_for_line(worker, "evil\\n" + FORGED)
    assert not [line for line in lines if line.startswith("FORGED-LINE")], lines
    (refusal,) = [line for line in lines if FORGED in line]
    assert "open refused: INVALID_ARGUMENT" in refusal and "session=evil\\nFORGED" in refusal
    assert "Traceback" not in "\n".join(lines)


def test_a_chain_hop_out_of_range_is_the_callers_refusal(
    stages: tuple[WorkerProcess, WorkerProcess], want: list[int]
) -> None:
    """A chained frame's ``chain_hop`` is the caller's to give; one that cannot be a stage's
    index (the largest uint32 would overflow the next frame's) is a malformed frame, refused
    before the rows run, on a stage linked to the next one."""
    first, last = stages

    async def scenario() -> None:
        async with Honest(stages, "honest-hops") as honest:
            await honest.step()
            e0, e1 = (expectations_to_proto(e) for e in honest.expect)
            secrets = [await raw_open(first.address, "hopper", e0)]
            secrets.append(await raw_open(last.address, "hopper", e1))
            link = pb.LinkRequest(
                session_id="hopper",
                epoch=1,
                session_secret=secrets[0],
                next=pb.ChainHop(endpoint=last.address, expect=e1, session_secret=secrets[1]),
            )
            async with grpc.aio.insecure_channel(first.address) as channel:
                await channel.unary_unary("/dgr.shard.v1.Chain/Link")(
                    link.SerializeToString(), timeout=10.0
                )
            for hop in (2**32 - 1, (1 << 16) + 1):
                frame = encode_forward(
                    "hopper", 1, 0, honest.expect[0], range(3), tokens=[5, 6, 7],
                    session_secret=secrets[0],
                )  # fmt: skip
                frame.chain_hop = hop
                error = await refused(first.address, "Chain", "ChainStream", frame)
                assert_the_callers_refusal(error, f"chain_hop {hop} is over")
                await honest.step()
            while len(honest.tokens) < STEPS:
                await honest.step()
            assert honest.tokens == want
        for stage in stages:
            assert await health(stage.address) == (0, 0)

    run(scenario(), limit=120.0)
    assert_no_tracebacks(first, last)
