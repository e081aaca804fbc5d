"""The RPC half of issue 28's hostile pass, as tests: a used grant replayed after its worker
restarted on the same port, ``Usage`` without (or with a wrong) secret, a second client under
mutual TLS without grants forwarding into, closing or re-opening the first client's session,
and ``Chain.Link`` naming an endpoint that is not the next stage (with grants: the one its grant
names; without: one that holds the session with the secret given). Each is refused with its
exact reason while an honest session beside it produces the whole model's logits bit for bit.

Workers are real ones on 127.0.0.1 (a ``dgr worker`` process where a restart is the point,
in-process ``ShardWorker`` elsewhere); every one started is stopped, every wait is bounded by a
call deadline or ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import GrantDenied, GrantUnauthenticated, ShardUnavailable
from dgr_engine.options import EngineOptions
from dgr_engine.reference import InProcessRoute
from dgr_engine.security.grants import Grant, GrantIssuer, issue, public_pem
from dgr_engine.security.tls import ClientTls, ServerTls
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.tooling.throwaway_ca import authority
from dgr_engine.wire.advert import Advert
from dgr_engine.wire.frames import encode_forward, expectations_to_proto, output_from_reply
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import STATUS_KEY
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_session.testing import forward_call
from dgr_session.transport import Boundary
from tests import harness

T = TypeVar("T")
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=64, n_batch=16, max_sessions=4)
KW = OPTIONS.engine_kwargs()
PROMPT = [9, 99, 199, 29, 1]
NEXT = 42
TRACKER = Ed25519PrivateKey.generate()
ROGUE = Ed25519PrivateKey.generate()
LIMIT = 120.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    return harness.run(coro, LIMIT)


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> tuple[np.ndarray, np.ndarray]:
    """The whole model's logits: the prompt's last row, then token ``NEXT``'s."""
    with ShardEngine(tiny_llama, **KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        prefill = chain.forward(1, 0, PROMPT, 0)[-1]
        return prefill, chain.forward(1, 0, [NEXT], len(PROMPT))[-1]


def token(
    advert: Advert, endpoint: str, session_id: str, *, key: Ed25519PrivateKey = TRACKER, **more: Any
) -> bytes:
    """A grant for ``session_id`` epoch 1 at the stage ``advert`` describes."""
    grant = Grant(
        session_id=session_id,
        epoch=1,
        endpoint=endpoint,
        layer_begin=advert.span.layer_begin,
        layer_end=advert.span.layer_end,
        model_sha256=advert.identity.content_hash.hex(),
        lane_id=advert.lane.lane_id,
        expires_at=time.time() + 300,
        key_id="k1",
        **more,
    )
    return issue(grant, key)


def status_of(exc: grpc.aio.AioRpcError) -> str:
    return str(dict(exc.trailing_metadata() or ()).get(STATUS_KEY, ""))


async def prefill(client: ShardClient, session_id: str, epoch: int = 1) -> np.ndarray:
    expect = expectations_of(await client.describe())
    positions = list(range(len(PROMPT)))
    result = await client.forward(
        session_id, epoch, 0, expect, positions, tokens=PROMPT, kind="prefill"
    )
    return np.asarray(result.output)[-1]


async def next_step(client: ShardClient, session_id: str, epoch: int = 1) -> np.ndarray:
    expect = expectations_of(await client.describe())
    result = await client.forward(
        session_id, epoch, 1, expect, [len(PROMPT)], tokens=[NEXT], kind="decode"
    )
    return np.asarray(result.output)[-1]


# -- grants across a restart ---------------------------------------------------------------------


@pytest.fixture
def grant_key_args(tmp_path: Path) -> list[str]:
    pem = tmp_path / "tracker.pem"
    pem.write_bytes(public_pem(TRACKER))
    return ["--grant-key", f"k1={pem}"]


@pytest.mark.slow  # starts worker processes
def test_a_used_grant_opens_nothing_after_its_worker_restarts_on_the_same_port(
    tiny_llama: Path, grant_key_args: list[str], want: tuple[np.ndarray, np.ndarray]
) -> None:
    """The replay cache is gone with the process, but the restarted worker refuses every grant
    issued before it started, naming why; a grant issued after the restart opens a session
    that stays exact while the replay is refused beside it."""
    want_prefill, want_next = want
    first = WorkerProcess.spawn(tiny_llama, (0, 4), options=OPTIONS, extra_args=grant_key_args)
    try:

        async def use_once() -> bytes:
            async with ShardClient(first.address, timeout=20.0) as client:
                advert = await client.describe()
                used = token(advert, first.address, "victim")
                await client.open("victim", 1, expectations_of(advert), grant=used)
                assert np.array_equal(await prefill(client, "victim"), want_prefill)
                await client.close("victim", 1)
                with pytest.raises(GrantDenied, match="used before"):  # the same instance
                    await client.open("victim", 1, expectations_of(advert), grant=used)
                return used

        used = run(use_once())
    finally:
        assert first.stop() == 0
    second = WorkerProcess.spawn(
        tiny_llama, (0, 4), port=first.port, options=OPTIONS, extra_args=grant_key_args
    )
    try:
        assert second.address == first.address  # the same endpoint: the grant names it

        async def replay() -> None:
            async with (
                ShardClient(second.address, timeout=20.0) as honest,
                ShardClient(second.address, timeout=20.0) as attacker,
            ):
                advert = await honest.describe()
                expect = expectations_of(advert)
                fresh = token(advert, second.address, "good")
                await honest.open("good", 1, expect, grant=fresh)
                assert np.array_equal(await prefill(honest, "good"), want_prefill)
                with pytest.raises(GrantDenied) as refused:
                    await attacker.open("victim", 1, expect, grant=used)
                assert str(refused.value) == (
                    "DGR_E_PERMISSION: the route grant was issued before this worker started "
                    "(a restarted worker cannot tell whether it was used before): ask for a "
                    "fresh one"
                )
                assert np.array_equal(await next_step(honest, "good"), want_next)
                await honest.close("good", 1)
                assert (await honest.describe()).capacity.sessions_open == 0

        run(replay())
    finally:
        assert second.stop() == 0


# -- Usage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("grants", [True, False], ids=["grants", "no-grants"])
def test_usage_answers_only_the_sessions_holder_or_the_tracker(
    tiny_llama: Path, want: tuple[np.ndarray, np.ndarray], grants: bool
) -> None:
    """Another client's Usage of a session, with no secret, a guessed one, another session's
    or a foreign key's grant, is refused (UNAUTHENTICATED); the holder reads its records, after
    the close too, and with grants so does the tracker's credential. The session stays exact."""
    want_prefill, want_next = want
    keys = {"k1": TRACKER.public_key()} if grants else None
    worker = ShardWorker.load(tiny_llama, (0, 4), **KW, config=WorkerConfig(grant_keys=keys))

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with (
                ShardClient(address, timeout=20.0) as holder,
                ShardClient(address, timeout=20.0) as other,
                grpc.aio.insecure_channel(address) as channel,
            ):
                advert = await holder.describe()
                grant = token(advert, address, "bill") if grants else b""
                await holder.open("bill", 1, expectations_of(advert), grant=grant)
                assert np.array_equal(await prefill(holder, "bill"), want_prefill)

                with pytest.raises(GrantUnauthenticated, match="usage of session 'bill'"):
                    await other.usage("bill")
                stub = shard_pb2_grpc.ShardStub(channel)
                guesses = [
                    pb.UsageRequest(session_id="bill", session_secret=os.urandom(16)),
                    pb.UsageRequest(session_id="bill", session_secret=b"\0" * 16),
                    # the Link probe's form: a wrong secret for the held epoch
                    pb.UsageRequest(
                        session_id="bill", session_secret=os.urandom(16), held=True, epoch=1
                    ),
                ]
                issuer = GrantIssuer(TRACKER, "k1")
                for credential in [
                    issuer.usage_grant("someone-else", address),  # another session's
                    issuer.usage_grant("bill", "127.0.0.1:1"),  # another stage's
                    GrantIssuer(ROGUE, "k1").usage_grant("bill", address),  # a foreign key
                    b"not a grant",
                ]:
                    guesses.append(pb.UsageRequest(session_id="bill", grant=credential))
                if not grants:  # no keys: even the tracker's own grant proves nothing here
                    guesses.append(
                        pb.UsageRequest(
                            session_id="bill", grant=issuer.usage_grant("bill", address)
                        )
                    )
                for request in guesses:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Usage(request, timeout=10.0)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, request
                    assert status_of(refused.value) == "DGR_E_UNAUTHENTICATED"

                (record,) = await holder.usage("bill")
                assert (record.epoch, record.forwards, record.rows_prefill) == (1, 1, len(PROMPT))
                if grants:  # the tracker reconciles with its own credential
                    tracker = await other.usage("bill", grant=issuer.usage_grant("bill", address))
                    assert tracker == [record]
                assert np.array_equal(await next_step(holder, "bill"), want_next)
                await holder.close("bill", 1)
                (after,) = await holder.usage("bill")  # the holder, after the close
                assert (after.forwards, after.rows_decode) == (2, 1)
                assert await other.usage("never-opened") == []  # unknown here: no records
                advert = await holder.describe()
                assert advert.capacity.sessions_open == 0
                assert advert.health.total_errors == 0  # callers' refusals: not the worker's
        finally:
            await worker.stop()

    run(scenario())


# -- two clients under mutual TLS, no grants -----------------------------------------------------


@pytest.fixture
def mutual_tls(tmp_path: Path) -> Iterator[tuple[ServerTls, ClientTls, ClientTls]]:
    ca = authority(tmp_path, "dgr")
    server = ca.issue("worker")
    alice, bob = ca.issue("alice", client=True), ca.issue("bob", client=True)
    yield (
        ServerTls.from_files(server.cert, server.key, ca.cert),
        ClientTls.from_files(ca.cert, alice.cert, alice.key),
        ClientTls.from_files(ca.cert, bob.cert, bob.key),
    )


def test_under_mutual_tls_without_grants_no_client_touches_anothers_session(
    tiny_llama: Path,
    want: tuple[np.ndarray, np.ndarray],
    mutual_tls: tuple[ServerTls, ClientTls, ClientTls],
) -> None:
    """Bob, a client with a certificate of the same CA, cannot forward into Alice's session
    (no or a guessed secret), close it (its epoch or a newer one, which would close it), open
    it again at a newer epoch (which would discard its state), link it, or read its usage;
    Alice's session goes on exact, and Bob's own session beside it works."""
    want_prefill, want_next = want
    server_tls, alice_tls, bob_tls = mutual_tls
    worker = ShardWorker.load(tiny_llama, (0, 4), **KW, config=WorkerConfig(tls=server_tls))

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with (
                ShardClient(address, timeout=20.0, tls=alice_tls) as alice,
                ShardClient(address, timeout=20.0, tls=bob_tls) as bob,
                grpc.aio.secure_channel(
                    address, bob_tls.credentials(), options=bob_tls.channel_options()
                ) as channel,
            ):
                expect = expectations_of(await alice.describe())
                await alice.open("mine", 1, expect)
                assert alice.session_secret("mine", 1)  # a secret without grants
                assert np.array_equal(await prefill(alice, "mine"), want_prefill)

                with pytest.raises(GrantUnauthenticated, match="session secret"):
                    await bob.forward("mine", 1, 1, expect, [len(PROMPT)], tokens=[7])
                guessed = encode_forward(
                    "mine", 1, 1, expect, [len(PROMPT)], tokens=[7], session_secret=os.urandom(16)
                )
                stub = shard_pb2_grpc.ShardStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Forward(guessed, timeout=10.0)
                assert status_of(refused.value) == "DGR_E_UNAUTHENTICATED"
                with pytest.raises(GrantDenied, match="close of session 'mine': another client"):
                    await bob.close("mine", 1)  # no secret of it: only its owner may close it
                with pytest.raises(GrantDenied, match="close of session 'mine': another client"):
                    await bob.close("mine", 2)  # would close the held epoch 1, as an open would
                with pytest.raises(GrantDenied, match="another client holds it"):
                    await bob.open("mine", 2, expect)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await bob.chain.Link(pb.LinkRequest(session_id="mine", epoch=1), timeout=10.0)
                assert status_of(refused.value) == "DGR_E_UNAUTHENTICATED"
                with pytest.raises(GrantUnauthenticated):
                    await bob.usage("mine")

                await bob.open("theirs", 1, expect)  # Bob's own session is his to use
                assert np.array_equal(await prefill(bob, "theirs"), want_prefill)
                assert np.array_equal(await next_step(alice, "mine"), want_next)
                assert worker.table.snapshot().sessions_open == 2
                await bob.close("theirs", 1)
                await alice.close("mine", 1)
                assert worker.table.snapshot().sessions_open == 0
        finally:
            await worker.stop()

    run(scenario())


# -- Chain.Link ---------------------------------------------------------------------------------


class Listener:
    """A TCP endpoint that is no stage: counts the connections made to it."""

    def __init__(self) -> None:
        self.connections = 0
        self.endpoint = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Listener:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.endpoint = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _accept(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()


async def chained_prefill(first: ShardClient, last: ShardClient, session_id: str) -> np.ndarray:
    """The prompt through a linked two-stage chain; the last row's logits."""
    output = last.chain.ChainOutput(
        pb.ChainOutputRequest(
            session_id=session_id, epoch=1, session_secret=last.session_secret(session_id, 1)
        )
    )
    try:
        assert await output.read() == pb.ChainOutputReply()  # registered
        expect = expectations_of(await first.describe())
        frame = encode_forward(
            session_id,
            1,
            0,
            expect,
            range(len(PROMPT)),
            tokens=PROMPT,
            session_secret=first.session_secret(session_id, 1),
        )
        stream = first.chain.ChainStream()
        await stream.write(frame)
        reply = await output.read()
        await stream.done_writing()
        assert await stream.read() is grpc.aio.EOF  # the chain ended cleanly
        return output_from_reply(reply.reply)[-1]
    finally:
        output.cancel()


def hop_to(endpoint: str, advert: Advert, secret: bytes) -> pb.ChainHop:
    return pb.ChainHop(
        endpoint=endpoint,
        expect=expectations_to_proto(expectations_of(advert)),
        session_secret=secret,
    )


@pytest.mark.parametrize("grants", [True, False], ids=["grants", "no-grants"])
def test_link_dials_only_the_next_stage(
    tiny_llama: Path, want: tuple[np.ndarray, np.ndarray], grants: bool
) -> None:
    """A session holder links its first stage to an endpoint that is not its next stage: a
    listener that is no stage, a worker that does not hold the session, (with grants) the
    stage itself, or (without grants) the right stage with a wrong secret. With grants each is
    refused (PERMISSION_DENIED, naming the granted next stage) and nothing is dialled (a wrong
    secret for the right stage is refused by that stage at the first frame, as
    ``test_chain_route`` shows); without grants the named endpoint must confirm it holds the
    session at that epoch with the secret given (PERMISSION_DENIED when a worker says no,
    UNAVAILABLE when nothing answers), and no channel to an endpoint that did not confirm is
    kept. The link to the true next stage then carries the prompt to the whole model's
    logits."""
    want_prefill, _ = want
    keys = {"k1": TRACKER.public_key()} if grants else None
    config = WorkerConfig(grant_keys=keys)
    stages = [ShardWorker.load(tiny_llama, r, **KW, config=config) for r in ((0, 2), (2, 4))]
    spare = ShardWorker.load(tiny_llama, (2, 4), **KW, config=config)

    async def scenario() -> None:
        a0, a1, a_spare = [await w.start() for w in (*stages, spare)]
        try:
            async with (
                Listener() as foreign,
                ShardClient(a0, timeout=20.0) as c0,
                ShardClient(a1, timeout=20.0) as c1,
                ShardClient(a_spare, timeout=20.0) as c_spare,
            ):
                ad0, ad1 = await c0.describe(), await c1.describe()
                for client, advert, address, nxt in ((c0, ad0, a0, a1), (c1, ad1, a1, a0)):
                    grant = token(advert, address, "s", next_endpoint=nxt) if grants else b""
                    await client.open("s", 1, expectations_of(advert), grant=grant)
                other = token(ad1, a_spare, "elsewhere") if grants else b""
                await c_spare.open("elsewhere", 1, expectations_of(ad1), grant=other)
                s0, s1 = c0.session_secret("s", 1), c1.session_secret("s", 1)

                async def link(hop: pb.ChainHop) -> None:
                    request = pb.LinkRequest(session_id="s", epoch=1, session_secret=s0, next=hop)
                    await c0.chain.Link(request, timeout=10.0)

                wrong = [
                    (foreign.endpoint, s1, "UNAVAILABLE"),
                    (a_spare, s1, "PERMISSION"),
                ]
                if grants:  # the stage itself holds the session: without grants, a rule's edge
                    wrong.append((a0, s0, "PERMISSION"))
                else:  # with grants the next stage refuses the frames instead
                    wrong.append((a1, os.urandom(16), "PERMISSION"))
                for endpoint, secret, without_grants in wrong:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await link(hop_to(endpoint, ad1, secret))
                    if grants:
                        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                        assert status_of(refused.value) == "DGR_E_PERMISSION"
                        if endpoint != a1:
                            assert f"names next stage {a1!r}, not {endpoint!r}" in str(
                                refused.value.details()
                            )
                    else:
                        assert status_of(refused.value) == f"DGR_E_{without_grants}", endpoint
                hub = stages[0].chain
                assert hub is not None
                assert a_spare not in hub.dialled() and foreign.endpoint not in hub.dialled()
                if grants:
                    assert foreign.connections == 0  # nothing was dialled
                    # a grant that names no next stage links nowhere
                    await c0.open("t", 1, expectations_of(ad0), grant=token(ad0, a0, "t"))
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await c0.chain.Link(
                            pb.LinkRequest(
                                session_id="t",
                                epoch=1,
                                session_secret=c0.session_secret("t", 1),
                                next=hop_to(a1, ad1, s1),
                            ),
                            timeout=10.0,
                        )
                    assert "names no next stage" in str(refused.value.details())
                    await c0.close("t", 1)

                await link(hop_to(a1, ad1, s1))  # the true next stage
                assert np.array_equal(await chained_prefill(c0, c1, "s"), want_prefill)
                assert hub.dialled() == frozenset({a1})  # the only channel kept
                await c0.close("s", 1)
                await c1.close("s", 1)
                await c_spare.close("elsewhere", 1)
                for worker in (*stages, spare):
                    assert worker.table.snapshot().sessions_open == 0
        finally:
            for worker in (*stages, spare):
                await worker.stop()

    run(scenario())


@pytest.mark.slow
@pytest.mark.usefixtures("certified_fixtures")
def test_a_link_to_a_lost_next_stage_blames_that_stage_not_the_one_that_asked(
    tiny_llama: Path,
) -> None:
    """Without grants the first stage asks its next stage before it links; when that stage
    is gone (SIGKILLed after the opens), the first stage's refusal (``DGR_E_UNAVAILABLE``)
    is filed by the transport against the lost stage, so a route change never excludes the
    healthy stage that asked."""
    provider = LoopbackRouteProvider(tiny_llama, ((0, 2), (2, 4)), options=OPTIONS)

    async def scenario() -> None:
        async with provider, ChainStageTransport(timeout=10.0) as transport:
            route = await provider.assign("s", None)
            assert route is not None
            first, last = route.stages
            for stage in route.stages:
                await transport.open(stage, "s", 1)
            provider.kill(last.endpoint)
            step0 = await transport.forward(
                forward_call(first, "s", 1, 0, range(3), [5, 6, 7], None)
            )
            assert isinstance(step0, Boundary)  # the first stage is not blamed
            with pytest.raises(ShardUnavailable) as lost:
                await transport.forward(
                    forward_call(last, "s", 1, 0, range(3), [5, 6, 7], step0.rows)
                )
            assert last.endpoint in str(lost.value)
            await transport.close(first, "s", 1)
        assert provider.workers[0].process.proc.poll() is not None  # stopped by the provider

    run(scenario())
