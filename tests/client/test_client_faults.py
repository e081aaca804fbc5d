"""Failures of the client's own making blame no stage (issue 28, items 2 and 11).

A session id that cannot be gRPC metadata once made the client's own call fail; the transport
filed that as ``engine_error`` on stage 0, the loopback provider excluded the healthy primary and
the spare, and the next ordinary session failed with ``NoRouteAvailable``. Now such ids are
refused with ``InvalidIdentifier`` before any call (manager, client, transports), a call gRPC
fails in this process is the client's ``ClientCallError``, both are filed under the fault kind
``client``, and a session that meets one ends as ``ClientFailure`` without any report naming a
stage. The hostile ids run against real workers too (relay and chained routes), each followed by
an ordinary session on the same provider whose tokens are the whole model's. And with no spare
left, the final ``NoRouteAvailable`` names the stage whose loss left no route.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.shard_client import ShardClient, session_metadata
from dgr_engine.errors import ClientCallError, ShardUnavailable
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.loopback import LoopbackRouteProvider, PooledWorker
from dgr_engine.wire.frames import Expectations
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session import (
    ClientFailure,
    CloseStage,
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    Forward,
    InvalidIdentifier,
    NoRouteAvailable,
    RequestRoute,
    Route,
    RouteAssigned,
    RouteSession,
    RouteUnavailable,
    SessionManager,
    SessionState,
    StageFailed,
    StageOpened,
    StageResult,
    StageSpec,
    StageTransport,
    Start,
    fault_kind,
)
from dgr_session.machine import SessionMachine
from dgr_session.sampling import Sampling
from dgr_session.testing import (
    FakeModel,
    FakeTransport,
    ScriptedRouteProvider,
    fixture_identity,
    forward_call,
    make_route,
    run_virtual,
    settle,
)
from tests.harness import WORKER_OPTIONS, run

T = TypeVar("T")

HOSTILE = {
    "newline": "evil\nINFO forged line",
    "non-ascii": "s\u00e9ance",
    "empty": "",
    "too-long": "x" * 129,
}
"""Session ids the hostile pass used (and the two ends of the length rule)."""

UNREACHABLE = "127.0.0.1:1"
"""Nothing listens there: a call that is sent fails with ``ShardUnavailable``."""

EXPECT = Expectations(b"\0" * 32, 0, 2, 0)

MODEL = FakeModel(n_layer=6, vocab=32)
IDENTITY = fixture_identity(MODEL.n_layer)
POLICY = FailurePolicy(
    step_deadline=2.0,
    session_deadline=60.0,
    max_route_changes=3,
    max_attempts_per_step=3,
    backoff=(0.0, 0.5),
)
PROMPT = (3, 1, 4, 1, 5)


def fake_route(*endpoints: str) -> Route:
    n = len(endpoints)
    cuts = [MODEL.n_layer * k // n for k in range(1, n)]
    return make_route(list(endpoints), cuts, identity=IDENTITY)


# --- the shard client ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_shard_client_refuses_a_hostile_id_before_any_call(value: str) -> None:
    async def main() -> None:
        async with ShardClient(UNREACHABLE, timeout=5.0) as client:
            with pytest.raises(InvalidIdentifier):
                await client.open(value, 1, EXPECT)
            with pytest.raises(InvalidIdentifier):
                await client.forward(value, 1, 0, EXPECT, [0], tokens=[1])
            with pytest.raises(InvalidIdentifier):
                await client.close(value, 1)
            with pytest.raises(InvalidIdentifier):
                await client.usage(value)
            # an ordinary id's call does go out, and finds nobody there
            with pytest.raises(ShardUnavailable):
                await client.open("ordinary", 1, EXPECT)

    run(main())


@pytest.mark.parametrize("name", ["newline", "non-ascii", "too-long"])
def test_session_metadata_refuses_an_id_that_cannot_be_metadata(name: str) -> None:
    with pytest.raises(InvalidIdentifier):
        session_metadata(pb.ForwardRequest(session_id=HOSTILE[name], epoch=1, step=2))


def test_session_metadata_of_an_ordinary_frame() -> None:
    request = pb.ForwardRequest(session_id="e2e-0", epoch=1, step=2)
    assert session_metadata(request) == (
        ("dgr-session", "e2e-0"),
        ("dgr-epoch", "1"),
        ("dgr-step", "2"),
    )
    assert session_metadata(pb.DescribeRequest()) == ()
    # no session id (a request that names none): no dgr-session key at all
    assert session_metadata(pb.ForwardRequest(epoch=1, step=2)) == (
        ("dgr-epoch", "1"),
        ("dgr-step", "2"),
    )


def test_a_call_grpc_fails_in_this_process_is_the_clients_fault() -> None:
    """gRPC's own local error (here ``UsageError``: the client's channel is closed) used to
    escape untyped and be filed as the stage's ``engine_error``."""

    async def main() -> None:
        client = ShardClient(UNREACHABLE, timeout=5.0)
        await client.aclose()
        with pytest.raises(ClientCallError, match="Channel is closed") as caught:
            await client.open("ordinary", 1, EXPECT)
        assert fault_kind(caught.value) is FaultKind.CLIENT
        with pytest.raises(ClientCallError, match="Channel is closed"):
            await client.describe()

    run(main())


