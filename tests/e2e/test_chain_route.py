"""End to end: chained routes (``dgr_engine.client.chained``, ``docs/chain.md``) over real
``dgr worker`` processes on 127.0.0.1.

The client sends each frame to the first stage only; each stage forwards its output to the next
and the last stage's output comes back on the output stream. Tokens and every sampled logits row
equal the whole model's (and so the relay's) bit for bit; a middle stage SIGKILLed mid-decode ends
the epoch with a ``dead`` fault naming that stage and the session re-prefills on a new route.
Every wait is bounded (policy deadlines, call deadlines, ``run``'s limit); the provider stops
every process it started.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.client.chained import ChainStageTransport, ChainStats, ChainTicket
from dgr_engine.client.relay import expectations_for
from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.client.shard_client import ShardClient
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import FrameRejected, StaleEpoch
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.options import EngineOptions
from dgr_engine.reference import InProcessRoute, whole_model_reference
from dgr_engine.security.grants import GrantIssuer
from dgr_engine.security.tls import ClientTls, ServerTls
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.throwaway_ca import authority
from dgr_engine.wire.frames import encode_forward, expectations_to_proto
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    SessionHandle,
    SessionManager,
    SessionResult,
    SessionState,
)
from dgr_session.testing import forward_call
from dgr_session.transport import Boundary, Logits
from tests import harness
from tests.recorder import LogitsRecorder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

T = TypeVar("T")
N_TOKENS = 12
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)


def run(coro: Coroutine[Any, Any, T], limit: float = 90.0) -> T:
    return harness.run(coro, limit)


async def drive(
    provider: LoopbackRouteProvider,
    prompts: Sequence[Sequence[int]],
    *,
    at_step: int | None = None,
    fault: Callable[[LoopbackRouteProvider, SessionHandle], None] | None = None,
    policy: FailurePolicy | None = None,
    ring: bool = False,
    data_path: str = "frame",
) -> tuple[list[SessionResult], list[LogitsRecorder], ChainStageTransport]:
    handles: list[SessionHandle] = []
    recorders = [LogitsRecorder(len(p)) for p in prompts]
    fired: list[bool] = []

    def on_token(_token: int) -> None:
        if fault is not None and not fired and len(handles[0].tokens) == at_step:
            fired.append(True)
            fault(provider, handles[0])

    await provider.start()
    try:
        transport = ChainStageTransport(
            timeout=10.0, close_timeout=2.0, ring=ring, data_path=data_path
        )
        async with transport:
            manager = SessionManager(
                transport,
                provider,
                policy=policy or FailurePolicy(step_deadline=10.0),
                required_evidence=EvidenceClass.FIXTURE,
            )
            for i, prompt in enumerate(prompts):
                handles.append(
                    manager.start(
                        prompt,
                        max_new_tokens=N_TOKENS,
                        session_id=f"chain-{i}",
                        on_token=on_token if i == 0 else None,
                        sampler=recorders[i],
                    )
                )
            results = [await h.wait() for h in handles]
            await manager.aclose()
    finally:
        await provider.aclose()
    for worker in provider.workers:
        assert not worker.running, f"{worker} still running"
    epochs = sum(r.epoch for r in results)  # every epoch linked once, over the path asked for
    assert transport.chain_stats.frame_link_epochs == (epochs if data_path != "grpc" else 0)
    return results, recorders, transport


def prompts_for(n_vocab: int, size: int, seeds: Sequence[int]) -> list[list[int]]:
    return [[int(t) for t in np.random.default_rng(s).integers(0, n_vocab, size)] for s in seeds]


DATA_PATHS = pytest.mark.parametrize("data_path", ["grpc", "frame"])


@DATA_PATHS
@pytest.mark.parametrize("ring", [False, True], ids=["chain", "ring"])
@pytest.mark.parametrize(
    ("fixture", "layout"),
    [
        ("tiny-llama", ((0, 2), (2, 4))),
        ("tiny-llama", ((0, 1), (1, 2), (2, 3), (3, 4))),
        ("tiny-v4", ((0, 1), (1, 3), (3, 6))),
    ],
    ids=["llama-2-stages", "llama-4-stages", "v4-3-stages"],
)
def test_chained_route_equals_the_whole_model_bit_for_bit(
    fixture: str, layout: tuple[tuple[int, int], ...], ring: bool, data_path: str
) -> None:
    """Tokens and every sampled logits row equal the whole model's; with ``ring`` the last
    stage sent every decode frame on to the first stage itself (the client sent the prompt
    only)."""
    path = ensure_fixture(fixture)
    prompts = prompts_for(256, 20, (11, 12))
    reference = whole_model_reference(path, prompts, N_TOKENS, OPTIONS)
    provider = LoopbackRouteProvider(path, layout, options=OPTIONS)
    results, recorders, transport = run(drive(provider, prompts, ring=ring, data_path=data_path))
    for result, recorder, (tokens, logits) in zip(results, recorders, reference, strict=True):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == tokens
        assert sorted(recorder.logits) == list(range(N_TOKENS))
        for step, row in enumerate(logits):
            assert np.array_equal(recorder.logits[step], row), f"logits differ at step {step}"
        assert (result.epoch, result.route_changes, result.reports) == (1, 0, ())
    # each frame went down the chain once: prompt + decode steps, no relay forwards
    frames = len(prompts) * (1 + N_TOKENS - 1)
    assert transport.chain_stats.frames == frames
    # the hops' traces say how much of the engines' time was inside llama.cpp
    assert 0 < transport.chain_stats.native_us <= transport.chain_stats.compute_us
    # a ring: the client sent each prompt, the last stage every decode frame
    assert transport.chain_stats.sent == (len(prompts) if ring else frames)
    # every stage's usage comes from the chain's traces: each saw every row once
    rows = sum(len(p) + N_TOKENS - 1 for p in prompts)
    assert [s.rows for s in transport.stats().values()] == [rows] * len(layout)
    for result in results:
        assert {(u.stage_index, u.rows_prefill + u.rows_decode) for u in result.usage} == {
            (i, rows // len(prompts)) for i in range(len(layout))
        }


@DATA_PATHS
@pytest.mark.parametrize("ring", [False, True], ids=["chain", "ring"])
def test_chained_route_survives_a_middle_stage_killed_mid_decode(
    ring: bool, data_path: str
) -> None:
    path = ensure_fixture("tiny-llama")
    layout = ((0, 1), (1, 2), (2, 3), (3, 4))
    prompts = prompts_for(256, 16, (21, 22))
    reference = whole_model_reference(path, prompts, N_TOKENS, OPTIONS)
    provider = LoopbackRouteProvider(path, layout, spares=[(1, 2)], options=OPTIONS)
    killed: list[str] = []

    def kill(p: LoopbackRouteProvider, session: SessionHandle) -> None:
        route = session.core.route
        assert route is not None
        killed.append(p.kill(route.stages[1].endpoint).endpoint)

    policy = FailurePolicy(step_deadline=10.0, backoff=(0.0,))
    results, _, _ = run(
        drive(
            provider, prompts, at_step=5, fault=kill, policy=policy, ring=ring, data_path=data_path
        )
    )
    assert len(killed) == 1
    for result, (tokens, _) in zip(results, reference, strict=True):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == tokens  # re-prefilled on a new route, tokens exact
    # both sessions shared the killed worker: each lost its epoch to it, blamed as dead
    for result in results:
        assert result.route_changes == 1, result.reports
        (report,) = result.reports
        assert report.fault is FaultKind.DEAD
        assert report.endpoint == killed[0]
        assert report.stage_index == 1


# --- authorisation and epoch fencing on the worker-to-worker path ----------------------------


def _trailer(exc: grpc.aio.AioRpcError, key: str) -> str | None:
    for k, v in exc.trailing_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


def test_a_chained_session_with_grants_and_refusals_of_wrong_secrets(tmp_path: Path) -> None:
    """Every stage checks grants: a chained session carries each next stage's secret and
    produces the whole model's tokens; a Link or an output stream without the stage's own
    secret, and a chained frame carrying a wrong secret for the next stage, are refused
    (UNAUTHENTICATED, the refusing hop named) and the next stage's session is unchanged."""
    path = ensure_fixture("tiny-llama")
    issuer = GrantIssuer(Ed25519PrivateKey.generate(), "k1")
    layout = ((0, 2), (2, 4))
    prompts = prompts_for(256, 12, (31,))
    ((want, _),) = whole_model_reference(path, prompts, N_TOKENS, OPTIONS)
    provider = LoopbackRouteProvider(
        path, layout, options=OPTIONS, worker_args=issuer.worker_args(tmp_path), grants=issuer
    )
    (result,), _, _ = run(drive(provider, prompts))
    assert result.state is SessionState.DONE, result.error
    assert list(result.tokens) == want

    provider = LoopbackRouteProvider(
        path, layout, options=OPTIONS, worker_args=issuer.worker_args(tmp_path), grants=issuer
    )

    async def attacks() -> None:
        async with provider:
            route = await provider.assign("s", None)
            assert route is not None
            route = issuer.grant_route("s", 1, route)
            first, last = route.stages
            async with ShardClient(first.endpoint) as c0, ShardClient(last.endpoint) as c1:
                for client, stage in ((c0, first), (c1, last)):
                    await client.open("s", 1, expectations_for(stage), grant=stage.grant)
                secret1 = c1.session_secret("s", 1)
                hop = pb.ChainHop(
                    endpoint=last.endpoint,
                    expect=expectations_to_proto(expectations_for(last)),
                    session_secret=secret1,
                )
                # a Link without this stage's own secret
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await c0.chain.Link(pb.LinkRequest(session_id="s", epoch=1, next=hop))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                # an output stream without the last stage's secret
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await c1.chain.ChainOutput(
                        pb.ChainOutputRequest(session_id="s", epoch=1, session_secret=b"x" * 16)
                    ).read()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                # a chained frame carrying a wrong secret for the next stage
                output = c1.chain.ChainOutput(
                    pb.ChainOutputRequest(session_id="s", epoch=1, session_secret=secret1)
                )
                assert (await output.read()) == pb.ChainOutputReply()  # registered
                bad = pb.ChainHop()
                bad.CopyFrom(hop)
                bad.session_secret = bytes(16)
                await c0.chain.Link(
                    pb.LinkRequest(
                        session_id="s",
                        epoch=1,
                        session_secret=c0.session_secret("s", 1),
                        next=bad,
                    )
                )
                frame = encode_forward(
                    "s",
                    1,
                    0,
                    expectations_for(first),
                    range(4),
                    tokens=[1, 2, 3, 4],
                    session_secret=c0.session_secret("s", 1),
                )
                stream = c0.chain.ChainStream()
                await stream.write(frame)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stream.read()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert _trailer(refused.value, "dgr-status") == "DGR_E_UNAUTHENTICATED"
                assert _trailer(refused.value, "dgr-chain-hop") == "1"
                output.cancel()
                # the last stage ran nothing: its session still starts at position 0
                rows = np.zeros((4, last.boundary_in), dtype=np.float32)
                result = await c1.forward(
                    "s", 1, 0, expectations_for(last), range(4), boundary=rows
                )
                assert result.next_pos == 4

    run(attacks())


