"""End to end: rings over native links (``docs/native-path.md``) of real ``dgr worker``
processes on 127.0.0.1. Tokens equal the whole model's; a middle stage SIGKILLed mid-decode
ends the epoch blaming that stage, and the session re-prefills on a new route with exact
tokens; connections that are not an honest stage's or client's are refused at their HELLO
and an honest session beside them keeps its exact tokens. Every wait is bounded; the
provider stops every process it started."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import expectations_for
from dgr_engine.client.routes import describe
from dgr_engine.client.shard_client import ShardClient
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.throwaway_ca import local_pki
from dgr_engine.wire import link_messages as lm
from dgr_engine.wire import link_seal
from dgr_engine.wire.frame_link import split_endpoint
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    SessionHandle,
    SessionManager,
    SessionResult,
    SessionState,
)
from tests import harness

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

N_TOKENS = 12
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)


def prompts_for(n_vocab: int, size: int, seeds: Sequence[int]) -> list[list[int]]:
    return [[int(t) for t in np.random.default_rng(s).integers(0, n_vocab, size)] for s in seeds]


async def drive(
    provider: LoopbackRouteProvider,
    prompts: Sequence[Sequence[int]],
    *,
    kill_at: int | None = None,
    policy: FailurePolicy | None = None,
    n_tokens: int = N_TOKENS,
) -> tuple[list[SessionResult], ChainStageTransport, list[str]]:
    handles: list[SessionHandle] = []
    killed: list[str] = []

    def on_token(_token: int) -> None:
        if kill_at is not None and not killed and len(handles[0].tokens) == kill_at:
            route = handles[0].core.route
            assert route is not None
            killed.append(provider.kill(route.stages[1].endpoint).endpoint)

    await provider.start()
    try:
        transport = ChainStageTransport(
            timeout=10.0, close_timeout=2.0, ring=True, data_path="native"
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
                        max_new_tokens=n_tokens,
                        session_id=f"native-{i}",
                        on_token=on_token if i == 0 else None,
                    )
                )
            results = [await h.wait() for h in handles]
            await manager.aclose()
    finally:
        await provider.aclose()
    for worker in provider.workers:
        assert not worker.running, f"{worker} still running"
    return results, transport, killed


@pytest.mark.parametrize(
    ("fixture", "layout"),
    [
        ("tiny-llama", ((0, 2), (2, 4))),
        ("tiny-llama", ((0, 1), (1, 2), (2, 3), (3, 4))),
        ("tiny-v4", ((0, 1), (1, 3), (3, 6))),
    ],
    ids=["llama-2-stages", "llama-4-stages", "v4-3-stages"],
)
def test_a_native_ring_equals_the_whole_model(
    fixture: str, layout: tuple[tuple[int, int], ...]
) -> None:
    path = ensure_fixture(fixture)
    prompts = prompts_for(256, 20, (11, 12))
    reference = whole_model_reference(path, prompts, N_TOKENS, OPTIONS)
    provider = LoopbackRouteProvider(path, layout, options=OPTIONS)
    results, transport, _ = harness.run(drive(provider, prompts), 90.0)
    for result, (tokens, _logits) in zip(results, reference, strict=True):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == tokens
        assert (result.epoch, result.route_changes, result.reports) == (1, 0, ())
    stats = transport.chain_stats
    assert stats.native_epochs == len(prompts) and stats.frame_link_epochs == 0
    # the client sent each prompt; every decode frame went round the ring by itself
    assert stats.sent == len(prompts)
    assert stats.frames == len(prompts) * N_TOKENS
    # each pass's engine time came back with its token, all of it llama.cpp's
    assert 0 < stats.native_us == stats.compute_us


def test_a_native_ring_survives_a_middle_stage_killed_mid_decode() -> None:
    path = ensure_fixture("tiny-llama")
    layout = ((0, 1), (1, 2), (2, 3), (3, 4))
    prompts = prompts_for(256, 16, (21, 22))
    # long enough that the ring, which runs on without the client, is still decoding when
    # the stage dies (a token costs it well under a millisecond here)
    n_tokens = 200
    reference = whole_model_reference(path, prompts, n_tokens, OPTIONS)
    provider = LoopbackRouteProvider(path, layout, spares=[(1, 2)], options=OPTIONS)
    policy = FailurePolicy(step_deadline=10.0, backoff=(0.0,))
    run = drive(provider, prompts, kill_at=5, policy=policy, n_tokens=n_tokens)
    results, _, killed = harness.run(run, 120.0)
    assert len(killed) == 1
    for result, (tokens, _) in zip(results, reference, strict=True):
        assert result.state is SessionState.DONE, (result.error, result.reports)
        assert list(result.tokens) == tokens  # re-prefilled on a new route, tokens exact
    # the session it was killed under lost its epoch to it, blamed as dead; the other, if it
    # was still decoding there (a native ring may have finished it), the same
    assert results[0].route_changes == 1, results[0].reports
    for result in results:
        if result is not results[0] and result.route_changes == 0:
            continue
        assert result.route_changes == 1, result.reports
        (report,) = result.reports
        assert (report.fault, report.endpoint, report.stage_index) == (
            FaultKind.DEAD,
            killed[0],
            1,
        )


async def _introduce(port: int, data: bytes, *, timeout: float = 10.0) -> Any:
    """Sends ``data`` to a native link port: the answer's kind, and for a ``FAILED`` the
    dgr-status its message starts with (``None``: closed unanswered)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            header, payload = await lm.read_stream_message(reader, lm.HELLO_MAX_BYTES)
        if header.kind is not lm.Kind.FAILED:
            return header.kind
        return header.kind, payload.decode().split(":")[0]
    except asyncio.IncompleteReadError:
        return None
    finally:
        writer.close()


