"""One route session over a loopback provider's workers, for the tests that watch what the
workers make of it (metrics, usage, logs): the provider is started, the session run to its end
within a bound, then ``after(provider)`` runs while the workers still serve."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    SessionHandle,
    SessionManager,
    SessionResult,
)

TokenHook = Callable[[SessionHandle, int], None]


def lose_last_stage_at(provider: LoopbackRouteProvider, tokens: int) -> TokenHook:
    """An ``on_token`` hook that SIGKILLs the route's last stage once, when the session has
    accepted ``tokens`` tokens."""

    def hook(handle: SessionHandle, _token: int) -> None:
        route = handle.core.route
        if len(handle.tokens) == tokens and route is not None and not provider.reports:
            provider.kill(route.stages[-1].endpoint)

    return hook


def run_session(
    provider: LoopbackRouteProvider,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    session_id: str | None = None,
    on_token: TokenHook | None = None,
    after: Callable[[LoopbackRouteProvider], Awaitable[None]] | None = None,
    seen: Callable[[GrpcStageTransport], None] | None = None,
    limit: float = 120.0,
) -> SessionResult:
    """``seen`` is called with the session's transport (its clients hold the session's
    secrets, e.g. for ``after`` to read the workers' usage as the session's holder)."""

    async def scenario() -> SessionResult:
        async with provider, GrpcStageTransport(timeout=20.0) as transport:
            if seen is not None:
                seen(transport)
            manager = SessionManager(
                transport,
                provider,
                policy=FailurePolicy(step_deadline=20.0),
                required_evidence=EvidenceClass.FIXTURE,
            )
            handles: list[SessionHandle] = []

            def hook(token: int) -> None:
                if on_token is not None:
                    on_token(handles[0], token)

            handles.append(
                manager.start(
                    prompt, max_new_tokens=max_new_tokens, session_id=session_id, on_token=hook
                )
            )
            result = await handles[0].wait()
            await manager.aclose()
            if after is not None:
                await after(provider)
            return result

    return asyncio.run(asyncio.wait_for(scenario(), limit))