def test_a_stale_epoch_on_the_worker_to_worker_path_is_refused_naming_the_stage() -> None:
    """A newer epoch opened on the last stage under the linked chain: the chained frame of the
    older epoch is refused there (StaleEpoch, the held epoch named), and the transport raises
    it at that stage's forward, so the route session blames the right stage. (The newer epoch
    comes after the first frame linked the chain: a Link checks that the next stage holds the
    linked epoch, so one opened before would be refused at the Link.)"""
    path = ensure_fixture("tiny-llama")
    provider = LoopbackRouteProvider(path, ((0, 2), (2, 4)), options=OPTIONS)

    async def scenario() -> None:
        transport = ChainStageTransport(timeout=10.0)
        async with provider, transport:
            route = await provider.assign("s", None)
            assert route is not None
            first, last = route.stages
            for stage in route.stages:
                await transport.open(stage, "s", 1)
            linked = await transport.forward(
                forward_call(first, "s", 1, 0, range(3), [5, 6, 7], None)
            )
            assert isinstance(linked, Boundary) and isinstance(linked.rows, ChainTicket)
            out = await transport.forward(
                forward_call(last, "s", 1, 0, range(3), [5, 6, 7], linked.rows)
            )
            assert isinstance(out, Logits)
            async with ShardClient(last.endpoint) as other:
                await other.open("s", 2, expectations_for(last))  # a newer epoch there
            step1 = await transport.forward(forward_call(first, "s", 1, 1, range(3, 4), [8], None))
            assert isinstance(step1, Boundary) and isinstance(step1.rows, ChainTicket)
            with pytest.raises(StaleEpoch) as refused:
                await transport.forward(forward_call(last, "s", 1, 1, range(3, 4), [8], step1.rows))
            assert refused.value.held_epoch == 2
            assert last.endpoint in str(refused.value)
            # the epoch is over: the next frame fails at once, at the same stage
            again = await transport.forward(forward_call(first, "s", 1, 2, range(4, 5), [9], None))
            assert isinstance(again, Boundary)
            with pytest.raises(StaleEpoch):
                await transport.forward(forward_call(last, "s", 1, 2, range(4, 5), [9], again.rows))
            for stage in route.stages:
                await transport.close(stage, "s", 1)

    run(scenario())