def test_hostile_connections_are_refused_and_an_honest_ring_stays_exact() -> None:
    path = ensure_fixture("tiny-llama")
    layout = ((0, 2), (2, 4))
    prompts = prompts_for(256, 20, (31,))
    ((want, _),) = whole_model_reference(path, prompts, N_TOKENS, OPTIONS)
    provider = LoopbackRouteProvider(path, layout, options=OPTIONS)

    async def scenario() -> list[Any]:
        seen: list[Any] = []
        async with provider:
            route = await provider.assign("victim", None)
            assert route is not None
            first, last = route.stages
            adverts = [await describe(s.endpoint) for s in (first, last)]
            ports = [a.data_paths.native_link_port for a in adverts]
            assert all(ports), "a worker without TLS offers native links"
            async with ShardClient(first.endpoint) as c0:
                await c0.open("s", 1, expectations_for(first))
                secret = c0.session_secret("s", 1)

                def hello(
                    role: lm.Role, sid: str = "s", epoch: int = 1, key: bytes = secret
                ) -> bytes:
                    return lm.encode_hello(lm.Hello(role, sid, epoch, key, 0))

                attacks = {
                    "wrong secret": hello(lm.Role.INPUT, key=bytes(16)),
                    "stale epoch": hello(lm.Role.INPUT, epoch=0),
                    "unknown session": hello(lm.Role.INPUT, sid="nobody"),
                    "output at a first stage": hello(lm.Role.OUTPUT),
                    "rows before a hello": lm.encode_rows(1, 0, 0, [1, 2, 3]),
                    "garbage": b"\x00" * 56,
                    "bad session id": hello(lm.Role.INPUT, sid="bad id\n"),
                }
                for name, data in attacks.items():
                    seen.append((name, await _introduce(ports[0], data)))
                seen.append(("first input", await _introduce(ports[0], hello(lm.Role.INPUT))))
            # an honest ring on the same workers stays exact
            transport = ChainStageTransport(timeout=10.0, ring=True, data_path="native")
            async with transport:
                manager = SessionManager(
                    transport,
                    provider,
                    policy=FailurePolicy(step_deadline=10.0),
                    required_evidence=EvidenceClass.FIXTURE,
                )
                result = await manager.start(prompts[0], max_new_tokens=N_TOKENS).wait()
                await manager.aclose()
            seen.append(("honest", (result.state, list(result.tokens))))
            host, _ = split_endpoint(first.endpoint)
            seen.append(("host", host))
        return seen

    seen = dict(harness.run(scenario(), 90.0))
    assert seen == {
        "wrong secret": (lm.Kind.FAILED, "DGR_E_UNAUTHENTICATED"),
        "stale epoch": (lm.Kind.FAILED, "DGR_E_STALE_EPOCH"),
        "unknown session": (lm.Kind.FAILED, "DGR_E_UNKNOWN_SESSION"),
        "output at a first stage": (lm.Kind.FAILED, "DGR_E_FRAME"),
        "rows before a hello": (lm.Kind.FAILED, "DGR_E_FRAME"),
        "garbage": (lm.Kind.FAILED, "DGR_E_FRAME"),
        "bad session id": (lm.Kind.FAILED, "DGR_E_FRAME"),
        "first input": lm.Kind.HELLO,
        "honest": (SessionState.DONE, want),
        "host": "127.0.0.1",
    }


