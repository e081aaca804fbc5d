"""Finding the silent stage of a chained route (``client/chained/silence.py``): the first stage
that answered no probe while another did is named, with its probe's typed error; when every
stage answered, or none did (the client's own link), none is."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from dgr_engine.client.chained import SilenceWatch
from dgr_engine.client.chained.silence import find_silent_stage
from dgr_engine.errors import ShardDeadlineExceeded, ShardUnavailable
from dgr_session.route import StageSpec
from dgr_session.testing import fixture_identity, make_route
from tests import harness

ROUTE = make_route(["a:1", "b:1", "c:1", "d:1"], [1, 2, 3], identity=fixture_identity(4)).stages


def _prober(silent: set[str], dead: set[str]) -> Callable[[StageSpec], Awaitable[None]]:
    async def probe(stage: StageSpec) -> None:
        if stage.endpoint in dead:
            raise ShardUnavailable("connection refused")
        if stage.endpoint in silent:
            raise ShardDeadlineExceeded("no answer within 1.0 s")

    return probe


@pytest.mark.parametrize(
    ("silent", "dead", "named", "kind"),
    [
        (set(), set(), None, None),
        ({"b:1"}, set(), 1, ShardDeadlineExceeded),
        ({"c:1", "d:1"}, set(), 2, ShardDeadlineExceeded),
        (set(), {"d:1"}, 3, ShardUnavailable),
        ({"a:1", "b:1", "c:1", "d:1"}, set(), None, None),  # the client's own link
    ],
)
def test_the_first_stage_that_did_not_answer_is_named_when_another_did(
    silent: set[str], dead: set[str], named: int | None, kind: type | None
) -> None:
    found = harness.run(find_silent_stage(ROUTE, _prober(silent, dead)), 10.0)
    if named is None:
        assert found is None
    else:
        assert found is not None and found.index == named
        assert isinstance(found.error, kind)  # type: ignore[arg-type]
        assert f"stage {named} answered no probe" in str(found.error)


def test_a_cancelled_probe_is_not_taken_for_a_stages_answer() -> None:
    async def cancelled(_stage: StageSpec) -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        harness.run(find_silent_stage(ROUTE, cancelled), 10.0)


def test_a_watch_has_positive_times() -> None:
    assert SilenceWatch().after > 0 and SilenceWatch().timeout > 0
    for bad in ({"after": 0.0}, {"timeout": -1.0}):
        with pytest.raises(ValueError, match="must be > 0 seconds"):
            SilenceWatch(**bad)  # type: ignore[arg-type]