# --- the session: a client fault ends it, blaming nobody ----------------------------------------


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_sans_io_core_refuses_a_hostile_id_too(value: str) -> None:
    with pytest.raises(InvalidIdentifier):
        RouteSession(value, PROMPT, max_new_tokens=4, machine=SessionMachine())


def test_a_client_fault_ends_the_session_without_a_report_naming_a_stage() -> None:
    core = RouteSession(
        "s",
        PROMPT,
        max_new_tokens=4,
        policy=POLICY,
        required_evidence=EvidenceClass.FIXTURE,
        machine=SessionMachine(),
    )
    core.handle(Start("s", 0.0))
    r = fake_route("a", "b", "c")
    core.handle(RouteAssigned("s", 1, r, 1))
    core.handle(StageOpened("s", 1, 0))
    out = core.handle(
        StageFailed(session_id="s", epoch=1, stage_index=1, kind=FaultKind.CLIENT, detail="bad")
    )
    assert core.state is SessionState.FAILED
    assert not [c for c in out if isinstance(c, RequestRoute)]  # no provider hears of it
    assert [c.stage_index for c in out if isinstance(c, CloseStage)] == [0, 1, 2]
    error = core.error
    assert isinstance(error, ClientFailure)
    assert (error.stage_index, error.endpoint, error.fault) == (None, None, FaultKind.CLIENT)
    assert error.attempts == 1 and error.route_changes == 0
    assert "stage 1 (b) failed in this client: bad" in str(error)
    (report,) = core.reports
    assert (report.stage_index, report.endpoint, report.fault) == (None, None, FaultKind.CLIENT)


class ClientBroken(StageTransport):
    """A stage transport whose opens of the sessions in ``broken`` fail in the client itself
    (as a closed channel or invalid metadata does); everything else goes to ``inner``."""

    def __init__(self, inner: FakeTransport, broken: set[str]) -> None:
        self.inner = inner
        self.broken = broken

    async def open(
        self, stage: StageSpec, session_id: str, epoch: int, sampling: Sampling | None = None
    ) -> None:
        if session_id in self.broken:
            raise ClientCallError("the call failed in this client, nothing was sent")
        await self.inner.open(stage, session_id, epoch)

    async def forward(self, call: Forward) -> StageResult:
        return await self.inner.forward(call)

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        await self.inner.close(stage, session_id, epoch)


def test_a_client_fault_reaches_no_provider_and_the_next_session_runs() -> None:
    inner = FakeTransport(MODEL, record=True)
    transport = ClientBroken(inner, {"broken"})
    provider = ScriptedRouteProvider([fake_route("a", "b")])

    async def main() -> None:
        manager = SessionManager(
            transport, provider, policy=POLICY, required_evidence=EvidenceClass.FIXTURE
        )
        failed = await manager.start(PROMPT, max_new_tokens=4, session_id="broken").wait()
        assert failed.state is SessionState.FAILED
        assert isinstance(failed.error, ClientFailure), failed.error
        assert failed.epoch == 1 and failed.route_changes == 0
        ordinary = await manager.start(PROMPT, max_new_tokens=4, session_id="ordinary").wait()
        assert ordinary.state is SessionState.DONE, ordinary.error
        assert ordinary.tokens == MODEL.reference(PROMPT, 4)
        await settle()
        assert inner.slots() == {}

    run_virtual(main)
    # one request per session, and none carried a report: nobody was blamed
    assert provider.requests == [("broken", None), ("ordinary", None)]


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_manager_refuses_a_hostile_id_before_asking_anyone(value: str) -> None:
    transport = FakeTransport(MODEL, record=True)
    provider = ScriptedRouteProvider([fake_route("a", "b")])

    async def main() -> None:
        manager = SessionManager(
            transport, provider, policy=POLICY, required_evidence=EvidenceClass.FIXTURE
        )
        with pytest.raises(InvalidIdentifier):
            manager.start(PROMPT, max_new_tokens=4, session_id=value)
        assert len(manager) == 0
        await settle()
        assert provider.requests == [] and transport.calls == []
        result = await manager.start(PROMPT, max_new_tokens=4, session_id="ordinary").wait()
        assert result.tokens == MODEL.reference(PROMPT, 4)

    run_virtual(main)