# --- TLS between stages ------------------------------------------------------------------------


@DATA_PATHS
def test_a_chained_route_over_mutual_tls_and_a_stage_without_chain_credentials(
    tmp_path: Path, data_path: str
) -> None:
    """Every worker serves mutual TLS; the first stage dials the second with its chain
    credentials (``WorkerConfig.chain_tls``): the chained tokens and logits equal the whole
    model's. A first stage without chain credentials refuses the link to a TLS successor, and
    the transport raises that at the first stage."""
    path = ensure_fixture("tiny-llama")
    ca = authority(tmp_path, "chain")
    server, hop, user = ca.issue("worker"), ca.issue("hop", client=True), ca.issue("u", client=True)
    serve = ServerTls.from_files(server.cert, server.key, ca.cert)  # client certificates required
    chain_tls = ClientTls.from_files(ca.cert, hop.cert, hop.key)
    client_tls = ClientTls.from_files(ca.cert, user.cert, user.key)
    kw = OPTIONS.engine_kwargs()
    first = ShardWorker.load(
        path, (0, 2), **kw, config=WorkerConfig(tls=serve, chain_tls=chain_tls)
    )
    second = ShardWorker.load(path, (2, 4), **kw, config=WorkerConfig(tls=serve))
    bare = ShardWorker.load(path, (0, 2), **kw, config=WorkerConfig(tls=serve))
    prompt = prompts_for(256, 10, (41,))[0]
    ((want, want_logits),) = whole_model_reference(path, [prompt], 6, OPTIONS)

    async def scenario() -> None:
        addresses = [await w.start() for w in (first, second, bare)]
        transport = ChainStageTransport(timeout=10.0, tls=client_tls, data_path=data_path)
        try:
            async with transport:
                provider = EndpointRouteProvider(addresses[:2], tls=client_tls)
                route = await provider.assign("t", None)
                assert route is not None
                for stage in route.stages:
                    await transport.open(stage, "t", 0)
                tokens: list[int] = []
                ids, pos = list(prompt), 0
                for step in range(6):
                    out = await transport.forward(
                        forward_call(
                            route.stages[0], "t", 0, step, range(pos, pos + len(ids)), ids, None
                        )
                    )
                    assert isinstance(out, Boundary)
                    logits = await transport.forward(
                        forward_call(
                            route.stages[1], "t", 0, step, range(pos, pos + len(ids)), ids, out.rows
                        )
                    )
                    assert isinstance(logits, Logits)
                    assert np.array_equal(np.asarray(logits.values), want_logits[step])
                    tokens.append(int(np.argmax(logits.values)))
                    pos, ids = pos + len(ids), [tokens[-1]]
                assert tokens == want
                assert transport.chain_stats.frame_link_epochs == (data_path == "frame")
                for stage in route.stages:
                    await transport.close(stage, "t", 0)
                # a first stage without chain credentials cannot link to a TLS successor
                provider = EndpointRouteProvider([addresses[2], addresses[1]], tls=client_tls)
                route = await provider.assign("u", None)
                assert route is not None
                for stage in route.stages:
                    await transport.open(stage, "u", 0)
                with pytest.raises(FrameRejected, match="no chain TLS credentials"):
                    await transport.forward(
                        forward_call(route.stages[0], "u", 0, 0, range(3), [1, 2, 3], None)
                    )
                for stage in route.stages:
                    await transport.close(stage, "u", 0)
        finally:
            for w in (first, second, bare):
                await w.stop()

    run(scenario())


