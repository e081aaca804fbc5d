"""Shard workers as real processes on 127.0.0.1, driven over gRPC.

Every worker is a ``dgr worker`` subprocess on port 0 (its LISTENING line gives the port), stopped
in fixture teardown; every wait is bounded (client deadlines, process timeouts, ``run``'s limit).
Logits are compared bit for bit with the whole model run in-process by ``ShardEngine`` with the
same engine options.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine import errors as E
from dgr_engine._binding import LLAMA_COMMIT, PATCH_STACK_SHA256
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.errors import FrameRejected, ShardUnavailable
from dgr_engine.reference import InProcessRoute
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.wire.frames import Expectations, encode_forward
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import STATUS_KEY
from dgr_session.identity import CertificationStatus, EvidenceClass
from tests import harness

pytestmark = pytest.mark.slow

PROMPT = [int(t) for t in (np.arange(16) * 37 + 11) % 256]
N_STEPS = 16
ENGINE_KW: dict[str, Any] = {
    "max_sessions": 4,
    "n_ctx_per_session": 256,
    "n_threads": 1,
    "n_batch": 64,
    "n_ubatch": 64,
}
WORKER_ARGS = ["--max-sessions", "4", "--ctx", "256", "--threads", "1", "--batch", "64"]
CALL_TIMEOUT = 20.0
TWO = ((0, 2), (2, 4))
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
NOT_FOUND = grpc.StatusCode.NOT_FOUND
FOUR = ((0, 1), (1, 2), (2, 3), (3, 4))

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], limit: float = 120.0) -> T:
    return harness.run(coro, limit)


def spawn(model: Path, layers: tuple[int, int], *args: str, port: int = 0) -> WorkerProcess:
    return WorkerProcess.spawn(model, layers, port=port, extra_args=[*WORKER_ARGS, *args])


# --- a route of workers, driven like InProcessRoute ----------------------------------------------


class GrpcRoute:
    """Clients for the stages of a route, relaying stage k's output into stage k + 1."""

    def __init__(self, clients: list[ShardClient], expects: list[Expectations]) -> None:
        self.clients = clients
        self.expects = expects

    @classmethod
    async def connect(cls, addresses: Sequence[str], *, streaming: bool = True) -> GrpcRoute:
        clients = [ShardClient(a, timeout=CALL_TIMEOUT, streaming=streaming) for a in addresses]
        expects = [expectations_of(await c.describe()) for c in clients]
        return cls(clients, expects)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def open(self, session: str, epoch: int) -> None:
        for client, expect in zip(self.clients, self.expects, strict=True):
            await client.open(session, epoch, expect)

    async def close(self, session: str, epoch: int) -> None:
        for client in self.clients:
            await client.close(session, epoch)

    async def forward(
        self,
        session: str,
        epoch: int,
        step: int,
        tokens: Sequence[int],
        start: int,
        *,
        all_logits: bool = False,
    ) -> np.ndarray:
        rows = None
        positions = range(start, start + len(tokens))
        last = len(self.clients) - 1
        for index, (client, expect) in enumerate(zip(self.clients, self.expects, strict=True)):
            result = await client.forward(
                session,
                epoch,
                step,
                expect,
                positions,
                tokens=tokens if index == 0 else None,
                boundary=rows,
                logit_rows=list(range(len(tokens))) if all_logits and index == last else None,
            )
            rows = result.output
        assert rows is not None
        return rows

    async def greedy(
        self, session: str, epoch: int, prompt: Sequence[int], n_steps: int
    ) -> tuple[list[int], list[np.ndarray]]:
        history = list(prompt)
        logits = [await self.forward(session, epoch, 0, history, 0, all_logits=True)]
        tokens: list[int] = []
        for step in range(1, n_steps + 1):
            token = int(np.argmax(logits[-1][-1]))
            tokens.append(token)
            logits.append(await self.forward(session, epoch, step, [token], len(history)))
            history.append(token)
        return tokens, logits


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> tuple[list[int], list[np.ndarray]]:
    """Whole-model greedy decode, in-process, with the workers' engine options."""
    with ShardEngine(tiny_llama, **ENGINE_KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        return chain.greedy(1, 0, PROMPT, N_STEPS)


@pytest.fixture(scope="module")
def routes(tiny_llama: Path) -> Iterator[dict[str, list[WorkerProcess]]]:
    """A 2-stage and a 4-stage route of worker processes, shared by the module's tests."""
    with ExitStack() as stack:
        out: dict[str, list[WorkerProcess]] = {}
        for name, cut in (("two", TWO), ("four", FOUR)):
            out[name] = [stack.enter_context(spawn(tiny_llama, layers)) for layers in cut]
        yield out


def addresses(workers: list[WorkerProcess]) -> list[str]:
    return [w.address for w in workers]


async def raw_forward(address: str, request: pb.ForwardRequest) -> tuple[grpc.StatusCode, str]:
    """Sends one unary Forward; returns the status code and dgr-status (``""`` if none)."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await shard_pb2_grpc.ShardStub(channel).Forward(request, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            meta = dict(exc.trailing_metadata() or ())
            return exc.code(), str(meta.get(STATUS_KEY, ""))
    return grpc.StatusCode.OK, ""


def assert_logits_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"logits differ at step {step}"


# --- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["two", "four"])
@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "unary"])
def test_parity_through_grpc(
    routes: dict[str, list[WorkerProcess]],
    reference: tuple[list[int], list[np.ndarray]],
    route: str,
    streaming: bool,
) -> None:
    async def scenario() -> tuple[list[int], list[np.ndarray]]:
        r = await GrpcRoute.connect(addresses(routes[route]), streaming=streaming)
        session = f"parity-{route}-{streaming}"
        try:
            await r.open(session, 0)
            result = await r.greedy(session, 0, PROMPT, N_STEPS)
            await r.close(session, 0)
            return result
        finally:
            await r.aclose()

    tokens, logits = run(scenario())
    assert tokens == reference[0]
    assert logits[0].shape == (len(PROMPT), 256)
    assert_logits_equal(logits, reference[1])


# --- refusals while another session goes on ----------------------------------------------------


def test_bad_frames_refused_while_a_concurrent_session_stays_exact(
    routes: dict[str, list[WorkerProcess]],
    reference: tuple[list[int], list[np.ndarray]],
    tiny_llama: Path,
) -> None:
    first, last = addresses(routes["two"])
    ref_tokens, ref_logits = reference

    async def scenario() -> list[tuple[str, grpc.StatusCode, str]]:
        r = await GrpcRoute.connect([first, last])
        await r.open("good", 0)
        await r.open("bad", 1)
        good = [await r.forward("good", 0, 0, PROMPT, 0, all_logits=True)]
        bad_prefill = await r.forward("bad", 1, 0, PROMPT, 0, all_logits=True)
        assert np.array_equal(bad_prefill, ref_logits[0])
        pos = len(PROMPT)
        e0, e1 = r.expects
        rows = np.zeros((1, 64), np.float32)
        # the frames carry the bad session's secrets: refused for what they are, not for those
        secrets = [client.session_secret("bad", 1) for client in r.clients]

        def at_last(session: str = "bad", epoch: int = 1, p: int = pos) -> pb.ForwardRequest:
            return encode_forward(
                session, epoch, 1, e1, [p], boundary=rows, session_secret=secrets[1]
            )

        def spoil(**changes: Any) -> pb.ForwardRequest:
            request = at_last()
            for field, value in changes.items():
                target, _, name = field.rpartition("__")
                setattr(getattr(request, target) if target else request, name, value)
            return request

        short = at_last()
        short.boundary.data = short.boundary.data[:-4]
        wide = at_last()
        del wide.boundary.shape[:]
        wide.boundary.shape.extend([2, 32])
        good_bf16 = spoil(session_id="good", epoch=0, boundary__dtype=pb.DTYPE_BF16)
        bad_token = encode_forward("bad", 1, 1, e0, [pos], tokens=[9999], session_secret=secrets[0])
        rows_on_first = encode_forward(
            "bad", 1, 1, e0, [pos], tokens=[1], boundary=rows, session_secret=secrets[0]
        )
        frame, expectation = (INVALID, "DGR_E_FRAME"), "DGR_E_EXPECTATION_"
        cases: list[tuple[str, str, pb.ForwardRequest, tuple[grpc.StatusCode, str]]] = [
            ("dtype", last, spoil(boundary__dtype=pb.DTYPE_F16), frame),
            ("shape", last, wide, frame),
            ("bytes", last, short, frame),
            (
                "model",
                last,
                spoil(expect__model_sha256=bytes(32)),
                (INVALID, expectation + "MODEL"),
            ),
            ("range", last, spoil(expect__layer_begin=1), (INVALID, expectation + "RANGE")),
            ("width", last, spoil(expect__boundary_width=65), (INVALID, expectation + "WIDTH")),
            ("schema", last, spoil(expect__schema_version=9), (INVALID, expectation + "SCHEMA")),
            ("position", last, at_last(p=pos + 3), (PRECONDITION, "DGR_E_POSITION")),
            ("unknown", last, at_last(session="nobody"), (NOT_FOUND, "DGR_E_UNKNOWN_SESSION")),
            ("unopened-epoch", last, at_last(epoch=7), (NOT_FOUND, "DGR_E_UNKNOWN_SESSION")),
            ("good-dtype", last, good_bf16, frame),
            ("token-range", first, bad_token, (INVALID, "DGR_E_INVALID_ARGUMENT")),
            ("rows-on-first", first, rows_on_first, frame),
        ]
        seen: list[tuple[str, grpc.StatusCode, str]] = []
        token_history = list(PROMPT)
        for step, (name, address, request, _) in enumerate(cases, start=1):
            # the good session's next step and a bad frame, concurrently on the same workers
            token = int(np.argmax(good[-1][-1]))
            logits, (code, status) = await asyncio.gather(
                r.forward("good", 0, step, [token], len(token_history)),
                raw_forward(address, request),
            )
            token_history.append(token)
            good.append(logits)
            seen.append((name, code, status))
        for step in range(len(cases) + 1, N_STEPS + 1):
            token = int(np.argmax(good[-1][-1]))
            good.append(await r.forward("good", 0, step, [token], len(token_history)))
            token_history.append(token)
        assert_logits_equal(good, ref_logits[: N_STEPS + 1])
        assert token_history[len(PROMPT) :] == ref_tokens[:N_STEPS]

        # the refused session itself lost nothing: its next step is the reference's
        bad_next = await r.forward("bad", 1, 1, [ref_tokens[0]], pos)
        assert np.array_equal(bad_next, ref_logits[1])

        # a newer epoch discards the old state; the old epoch is now stale everywhere
        await r.clients[1].open("bad", 2, e1)
        seen.append(("stale-forward", *await raw_forward(last, at_last(p=pos + 1))))
        with pytest.raises(E.StaleEpoch):
            await r.clients[1].open("bad", 1, e1)
        with pytest.raises(E.StaleEpoch):
            await r.clients[1].close("bad", 1)
        await r.close("good", 0)
        await r.clients[0].close("bad", 1)
        await r.clients[1].close("bad", 2)
        await r.aclose()
        got = {name: (code, status) for name, code, status in seen}
        assert {name: want for name, _, _, want in cases} == {name: got[name] for name, *_ in cases}
        return seen

    seen = run(scenario())
    assert ("stale-forward", PRECONDITION, "DGR_E_STALE_EPOCH") in seen


def test_typed_errors_through_the_client(routes: dict[str, list[WorkerProcess]]) -> None:
    """The client raises the engine's own exception types, over streams and unary calls."""
    first = addresses(routes["two"])[0]

    async def scenario() -> None:
        for streaming in (True, False):
            async with ShardClient(first, timeout=CALL_TIMEOUT, streaming=streaming) as c:
                expect = expectations_of(await c.describe())
                with pytest.raises(E.UnknownSession):
                    await c.forward("ghost", 0, 0, expect, [0], tokens=[1])
                with pytest.raises(E.UnknownSession):
                    await c.close("ghost", 0)
                await c.open("typed", 3, expect)
                with pytest.raises(E.PositionMismatch):
                    await c.forward("typed", 3, 0, expect, [5], tokens=[1])
                # after a refusal the session's stream is replaced transparently
                result = await c.forward("typed", 3, 1, expect, [0, 1], tokens=[1, 2])
                assert result.next_pos == 2 and result.output.shape == (2, 64)
                with pytest.raises(E.StaleEpoch):
                    await c.forward("typed", 2, 2, expect, [2], tokens=[3])
                await c.close("typed", 3)

    run(scenario())


# --- capacity, context, message size -----------------------------------------------------------


def test_capacity_context_and_size_limits(tiny_llama: Path) -> None:
    with spawn(tiny_llama, (0, 4), "--max-sessions", "2", "--ctx", "32") as worker:

        async def scenario() -> None:
            async with ShardClient(worker.address, timeout=CALL_TIMEOUT) as c:
                advert = await c.describe()
                expect = expectations_of(advert)
                ctx = advert.capacity.context_per_session  # llama.cpp rounds --ctx up
                await c.open("a", 0, expect)
                await c.open("b", 0, expect)
                with pytest.raises(E.CapacityExceeded):
                    await c.open("c", 0, expect)
                code = await raw_open(worker.address, "c", expect)
                assert code == (grpc.StatusCode.RESOURCE_EXHAUSTED, "DGR_E_CAPACITY")
                for step, start in enumerate(range(0, ctx, 64)):
                    await c.forward("a", 0, step, expect, range(start, start + 64), tokens=[1] * 64)
                with pytest.raises(E.ContextFull):
                    await c.forward("a", 0, 99, expect, [ctx], tokens=[1])
                secret = c.session_secret("a", 0)  # the frame is refused for its size alone
                request = encode_forward(
                    "a", 0, 99, expect, [ctx], tokens=[1], session_secret=secret
                )
                assert await raw_forward(worker.address, request) == (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "DGR_E_CONTEXT_FULL",
                )
                # over the worker's message size limit: refused by gRPC itself
                n = 40000
                huge = encode_forward("b", 0, 0, expect, range(n), tokens=[1] * n)
                code, status = await raw_forward(worker.address, huge)
                assert (code, status) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "")
                with pytest.raises(FrameRejected) as info:
                    await c.forward("b", 0, 0, expect, range(n), tokens=[1] * n)
                assert info.value.status == "DGR_E_MESSAGE_SIZE"
                await c.close("b", 0)
                await c.open("c", 0, expect)  # the freed slot is usable
                advert = await c.describe()
                assert advert.capacity.sessions_open == 2
                assert advert.capacity.kv_tokens_free == 2 * ctx - ctx
                assert advert.health.total_errors == 0  # refusals of callers' frames: not faults

        run(scenario())
        assert worker.stop() == 0


