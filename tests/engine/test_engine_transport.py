"""Route sessions over in-process ShardEngines: the Petals case, hangs, no route, engine errors.

The session manager drives real engines (the tiny llama fixture in the patched llama.cpp) through
``EngineTransport``; time is the virtual clock, so deadlines fire without waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine import errors as E
from dgr_engine.reference import InProcessRoute
from dgr_engine.testing import EngineTransport
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    NoRouteAvailable,
    Route,
    RouteProvider,
    SessionManager,
    SessionState,
)
from dgr_session.testing import (
    ScriptedRouteProvider,
    fixture_identity,
    forward_call,
    make_route,
    run_virtual,
    settle,
)

PROMPT = (17, 4, 99, 230, 5, 61)
KW: dict[str, Any] = {"max_sessions": 4, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 32}
POLICY = FailurePolicy(
    step_deadline=1.0, session_deadline=20.0, max_route_changes=2, backoff=(0.0, 0.5)
)
IDENTITY = fixture_identity(4)


@pytest.fixture()
def transport(tiny_llama: Path) -> Iterator[EngineTransport]:
    t = EngineTransport(lambda a, b: ShardEngine(tiny_llama, layers=(a, b), **KW))
    for name, layers in [("a", (0, 1)), ("b", (1, 3)), ("c", (1, 3)), ("d", (3, 4))]:
        t.start(name, layers)
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> tuple[int, ...]:
    with ShardEngine(tiny_llama, **KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        tokens, _ = chain.greedy(1, 0, PROMPT, 8, all_prefill_logits=False)  # as sessions feed it
    return tuple(tokens)


def route(*endpoints: str):
    return make_route(endpoints, [1, 3], identity=IDENTITY, width=64)


def fixture_manager(transport: EngineTransport, provider: RouteProvider) -> SessionManager:
    """A manager for these routes: they run on fixture lanes (certified with fixture evidence)."""
    return SessionManager(
        transport, provider, policy=POLICY, required_evidence=EvidenceClass.FIXTURE
    )


def test_parity_through_the_session_manager(transport, expected) -> None:
    provider = ScriptedRouteProvider([route("a", "b", "d")])

    async def main():
        async with fixture_manager(transport, provider) as manager:
            return await manager.start(PROMPT, max_new_tokens=8).wait()

    result = run_virtual(main)
    assert result.state is SessionState.DONE and result.tokens == expected
    assert all(e.stats().open_sessions == 0 for e in transport.engines().values())


def test_killed_middle_stage_is_replaced_and_tokens_are_identical(transport, expected) -> None:
    """The Petals case on the real engine: the replacement stage starts at position 0 of a
    fresh epoch and receives the whole replay; the output equals the whole model's."""
    provider = ScriptedRouteProvider([route("a", "b", "d"), route("a", "c", "d")])
    replacement = transport.engines()["c"]

    async def main():
        manager = fixture_manager(transport, provider)
        accepted: list[int] = []

        def on_token(token: int) -> None:
            accepted.append(token)
            if len(accepted) == 3:
                transport.kill("b")

        result = await manager.start(
            PROMPT, max_new_tokens=8, session_id="p", on_token=on_token
        ).wait()
        await manager.aclose()
        return result

    result = run_virtual(main)
    assert result.state is SessionState.DONE
    assert result.tokens == expected
    assert result.epoch == 2 and result.route_changes == 1
    (report,) = result.reports
    assert (report.endpoint, report.fault) == ("b", FaultKind.DEAD)
    # the replacement ran the whole replay: prompt + 3 accepted tokens, then the rest
    assert replacement.stats().rows_forwarded == len(PROMPT) + 3 + (8 - 3 - 1)
    assert replacement.stats().open_sessions == 0


def test_hung_stage_hits_the_deadline_and_its_late_reply_is_dropped(transport, expected) -> None:
    provider = ScriptedRouteProvider([route("a", "b", "d"), route("a", "c", "d")])

    async def main():
        manager = fixture_manager(transport, provider)
        accepted: list[int] = []

        def on_token(token: int) -> None:
            accepted.append(token)
            if len(accepted) == 2:
                transport.hang("b")

        handle = manager.start(PROMPT, max_new_tokens=8, session_id="h", on_token=on_token)
        result = await handle.wait()
        transport.release("b")  # the held reply of epoch 1 arrives late
        await settle()
        await manager.aclose()
        return result, handle.core.stale_events_dropped

    result, _ = run_virtual(main)
    assert result.state is SessionState.DONE and result.tokens == expected
    assert result.reports[0].fault is FaultKind.DEADLINE and result.epoch == 2
    assert transport.engines()["b"].stats().open_sessions == 0