def test_a_ring_fails_an_epoch_whose_session_takes_another_token() -> None:
    """The ring ran the token its last stage took (greedy: the session's sampler states no
    ``Sampling``, so the open carried none); a sampler of the session's own that picks another
    one at step 3 ends that epoch (``RingMismatch``, filed as ``state_lost``: nobody is blamed)
    and the session goes on after one route change."""
    path = ensure_fixture("tiny-llama")
    provider = LoopbackRouteProvider(path, ((0, 2), (2, 4)), options=OPTIONS)
    prompt = prompts_for(256, 12, (51,))[0]

    class Contrary:
        sampling = None

        def __call__(self, logits: Any, position: int, history: Any = ()) -> int:
            best = int(np.argmax(logits))
            return (best + 1) % len(logits) if position - len(prompt) == 3 else best

    contrary = Contrary()

    async def scenario() -> SessionResult:
        transport = ChainStageTransport(timeout=10.0, ring=True)
        async with provider, transport:
            manager = SessionManager(
                transport,
                provider,
                policy=FailurePolicy(step_deadline=10.0, backoff=(0.0,)),
                required_evidence=EvidenceClass.FIXTURE,
            )
            handle = manager.start(prompt, max_new_tokens=8, sampler=contrary)
            result = await handle.wait()
            await manager.aclose()
            return result

    result = run(scenario())
    assert result.state is SessionState.DONE, [r.detail for r in result.reports]
    assert result.route_changes == 1
    (report,) = result.reports
    assert report.fault is FaultKind.STATE_LOST and report.stage_index == 0
    assert "took another token" in report.detail