async def raw_open(address: str, session: str, expect: Expectations) -> tuple[grpc.StatusCode, str]:
    from dgr_engine.wire.frames import expectations_to_proto

    async with grpc.aio.insecure_channel(address) as channel:
        request = pb.OpenSessionRequest(
            session_id=session, epoch=0, expect=expectations_to_proto(expect)
        )
        try:
            await shard_pb2_grpc.ShardStub(channel).OpenSession(request, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), str(dict(exc.trailing_metadata() or ()).get(STATUS_KEY, ""))
    return grpc.StatusCode.OK, ""


# --- advert and health -------------------------------------------------------------------------


def test_describe_and_health(routes: dict[str, list[WorkerProcess]], tiny_llama: Path) -> None:
    first, last = addresses(routes["two"])

    async def scenario() -> None:
        async with ShardClient(first, timeout=CALL_TIMEOUT) as c:
            assert await c.serving()
            advert = await c.describe()
            assert advert.identity.content_hash == hashlib.sha256(tiny_llama.read_bytes()).digest()
            assert (advert.identity.arch, advert.identity.n_layer) == ("llama", 4)
            assert advert.recipe.quant_types == ("F32",) and advert.recipe.context == 256
            assert advert.lane.llama_cpp_commit == LLAMA_COMMIT
            assert (
                advert.lane.patch_stack_hash == PATCH_STACK_SHA256 and len(PATCH_STACK_SHA256) == 32
            )
            assert advert.lane.backend == "cpu"
            # dark, or certified by a fixture record this run made (which of the two depends on
            # whether a test certified the lane before this worker started)
            lane = advert.lane
            assert len(lane.lane_id) == 64
            if lane.certification is CertificationStatus.DARK:
                assert lane.evidence is None and lane.record_id == ""
            else:
                assert lane.evidence is EvidenceClass.FIXTURE and len(lane.record_id) == 64
            assert (advert.span.layer_begin, advert.span.layer_end) == (0, 2)
            assert advert.span.is_first and not advert.span.is_last
            assert (advert.seam.width_in, advert.seam.width_out) == (0, 64)
            assert advert.seam.bytes_per_token_in == 8 and advert.seam.bytes_per_token_out == 256
            before = advert.capacity
            expect = expectations_of(advert)
            await c.open("describe", 0, expect)
            await c.forward("describe", 0, 0, expect, range(5), tokens=[1, 2, 3, 4, 5])
            after = await c.describe()
            assert after.capacity.sessions_open == before.sessions_open + 1
            assert after.capacity.kv_tokens_free == before.kv_tokens_free - 5
            assert after.load.rows_per_second > 0
            await c.close("describe", 0)
        async with ShardClient(last, timeout=CALL_TIMEOUT) as c:
            advert = await c.describe()
            assert advert.span.is_last and advert.seam.width_out == 256

    run(scenario())


