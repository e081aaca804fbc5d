"""Routes over fixed endpoints: an endpoint that cannot be reached is named, with why."""

from __future__ import annotations

import asyncio

import pytest

from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.client.shard_client import ShardClient
from dgr_engine.errors import ShardUnavailable
from dgr_session.errors import StageUnreachable
from tests.harness import closed_port


def test_an_unreachable_endpoint_is_named_with_its_stage_and_why() -> None:
    endpoint = f"127.0.0.1:{closed_port()}"
    provider = EndpointRouteProvider([endpoint], probe_timeout=5.0)
    with pytest.raises(StageUnreachable) as caught:
        asyncio.run(asyncio.wait_for(provider.assign("s", None), 30))
    error = caught.value
    assert (error.stage_index, error.endpoint) == (0, endpoint)
    assert str(error) == f"stage 0 ({endpoint}) is unreachable: Connection refused"
    assert isinstance(error.__cause__, ShardUnavailable)
    assert isinstance(error, ConnectionError)


def test_require_serving_raises_what_serving_turns_into_false() -> None:
    endpoint = f"127.0.0.1:{closed_port()}"

    async def main() -> bool:
        async with ShardClient(endpoint, timeout=5.0) as client:
            with pytest.raises(ShardUnavailable, match="Connection refused"):
                await client.require_serving()
            return await client.serving()

    assert asyncio.run(asyncio.wait_for(main(), 30)) is False