def chunked_reference(
    path: Path, prompt: Sequence[int], n_tokens: int, chunk: int
) -> tuple[list[int], list[np.ndarray]]:
    """The whole model fed as a route session feeds it: the prompt in pinned chunks of
    ``chunk`` rows (the last row's logits of the last), then one token a call."""
    with ShardEngine(path, **OPTIONS.engine_kwargs()) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        for start in range(0, len(prompt), chunk):
            last = chain.forward(1, 0, prompt[start : start + chunk], start)
        logits, tokens, pos = [last[-1]], [int(np.argmax(last[-1]))], len(prompt)
        while len(tokens) < n_tokens:
            logits.append(chain.forward(1, 0, [tokens[-1]], pos)[-1])
            tokens.append(int(np.argmax(logits[-1])))
            pos += 1
    return tokens, logits


@pytest.mark.parametrize(
    ("data_path", "ring"),
    [("grpc", False), ("frame", True), ("native", True)],
    ids=["grpc-chain", "frame-ring", "native-ring"],
)
def test_a_long_prompt_goes_in_pipelined_frames_bit_for_bit(data_path: str, ring: bool) -> None:
    """A prompt of many pinned chunks: the chained transport sends up to ``prefill_frames``
    of them in one forward, as frames back to back (stage 1 runs frame f while stage 0 runs
    f + 1), each a call of exactly the pinned chunk: tokens and every logits row equal the
    whole model fed in those chunks, and every stage's usage counts every row once."""
    path = ensure_fixture("tiny-llama")
    layout = ((0, 1), (1, 2), (2, 4))
    chunk = 16
    prompts = prompts_for(256, 75, (61, 62))  # 5 chunks: a forward of 4 frames, then 1
    reference = [chunked_reference(path, p, N_TOKENS, chunk) for p in prompts]
    provider = LoopbackRouteProvider(path, layout, options=OPTIONS)

    async def scenario() -> tuple[list[SessionResult], list[LogitsRecorder], ChainStats]:
        recorders = [LogitsRecorder(len(p)) for p in prompts]
        transport = ChainStageTransport(timeout=10.0, ring=ring, data_path=data_path)
        async with provider, transport:
            manager = SessionManager(
                transport,
                provider,
                policy=FailurePolicy(step_deadline=10.0),
                required_evidence=EvidenceClass.FIXTURE,
            )
            native = data_path == "native"  # greedy tokens only there: no logits to record
            handles = [
                manager.start(
                    p, max_new_tokens=N_TOKENS, prefill_chunk=chunk, sampler=None if native else r
                )
                for p, r in zip(prompts, recorders, strict=True)
            ]
            results = [await h.wait() for h in handles]
            await manager.aclose()
        return results, recorders, transport.chain_stats

    results, recorders, stats = run(scenario())
    for result, recorder, (tokens, logits) in zip(results, recorders, reference, strict=True):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == tokens
        for step, row in enumerate(logits if data_path != "native" else ()):
            assert np.array_equal(recorder.logits[step], row), f"logits differ at step {step}"
        rows = len(prompts[0]) + N_TOKENS - 1
        assert {(u.stage_index, u.rows_prefill + u.rows_decode) for u in result.usage} == {
            (i, rows) for i in range(len(layout))
        }
    # each prompt: 5 frames (4 in one forward), counted as sent; a ring sent no decode frame
    sent_decode = 0 if ring else len(prompts) * (N_TOKENS - 1)
    assert stats.sent == len(prompts) * 5 + sent_decode
    assert stats.native_epochs == (len(prompts) if data_path == "native" else 0)