def test_all_routes_gone_fails_with_a_typed_reason_within_the_policy(transport) -> None:
    provider = ScriptedRouteProvider([route("a", "b", "d"), None])

    async def main():
        manager = fixture_manager(transport, provider)

        def on_token(token: int) -> None:
            transport.kill("d")

        loop_start = asyncio.get_running_loop().time()
        result = await manager.start(PROMPT, max_new_tokens=8, on_token=on_token).wait()
        elapsed = asyncio.get_running_loop().time() - loop_start
        await manager.aclose()
        return result, elapsed

    result, elapsed = run_virtual(main)
    assert result.state is SessionState.FAILED
    assert isinstance(result.error, NoRouteAvailable)
    assert len(result.tokens) == 1
    assert elapsed <= POLICY.session_deadline
    assert all(e.stats().open_sessions == 0 for e in transport.engines().values())


def test_engine_errors_are_retried_within_the_budget(transport, expected) -> None:
    provider = ScriptedRouteProvider([route("a", "b", "d"), route("a", "c", "d")])
    transport.fail_next("b", 1)

    async def main():
        async with fixture_manager(transport, provider) as manager:
            return await manager.start(PROMPT, max_new_tokens=8).wait()

    result = run_virtual(main)
    assert result.state is SessionState.DONE and result.tokens == expected
    assert result.reports[0].fault is FaultKind.ENGINE_ERROR


def test_stale_epoch_from_an_engine_is_a_typed_session_error(tiny_llama: Path) -> None:
    from dgr_session.errors import StaleEpoch

    t = EngineTransport(lambda a, b: ShardEngine(tiny_llama, layers=(a, b), **KW))
    t.start("x", (0, 4))
    spec = make_route(["x"], [], identity=IDENTITY, width=64).stages[0]

    async def main():
        await t.open(spec, "s", 3)
        with pytest.raises(StaleEpoch) as info:
            await t.forward(forward_call(spec, "s", 2, 0, range(0, 1), [1], None))
        assert info.value.held_epoch == 3
        logits = await t.forward(forward_call(spec, "s", 3, 0, range(0, 1), [1], None))
        assert np.isfinite(logits.values).all()
        await t.close(spec, "s", 3)
        await t.close(spec, "s", 3)  # not held any more: a no-op

    run_virtual(main)
    t.shutdown()


def test_a_prompt_longer_than_a_shards_batch_is_chunked_and_survives_a_kill(
    tiny_llama: Path,
) -> None:
    """Stages take at most 8 rows per forward (n_batch 8); a 20-token prompt is fed in chunks
    of 8, and after a kill the re-prefill uses the same chunks: tokens equal the whole model's
    fed the same way."""
    small: dict[str, Any] = {**KW, "n_batch": 8}
    prompt = tuple(int(t) for t in (np.arange(20) * 29 + 3) % 256)
    with ShardEngine(tiny_llama, **small) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        for start in range(0, len(prompt), 8):
            logits = chain.forward(1, 0, prompt[start : start + 8], start)
        expected = []
        for step in range(8):
            expected.append(int(np.argmax(logits[-1])))
            logits = chain.forward(1, 0, [expected[-1]], len(prompt) + step)
    t = EngineTransport(lambda a, b: ShardEngine(tiny_llama, layers=(a, b), **small))
    for name, layers in [("a", (0, 1)), ("b", (1, 3)), ("c", (1, 3)), ("d", (3, 4))]:
        t.start(name, layers)

    def limited(*endpoints: str):
        r = route(*endpoints)
        return Route(attrs.evolve(s, max_rows=8) for s in r.stages)

    provider = ScriptedRouteProvider([limited("a", "b", "d"), limited("a", "c", "d")])

    async def main():
        manager = fixture_manager(t, provider)

        def on_token(token: int) -> None:
            if token == expected[2]:
                t.kill("b")

        result = await manager.start(prompt, max_new_tokens=8, on_token=on_token).wait()
        await manager.aclose()
        return result

    try:
        result = run_virtual(main)
    finally:
        t.shutdown()
    assert result.state is SessionState.DONE
    assert result.tokens == tuple(expected) and result.epoch == 2


def test_requests_a_correct_driver_never_sends_are_recorded(transport) -> None:
    spec = route("a", "b", "d").stages[0]

    async def main():
        await transport.open(spec, "v", 1)
        with pytest.raises(E.PositionMismatch):
            await transport.forward(forward_call(spec, "v", 1, 0, range(3, 4), [1], None))

    run_virtual(main)
    (violation,) = transport.violations
    assert "continues at 0" in violation