# --- the final NoRouteAvailable names the dead stage --------------------------------------------


def test_no_route_available_names_the_stage_whose_loss_left_no_route() -> None:
    core = RouteSession(
        "s",
        PROMPT,
        max_new_tokens=4,
        policy=FailurePolicy(max_attempts_per_step=3, backoff=(0.0,)),  # retries at once
        required_evidence=EvidenceClass.FIXTURE,
        machine=SessionMachine(),
    )
    core.handle(Start("s", 0.0))
    core.handle(RouteAssigned("s", 1, fake_route("a", "b"), 1))
    detail = "StageDead('b: forward step 0: connection refused')"
    (retry,) = [
        c
        for c in core.handle(
            StageFailed(session_id="s", epoch=1, stage_index=1, kind=FaultKind.DEAD, detail=detail)
        )
        if isinstance(c, RequestRoute)
    ]
    (again,) = core.handle(RouteUnavailable("s", 2, "provider has no route", retry.attempt))
    assert isinstance(again, RequestRoute)
    core.handle(RouteUnavailable("s", 2, "provider has no route", again.attempt))
    error = core.error
    assert isinstance(error, NoRouteAvailable)
    assert error.fault is FaultKind.NO_ROUTE and error.stage_index is None
    lost = error.lost
    assert lost is not None
    assert (lost.stage_index, lost.endpoint, lost.fault, lost.epoch) == (1, "b", FaultKind.DEAD, 1)
    assert f"the route was lost at stage 1 (b), epoch 1: dead ({detail})" in str(error)


def test_no_route_available_names_no_stage_when_none_failed() -> None:
    core = RouteSession(
        "s",
        PROMPT,
        max_new_tokens=4,
        policy=FailurePolicy(max_attempts_per_step=3, backoff=(0.0,)),  # retries at once
        required_evidence=EvidenceClass.FIXTURE,
        machine=SessionMachine(),
    )
    core.handle(Start("s", 0.0))
    for attempt in (1, 2, 3):
        core.handle(RouteUnavailable("s", 1, "empty pool", attempt))
    error = core.error
    assert isinstance(error, NoRouteAvailable) and error.lost is None
    assert "lost at" not in str(error)


# --- real workers: the hostile ids, then an ordinary session on the same provider ---------------

OPTIONS = WORKER_OPTIONS
N_TOKENS = 8
ORDINARY = [int(t) for t in np.random.default_rng(28).integers(0, 256, size=10)]


def scrape(worker: PooledWorker) -> dict[str, float]:
    """The worker's metrics, summed by sample name over their labels."""
    (line,) = [s for s in worker.process.stdout_lines if s.startswith("METRICS ")]
    with urllib.request.urlopen(f"http://{line.split(' ', 1)[1]}/metrics", timeout=10) as r:  # noqa: S310 - 127.0.0.1
        text = r.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def saw_nothing(worker: PooledWorker) -> None:
    samples = scrape(worker)
    for name in ("dgr_worker_refusals_total", "dgr_worker_forwards_total"):
        assert samples.get(name, 0.0) == 0.0, f"{worker.endpoint}: {name} {samples.get(name)}"
    assert samples["dgr_worker_sessions_open"] == 0.0


