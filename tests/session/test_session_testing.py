"""The fakes the other tests lean on: the fake model and transport behave like a layered model."""

from __future__ import annotations

import asyncio

import pytest

from dgr_session import Boundary, Forward, ForwardKind, Logits, StageDead, StaleEpoch, greedy
from dgr_session.testing import (
    FakeEngineError,
    FakeModel,
    FakeTransport,
    fixture_identity,
    forward_call,
    make_route,
    run_virtual,
    settle,
)

MODEL = FakeModel(n_layer=5, vocab=16)
IDENTITY = fixture_identity(MODEL.n_layer)


async def chain(transport: FakeTransport, cuts: list[int], sid: str, tokens: list[int]) -> int:
    """Prefill ``tokens`` through a route cut at ``cuts``; the greedy next token."""
    route = make_route([f"e{i}" for i in range(len(cuts) + 1)], cuts, identity=IDENTITY)
    for stage in route.stages:
        await transport.open(stage, sid, 1)
    rows: object = None
    result: object = None
    for stage in route.stages:
        result = await transport.forward(
            forward_call(stage, sid, 1, 0, range(len(tokens)), tokens, rows)
        )
        rows = result.rows if isinstance(result, Boundary) else None
    assert isinstance(result, Logits)
    return greedy(result.values)


@pytest.mark.parametrize("cuts", [[], [1], [2, 4], [1, 2, 3, 4]])
def test_cut_points_do_not_change_the_output(cuts: list[int]) -> None:
    tokens = [3, 1, 4, 1, 5]
    expected = MODEL.reference(tokens, 1)[0]
    assert run_virtual(chain(FakeTransport(MODEL), cuts, "s", tokens)) == expected


def test_history_positions_and_sessions_matter() -> None:
    assert MODEL.reference([1, 2, 3], 6) != MODEL.reference([1, 2, 4], 6)
    assert MODEL.reference([1, 2, 3], 6)[:3] == MODEL.reference([1, 2, 3], 3)


def test_stage_refuses_what_a_real_engine_refuses() -> None:
    transport = FakeTransport(MODEL)
    (stage,) = make_route(["a"], [], identity=IDENTITY).stages

    async def main() -> None:
        with pytest.raises(FakeEngineError, match="not open"):
            await transport.forward(forward_call(stage, "s", 1, 0, range(0, 1), [1], None))
        await transport.open(stage, "s", 2)
        with pytest.raises(StaleEpoch):
            await transport.open(stage, "s", 1)
        with pytest.raises(FakeEngineError, match="do not continue"):
            await transport.forward(forward_call(stage, "s", 2, 0, range(1, 2), [1], None))
        assert transport.violations  # a correct driver never does that
        await transport.forward(forward_call(stage, "s", 2, 0, range(0, 2), [1, 2], None))
        await transport.open(stage, "s", 3)  # a newer epoch discards the older one
        assert transport.slots() == {("a", "s"): 3}
        await transport.forward(forward_call(stage, "s", 3, 0, range(0, 1), [1], None))
        await transport.close(stage, "s", 2)  # closing an older epoch leaves the newer
        assert transport.slots() == {("a", "s"): 3}
        await transport.close(stage, "s", 3)
        assert transport.slots() == {}

    run_virtual(main)


def test_faults_kill_hang_release_fail() -> None:
    transport = FakeTransport(MODEL)
    (stage,) = make_route(["a"], [], identity=IDENTITY).stages

    async def main() -> None:
        transport.fail_next("a")
        with pytest.raises(FakeEngineError, match="injected"):
            await transport.open(stage, "s", 1)
        assert transport.violations == []
        transport.hang("a")
        held = asyncio.ensure_future(transport.open(stage, "s", 1))
        await settle()
        assert not held.done() and transport.held_replies("a") == 1
        assert transport.slots() == {("a", "s"): 1}  # applied at once, reply held
        transport.release("a")
        await held
        transport.hang("a")
        lost = asyncio.ensure_future(
            transport.forward(forward_call(stage, "s", 1, 0, range(1), [1], None))
        )
        await settle()
        transport.kill("a")
        with pytest.raises(StageDead):
            await lost
        assert transport.slots() == {} and not transport.healthy("a")
        with pytest.raises(StageDead):
            await transport.open(stage, "s", 2)
        transport.revive("a")
        await transport.open(stage, "s", 2)
        assert transport.healthy("a")

    run_virtual(main)


def test_latency_is_loop_time() -> None:
    transport = FakeTransport(MODEL, latency=0.25)
    (stage,) = make_route(["a"], [], identity=IDENTITY).stages

    async def main() -> float:
        await transport.open(stage, "s", 1)
        await transport.forward(forward_call(stage, "s", 1, 0, range(2), [1, 2], None))
        return asyncio.get_running_loop().time()

    assert run_virtual(main) == 0.5


def test_forward_call_is_the_forward_the_core_would_emit() -> None:
    first, last = make_route(["a", "b"], [2], identity=IDENTITY).stages
    call = forward_call(first, "s", 3, 1, range(4, 6), [7, 8], None, wants_logits=False)
    assert isinstance(call, Forward)
    assert (call.session_id, call.epoch, call.step, call.positions) == ("s", 3, 1, range(4, 6))
    assert call.token_ids == (7, 8) and call.boundary is None and not call.wants_logits
    assert call.kind == "decode" and not call.final  # the first stage hands on rows
    again = forward_call(last, "s", 3, 1, range(4, 6), [7, 8], "rows", kind=ForwardKind.REPLAY)
    assert again.final and again.kind == "replay" and again.boundary == "rows"