# --- restarts and shutdown ---------------------------------------------------------------------


def test_restarted_worker_holds_no_old_session_state(
    tiny_llama: Path, reference: tuple[list[int], list[np.ndarray]]
) -> None:
    with ExitStack() as stack:
        worker = stack.enter_context(spawn(tiny_llama, (0, 4)))
        port = worker.port

        async def before_crash() -> None:
            r = await GrpcRoute.connect([worker.address])
            await r.open("s", 0)
            await r.forward("s", 0, 0, PROMPT, 0)
            worker.kill()  # a crash: nothing is closed
            with pytest.raises(ShardUnavailable):
                await r.forward("s", 0, 1, [1], len(PROMPT))
            await r.aclose()

        run(before_crash())
        restarted = stack.enter_context(spawn(tiny_llama, (0, 4), port=port))
        assert restarted.port == port

        async def after_restart() -> None:
            r = await GrpcRoute.connect([restarted.address])
            advert = await r.clients[0].describe()
            assert advert.capacity.sessions_open == 0
            assert advert.capacity.kv_tokens_free == 4 * 256
            with pytest.raises(E.UnknownSession):
                await r.forward("s", 0, 1, [1], len(PROMPT))
            await r.open("s", 0)  # same id and epoch: a fresh session at position 0
            with pytest.raises(E.PositionMismatch):
                await r.forward("s", 0, 1, [1], len(PROMPT))
            assert np.array_equal(
                await r.forward("s", 0, 0, PROMPT, 0, all_logits=True), reference[1][0]
            )
            with pytest.raises(E.UnknownSession):
                await r.close("t", 0)  # nothing of the old process is there to close
            await r.aclose()

        run(after_restart())