async def hostile_then_ordinary(
    model: Path, make_transport: Callable[[], GrpcStageTransport]
) -> tuple[LoopbackRouteProvider, list[tuple[int, ...]], GrpcStageTransport]:
    """On one provider (two primaries and a spare): each hostile id through the manager and
    straight into a transport, checked to reach no worker; an ordinary session; one whose
    client's channel to the first stage is closed (gRPC fails its calls in this process), which
    must blame nobody; and an ordinary session again, on the same primaries. Returns the
    provider, the ordinary sessions' tokens and the first transport."""
    provider = LoopbackRouteProvider(
        model,
        ((0, 2), (2, 4)),
        spares=[(0, 2)],
        options=OPTIONS,
        worker_args=["--metrics-port", "0"],
    )
    policy = FailurePolicy(step_deadline=10.0)
    transport = make_transport()
    tokens: list[tuple[int, ...]] = []
    async with provider, transport:
        manager = SessionManager(
            transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
        )
        first = provider.workers[0]
        for value in HOSTILE.values():
            with pytest.raises(InvalidIdentifier):
                manager.start(ORDINARY, max_new_tokens=N_TOKENS, session_id=value)
            for call in ("open", "close"):
                with pytest.raises(InvalidIdentifier):
                    await getattr(transport, call)(first.stage, value, 1)
            with pytest.raises(InvalidIdentifier):
                await transport.forward(forward_call(first.stage, value, 1, 0, range(1), [1], None))
        assert provider.assigned == [] and provider.reports == []
        assert transport.stats() == {}  # no call was made, none failed
        for worker in provider.workers:
            saw_nothing(worker)
        refused: list[str] = []

        def beside(_token: int) -> None:  # mid-decode, the hostile ids again, beside it
            if refused:
                return
            for name, value in HOSTILE.items():
                with pytest.raises(InvalidIdentifier):
                    manager.start(ORDINARY, max_new_tokens=N_TOKENS, session_id=value)
                refused.append(name)

        handle = manager.start(
            ORDINARY, max_new_tokens=N_TOKENS, session_id="ok-28", on_token=beside
        )
        result = await handle.wait()
        assert refused == list(HOSTILE)
        assert result.state is SessionState.DONE, result.error
        assert (result.epoch, result.route_changes, result.reports) == (1, 0, ())
        tokens.append(result.tokens)
        primaries = [w.endpoint for w in provider.workers if w.role == "primary"]
        assert [s.endpoint for s in provider.assigned[0][1].stages] == primaries
        # the client's own channel to the first stage is closed: its calls fail in this process
        await transport.client(primaries[0]).aclose()
        broken = await manager.start(ORDINARY, max_new_tokens=N_TOKENS, session_id="ch-28").wait()
        await manager.aclose()
        assert broken.state is SessionState.FAILED
        assert isinstance(broken.error, ClientFailure), broken.error
        assert "Channel is closed" in str(broken.error)
        assert [r.fault for r in broken.reports] == [FaultKind.CLIENT]
        assert provider.reports == []  # the provider never heard of it
        assert [w.excluded for w in provider.workers] == [None, None, None]
        async with make_transport() as fresh:
            again = SessionManager(
                fresh, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
            )
            result = await again.start(ORDINARY, max_new_tokens=N_TOKENS, session_id="ok2").wait()
            await again.aclose()
        assert result.state is SessionState.DONE, result.error
        assert (result.epoch, result.route_changes, result.reports) == (1, 0, ())
        assert [s.endpoint for s in provider.assigned[-1][1].stages] == primaries
        tokens.append(result.tokens)
    return provider, tokens, transport


def reference_tokens(model: Path, prompt: Sequence[int]) -> tuple[int, ...]:
    ((tokens, _),) = whole_model_reference(model, [prompt], N_TOKENS, OPTIONS)
    return tuple(tokens)


@pytest.mark.slow
@pytest.mark.usefixtures("certified_fixtures")
def test_hostile_ids_and_a_broken_client_blame_no_worker_over_the_relay(
    tiny_llama: Path,
) -> None:
    def make() -> GrpcStageTransport:
        return GrpcStageTransport(timeout=10.0, close_timeout=2.0)

    provider, tokens, _ = run(hostile_then_ordinary(tiny_llama, make), 150.0)
    assert tokens == [reference_tokens(tiny_llama, ORDINARY)] * 2
    assert not any(w.running for w in provider.workers)


@pytest.mark.slow
@pytest.mark.usefixtures("certified_fixtures")
def test_hostile_ids_and_a_broken_client_blame_no_worker_over_a_chain(
    tiny_llama: Path,
) -> None:
    def make() -> GrpcStageTransport:
        return ChainStageTransport(timeout=10.0, close_timeout=2.0)

    provider, tokens, transport = run(hostile_then_ordinary(tiny_llama, make), 150.0)
    assert tokens == [reference_tokens(tiny_llama, ORDINARY)] * 2
    assert isinstance(transport, ChainStageTransport)
    assert transport.chain_stats.frames > 0  # the ordinary session went down the chain
    assert not any(w.running for w in provider.workers)
