"""Several route sessions over in-process shard engines; one stage dies mid-decode.

Run: ``.venv/bin/python examples/route_sessions.py``. No network and no subprocess: each
"worker" is a ``ShardEngine`` inside this process, reached through
``dgr_engine.testing.EngineTransport`` (the in-process stage transport with fault injection that
tests use). A ``SessionManager`` runs three sessions at once over a route of three stages; when
session 0 has accepted 4 tokens the middle stage is killed. Every session then gets a new route
(the spare), opens a new epoch and re-prefills from position 0 (a cache miss, never a KV
migration), and still produces exactly the whole model's greedy tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import os

# OpenMP threads spin while they wait by default; several engines in one process on a small
# machine then starve each other. Set before the engine's native library is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dgr_engine import ShardEngine
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.options import EngineOptions
from dgr_engine.reference import n_layer_of, whole_model_greedy
from dgr_engine.testing import EngineTransport
from dgr_session import (
    EvidenceClass,
    FailureReport,
    ModelIdentity,
    Route,
    SessionManager,
    SessionState,
)
from dgr_session.testing import make_route

PATH = ensure_fixture("tiny-llama")  # a generated 4-layer GGUF: fixture evidence only
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=64, n_batch=32, max_sessions=4)
# What every stage of a route must serve. The content hash is the GGUF's SHA-256, as a worker's
# advert states it (dgr_session compares identities; it never reads files).
IDENTITY = ModelIdentity(
    content_hash=hashlib.sha256(PATH.read_bytes()).digest(), arch="llama", n_layer=n_layer_of(PATH)
)
LAYOUT = [(0, 1), (1, 3), (3, 4)]  # the ranges of a route, in order
WORKERS = {"a": (0, 1), "b": (1, 3), "b-spare": (1, 3), "c": (3, 4)}  # endpoint -> layers
PROMPTS = [[1, 17, 42, 99, 7, 64], [5, 8, 13, 21, 34], [250, 3, 77, 12, 9, 200, 31]]
N_NEW = 12


class FirstLiveWorker:
    """The tracker's role (a ``dgr_session.RouteProvider``), as small as it gets: for each range
    of the layout, the first worker that is still alive."""

    def __init__(self, transport: EngineTransport) -> None:
        self.transport = transport

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        if report is not None:  # what the session saw fail: stage, endpoint, fault, step
            print(
                f"  {session_id}: stage {report.endpoint} {report.fault.value} at step "
                f"{report.step}; asking for a new route"
            )
        chosen = []
        for layers in LAYOUT:
            live = [e for e, r in WORKERS.items() if r == layers and self.transport.alive(e)]
            if not live:
                return None  # no route: the session fails with NoRouteAvailable
            chosen.append(live[0])
        # make_route (dgr_session.testing) cuts the model at the interior layers given, with a
        # test recipe and a lane certified with fixture evidence; the boundary between stages
        # is n_embd = 64 floats per token.
        cuts = [end for _, end in LAYOUT[:-1]]
        return make_route(chosen, cuts, identity=IDENTITY, width=64)


async def main() -> None:
    transport = EngineTransport(
        lambda a, b: ShardEngine(PATH, layers=(a, b), **OPTIONS.engine_kwargs())
    )
    try:
        for endpoint, layers in WORKERS.items():
            transport.start(endpoint, layers)
        # The routes run on fixture lanes, so the manager must ask for no more than fixture
        # evidence; its default (real-hardware) refuses them: each session would fail with
        # InsufficientEvidence reports before sending a byte. Dark lanes never route.
        manager = SessionManager(
            transport, FirstLiveWorker(transport), required_evidence=EvidenceClass.FIXTURE
        )
        async with manager:

            def on_token(token: int) -> None:  # session 0's tokens, as they are accepted
                if len(handles[0].tokens) == 4 and transport.alive("b"):
                    print("  killing stage 'b' [1, 3) mid-decode")
                    transport.kill("b")

            handles = [
                manager.start(
                    p,
                    max_new_tokens=N_NEW,
                    session_id=f"s{i}",
                    on_token=on_token if i == 0 else None,
                )
                for i, p in enumerate(PROMPTS)
            ]
            results = [await handle.wait() for handle in handles]
        # The manager is closed: every stage each session opened has been closed again.
        assert all(e.stats().open_sessions == 0 for e in transport.engines().values())
        assert transport.violations == []  # no position that failed to continue the KV
    finally:
        transport.shutdown()

    expected = whole_model_greedy(PATH, PROMPTS, N_NEW, OPTIONS)
    for result, want, handle in zip(results, expected, handles, strict=True):
        route = handle.core.route
        print(
            f"{result.session_id}: {result.state.value}, epoch {result.epoch}, route changes "
            f"{result.route_changes}, last route {route.endpoints if route else None}, "
            f"whole-model equal {list(result.tokens) == want}"
        )
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == want
    assert results[0].route_changes == 1  # session 0 was mid-decode when 'b' died
    print("route_sessions: OK")


if __name__ == "__main__":
    asyncio.run(main())