def test_a_sealed_native_ring_over_mutual_tls_equals_the_whole_model(tmp_path: Path) -> None:
    """Workers serving mutual TLS seal their native links (``wire/link_seal.py``): the advert
    says so, an introduction in the clear (even with the right secret) or one that proves the
    wrong secret is refused ``DGR_E_UNAUTHENTICATED``, and a ring of greedy sessions over the
    sealed links gives the whole model's tokens."""
    pki = local_pki(tmp_path)
    chain = ["--chain-tls-ca", str(pki.ca), "--chain-tls-cert", str(pki.client.cert)]
    chain += ["--chain-tls-key", str(pki.client.key)]
    tls = pki.client_tls()
    path = ensure_fixture("tiny-llama")
    prompts = prompts_for(256, 20, (51, 52))
    reference = whole_model_reference(path, prompts, N_TOKENS, OPTIONS)
    provider = LoopbackRouteProvider(
        path,
        ((0, 2), (2, 4)),
        options=OPTIONS,
        worker_args=[*pki.worker_args(), *chain],
        client_tls=tls,
    )

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with provider:
            route = await provider.assign("probe", None)
            assert route is not None
            first = route.stages[0]
            advert = await describe(first.endpoint, tls=tls)
            port = advert.data_paths.native_link_port
            seen["advert"] = (bool(port), advert.data_paths.native_link_sealed)
            async with ShardClient(first.endpoint, tls=tls) as c0:
                await c0.open("s", 1, expectations_for(first))
                secret = c0.session_secret("s", 1)
                clear = lm.Hello(lm.Role.INPUT, "s", 1, secret, 0)
                seen["clear, right secret"] = await _introduce(port, lm.encode_hello(clear))
                wrong = link_seal.Dialer(lm.Role.INPUT, "s", 1, bytes(16), 0).hello
                seen["sealed, wrong secret"] = await _introduce(port, lm.encode_hello(wrong))
                right = link_seal.Dialer(lm.Role.INPUT, "s", 1, secret, 0).hello
                seen["sealed, right secret"] = await _introduce(port, lm.encode_hello(right))
            transport = ChainStageTransport(timeout=10.0, ring=True, data_path="native", tls=tls)
            async with transport:
                manager = SessionManager(
                    transport,
                    provider,
                    policy=FailurePolicy(step_deadline=10.0),
                    required_evidence=EvidenceClass.FIXTURE,
                )
                handles = [manager.start(p, max_new_tokens=N_TOKENS) for p in prompts]
                seen["tokens"] = [list((await h.wait()).tokens) for h in handles]
                await manager.aclose()
            seen["native epochs"] = transport.chain_stats.native_epochs
        return seen

    seen = harness.run(scenario(), 120.0)
    assert seen == {
        "advert": (True, True),
        "clear, right secret": (lm.Kind.FAILED, "DGR_E_UNAUTHENTICATED"),
        "sealed, wrong secret": (lm.Kind.FAILED, "DGR_E_UNAUTHENTICATED"),
        "sealed, right secret": lm.Kind.HELLO,
        "tokens": [tokens for tokens, _ in reference],
        "native epochs": len(prompts),
    }