def test_sigterm_closes_every_session_and_exits_zero(tiny_llama: Path) -> None:
    worker = spawn(tiny_llama, (0, 2))
    try:

        async def scenario() -> None:
            c = ShardClient(worker.address, timeout=CALL_TIMEOUT)
            expect = expectations_of(await c.describe())
            await c.open("x", 0, expect)
            await c.open("y", 5, expect)
            await c.forward("x", 0, 0, expect, range(3), tokens=[1, 2, 3])  # its stream stays open
            code = worker.stop()  # SIGTERM, bounded wait
            assert code == 0
            with pytest.raises(ShardUnavailable):
                await c.describe(timeout=5.0)
            await c.aclose()

        run(scenario())
    finally:
        worker.stop()
    assert worker.stdout_lines[-1] == "STOPPED sessions_closed=2"
    assert "closed 2 session(s) and the engine" in worker.stderr_text()


# --- the command line --------------------------------------------------------------------------


def test_cli_refuses_a_missing_model(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited with 2"):
        WorkerProcess.spawn(tmp_path / "missing.gguf", (0, 2), startup_timeout=60)


def test_cli_fixtures_delegates(capsys: pytest.CaptureFixture[str]) -> None:
    from dgr_engine.cli import main

    assert main(["fixtures", "list"]) == 0
    assert "tiny-llama" in capsys.readouterr().out
