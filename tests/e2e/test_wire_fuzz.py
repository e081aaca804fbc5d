"""The wire under hostile input (issue 12, item 4 and the wire fuzzers).

A real ``dgr worker`` serving the whole tiny-llama. Bytes that are not a valid message get
INVALID_ARGUMENT with ``dgr-status: DGR_E_FRAME`` on every RPC (they got ``UNKNOWN`` with no
trailer). Then hypothesis sends raw bytes and generated messages to every RPC, ForwardStream
included, and to the ``Chain`` service's: never a crash, never ``UNKNOWN``, every refusal
carries a ``dgr-status`` and none is ``DGR_E_INTERNAL`` (enum fields take any int32, defined or
not: issue 28's dtype 77); a victim session decodes on the same worker between the examples and
keeps producing the whole model's tokens; and nothing the fuzzer sends counts against the
worker's advertised health (``total_errors`` stays 0).
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgr_engine import ShardEngine
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.wire.advert import Advert
from dgr_engine.wire.frames import (
    Expectations,
    encode_forward,
    expectations_to_proto,
    output_from_reply,
)
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import STATUS_KEY
from tests import harness
from tests.harness import WORKER_OPTIONS

pytestmark = pytest.mark.slow

T = TypeVar("T")
OPTIONS = WORKER_OPTIONS
# more slots than the victims and the fuzzed opens need (slots do not change results)
ARGS = [*OPTIONS.worker_argv(), "--max-sessions", "64", "--admission-wait", "0"]
PROMPT = [7, 1, 200, 33, 90]
VICTIM_STEPS = 200
METHODS = {
    "Describe": "unary",
    "OpenSession": "unary",
    "Forward": "unary",
    "CloseSession": "unary",
    "ForwardStream": "stream",
    "Usage": "unary",
    "Link": "unary",
    "ChainOutput": "server-stream",
    "ChainStream": "stream",
}
SERVICE = {"Link": "Chain", "ChainOutput": "Chain", "ChainStream": "Chain"}
INT32 = st.integers(-(2**31), 2**31 - 1)
GARBAGE = b"\xff\xff\xff\xff"  # a field tag whose varint never ends: no message parses it
EXAMPLES = 100  # per strategy (raw bytes, and messages per request type)


def run(coro: Coroutine[Any, Any, T], limit: float = 30.0) -> T:
    return harness.run(coro, limit)


@pytest.fixture(scope="module")
def worker(tiny_llama: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess.spawn(tiny_llama, (0, 4), extra_args=ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[int]:
    ((tokens, _),) = whole_model_reference(tiny_llama, [PROMPT], VICTIM_STEPS, OPTIONS)
    return tokens


class Victim:
    """A session decoding on the fuzzed worker, one step per call of :meth:`step` (each in a
    loop of its own, so each with a channel of its own: the session secret its open answered
    goes with every later frame and the close)."""

    def __init__(self, address: str, session_id: str) -> None:
        self.address = address
        self.session_id = session_id
        self.tokens: list[int] = []
        self.secret = b""

    async def step(self) -> None:
        if len(self.tokens) >= VICTIM_STEPS:
            return
        async with ShardClient(self.address, timeout=20.0, streaming=False) as client:
            expect = expectations_of(await client.describe())
            if not self.tokens:
                await client.open(self.session_id, 1, expect)
                self.secret = client.session_secret(self.session_id, 1)
                rows, positions = PROMPT, range(len(PROMPT))
            else:
                at = len(PROMPT) + len(self.tokens) - 1
                rows, positions = [self.tokens[-1]], range(at, at + 1)
        request = encode_forward(
            self.session_id,
            1,
            len(self.tokens),
            expect,
            positions,
            tokens=rows,
            session_secret=self.secret,
        )
        async with grpc.aio.insecure_channel(self.address) as channel:
            reply = await shard_pb2_grpc.ShardStub(channel).Forward(request, timeout=20.0)
        self.tokens.append(int(np.argmax(output_from_reply(reply)[-1])))

    async def close(self) -> None:
        request = pb.CloseSessionRequest(
            session_id=self.session_id, epoch=1, session_secret=self.secret
        )
        async with grpc.aio.insecure_channel(self.address) as channel:
            await shard_pb2_grpc.ShardStub(channel).CloseSession(request, timeout=20.0)


async def call_raw(
    address: str, method: str, payload: bytes, answers: list[bytes] | None = None
) -> grpc.aio.AioRpcError | None:
    """Sends ``payload`` as the request bytes of ``method``; the error, or None if answered
    (a unary answer's bytes appended to ``answers``)."""
    async with grpc.aio.insecure_channel(address) as channel:
        path = f"/dgr.shard.v1.{SERVICE.get(method, 'Shard')}/{method}"
        try:
            if METHODS[method] == "unary":
                answer = await channel.unary_unary(path)(payload, timeout=10.0)
                if answers is not None:
                    answers.append(answer)
            elif METHODS[method] == "server-stream":
                async for _ in channel.unary_stream(path)(payload, timeout=10.0):
                    pass
            else:
                call = channel.stream_stream(path)(iter([payload]), timeout=10.0)
                async for _ in call:
                    pass
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


def dgr_status(error: grpc.aio.AioRpcError) -> str | None:
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def assert_typed(error: grpc.aio.AioRpcError | None) -> None:
    if error is None:
        return
    assert error.code() is not grpc.StatusCode.UNKNOWN, error
    assert dgr_status(error) is not None, error
    assert dgr_status(error) != "DGR_E_INTERNAL", error  # a caller's input is never a fault


def assert_healthy(worker: WorkerProcess) -> None:
    """Nothing sent so far counted against the worker's advertised health."""
    advert = run(_describe(worker.address))
    assert (advert.health.recent_errors, advert.health.total_errors) == (0, 0), advert.health


@pytest.mark.parametrize("method", list(METHODS))
def test_undecodable_bytes_get_invalid_argument_and_a_trailer(
    worker: WorkerProcess, method: str
) -> None:
    error = run(call_raw(worker.address, method, GARBAGE))
    assert error is not None
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert dgr_status(error) == "DGR_E_FRAME"
    assert "not a valid message" in (error.details() or "")


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("method", list(METHODS))
def test_raw_bytes_on_every_rpc(worker: WorkerProcess, want: list[int], method: str) -> None:
    victim = Victim(worker.address, f"victim-raw-{method}")
    examples = 0

    @FUZZ
    @given(payload=st.binary(max_size=256))
    def fuzz(payload: bytes) -> None:
        nonlocal examples
        examples += 1
        assert_typed(run(call_raw(worker.address, method, payload)))
        run(victim.step())

    run(victim.step())
    fuzz()
    run(victim.close())
    print(f"\n{method}: {examples} examples, victim {len(victim.tokens)} tokens exact")
    assert examples >= EXAMPLES // 2
    assert worker.proc.poll() is None, worker.stderr_text()
    assert victim.tokens == want[: len(victim.tokens)] and len(victim.tokens) >= examples // 2
    assert_healthy(worker)


def expectations(real: Expectations) -> st.SearchStrategy[pb.Expectations]:
    random = st.builds(
        pb.Expectations,
        schema_version=st.integers(0, 3),
        model_sha256=st.binary(max_size=40),
        layer_begin=st.integers(0, 2**32 - 1),
        layer_end=st.integers(0, 2**32 - 1),
        boundary_width=st.integers(0, 2**32 - 1),
    )
    return st.one_of(st.just(expectations_to_proto(real)), random)


def session_ids() -> st.SearchStrategy[str]:
    return st.text(max_size=40).filter(lambda s: not s.startswith("victim"))


def tensors() -> st.SearchStrategy[pb.Tensor]:
    return st.builds(
        pb.Tensor,
        dtype=st.one_of(st.integers(0, 3), INT32),  # defined values, and any other
        shape=st.lists(st.integers(0, 2**32 - 1), max_size=3),
        data=st.binary(max_size=512),
    )


def forward_requests(real: Expectations) -> st.SearchStrategy[pb.ForwardRequest]:
    u32 = st.integers(0, 2**32 - 1)
    return st.builds(
        pb.ForwardRequest,
        session_id=session_ids(),
        epoch=st.integers(0, 2**64 - 1),
        step=st.integers(0, 2**64 - 1),
        expect=expectations(real),
        expected_next_pos=u32,
        positions=st.lists(st.integers(0, 300), max_size=8),
        token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
        boundary=st.one_of(st.none(), tensors()),
        logit_rows=st.lists(u32, max_size=4),
        timeout_ms=st.integers(0, 60_000),
        no_logits=st.booleans(),
        kind=st.one_of(st.integers(0, 3), INT32),
        chain_hop=u32,
        ring_until_step=st.integers(0, 2**64 - 1),
        ring_stop=st.lists(INT32, max_size=3),
    )


@pytest.mark.parametrize("method", list(METHODS))
def test_generated_messages_on_every_rpc(
    worker: WorkerProcess, want: list[int], method: str
) -> None:
    real = run(_expectations(worker.address))
    victim = Victim(worker.address, f"victim-msg-{method}")
    strategy: st.SearchStrategy[Any] = {
        "Describe": st.just(pb.DescribeRequest()),
        "OpenSession": st.builds(
            pb.OpenSessionRequest,
            session_id=session_ids(),
            epoch=st.integers(0, 2**64 - 1),
            expect=expectations(real),
        ),
        "CloseSession": st.builds(
            pb.CloseSessionRequest, session_id=session_ids(), epoch=st.integers(0, 2**64 - 1)
        ),
        "Forward": forward_requests(real),
        "ForwardStream": forward_requests(real),
        "Usage": st.builds(pb.UsageRequest, session_id=session_ids()),
        "Link": st.builds(
            pb.LinkRequest,
            session_id=session_ids(),
            epoch=st.integers(0, 2**64 - 1),
            session_secret=st.binary(max_size=40),
            next=st.builds(
                pb.ChainHop,
                endpoint=st.text(max_size=40),
                expect=expectations(real),
                tls=st.booleans(),
            ),
            ring=st.booleans(),
        ),
        "ChainOutput": st.builds(
            pb.ChainOutputRequest, session_id=session_ids(), epoch=st.integers(0, 2**64 - 1)
        ),
        "ChainStream": forward_requests(real),
    }[method]
    examples = 0

    @FUZZ
    @given(message=strategy)
    def fuzz(message: Any) -> None:
        nonlocal examples
        examples += 1
        answers: list[bytes] = []
        error = run(call_raw(worker.address, method, message.SerializeToString(), answers))
        assert_typed(error)
        if method == "OpenSession" and error is None:  # it opened: give the slot back
            secret = pb.OpenSessionReply.FromString(answers[0]).session_secret
            close = pb.CloseSessionRequest(
                session_id=message.session_id, epoch=message.epoch, session_secret=secret
            )
            closing = close.SerializeToString()
            assert run(call_raw(worker.address, "CloseSession", closing)) is None
        run(victim.step())

    run(victim.step())
    fuzz()
    run(victim.close())
    print(f"\n{method}: {examples} examples, victim {len(victim.tokens)} tokens exact")
    assert worker.proc.poll() is None, worker.stderr_text()
    assert victim.tokens == want[: len(victim.tokens)] and len(victim.tokens) >= examples // 2
    assert_healthy(worker)
    assert "Traceback" not in worker.stderr_text()


async def _describe(address: str) -> Advert:
    async with ShardClient(address, timeout=10.0) as client:
        return await client.describe()


async def _expectations(address: str) -> Expectations:
    return expectations_of(await _describe(address))


# --- boundary tensors on a later stage ---------------------------------------------------------


@pytest.fixture(scope="module")
def last_stage(tiny_llama: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess.spawn(tiny_llama, (2, 4), extra_args=ARGS) as process:
        yield process


class RelayedVictim:
    """A session whose layers [0, 2) run here, in-process, and [2, 4) on the fuzzed worker,
    one token per :meth:`step`."""

    def __init__(self, tiny_llama: Path, address: str) -> None:
        self.engine = ShardEngine(tiny_llama, layers=(0, 2), **OPTIONS.engine_kwargs())
        self.engine.open_session(1, 1)
        self.address = address
        self.tokens: list[int] = []
        self.secret = b""
        self.expect: Expectations | None = None

    async def step(self) -> None:
        if len(self.tokens) >= VICTIM_STEPS:
            return
        if self.expect is None:
            async with ShardClient(self.address, timeout=20.0, streaming=False) as client:
                self.expect = expectations_of(await client.describe())
                await client.open("victim-relayed", 1, self.expect)
                self.secret = client.session_secret("victim-relayed", 1)
        at = 0 if not self.tokens else len(PROMPT) + len(self.tokens) - 1
        rows = PROMPT if not self.tokens else [self.tokens[-1]]
        positions = np.arange(at, at + len(rows), dtype=np.int32)
        boundary = self.engine.forward(1, 1, positions, tokens=np.asarray(rows, dtype=np.int32))
        request = encode_forward(
            "victim-relayed",
            1,
            len(self.tokens),
            self.expect,
            positions,
            boundary=boundary,
            session_secret=self.secret,
        )
        async with grpc.aio.insecure_channel(self.address) as channel:
            reply = await shard_pb2_grpc.ShardStub(channel).Forward(request, timeout=20.0)
        self.tokens.append(int(np.argmax(output_from_reply(reply)[-1])))


def test_generated_boundary_tensors_on_a_later_stage(
    tiny_llama: Path, last_stage: WorkerProcess, want: list[int]
) -> None:
    """Frames of an open session, exact but for their boundary tensor: any dtype (defined or
    not), shape and bytes. Each is answered or refused typed, never as the worker's fault, and
    a session relayed through the same worker stays exact."""
    real = run(_expectations(last_stage.address))
    victim = RelayedVictim(tiny_llama, last_stage.address)
    secret = run(_open(last_stage.address, "attacker", real))
    width = real.boundary_width
    examples = 0

    @FUZZ
    @given(
        dtype=st.one_of(st.integers(0, 3), INT32),
        shape=st.one_of(st.just([1, width]), st.lists(st.integers(0, 2**32 - 1), max_size=3)),
        data=st.one_of(
            st.just(np.ones((1, width), "<f4").tobytes()),
            st.binary(max_size=4 * width + 8),
        ),
    )
    def fuzz(dtype: int, shape: list[int], data: bytes) -> None:
        nonlocal examples
        examples += 1
        request = encode_forward(
            "attacker", 1, 0, real, [0], boundary=np.ones((1, width)), session_secret=secret
        )
        request.boundary.dtype = dtype  # type: ignore[assignment]  # an open enum: any int32
        del request.boundary.shape[:]
        request.boundary.shape.extend(shape)
        request.boundary.data = data
        assert_typed(run(call_raw(last_stage.address, "Forward", request.SerializeToString())))
        run(victim.step())

    try:
        run(victim.step())
        fuzz()
    finally:
        victim.engine.close()
    print(f"\nboundaries: {examples} examples, victim {len(victim.tokens)} tokens exact")
    assert last_stage.proc.poll() is None, last_stage.stderr_text()
    assert victim.tokens == want[: len(victim.tokens)] and len(victim.tokens) >= examples // 2
    assert_healthy(last_stage)
    assert "Traceback" not in last_stage.stderr_text()


async def _open(address: str, session_id: str, expect: Expectations) -> bytes:
    async with ShardClient(address, timeout=10.0) as client:
        await client.open(session_id, 1, expect)
        return client.session_secret(session_id, 1)
