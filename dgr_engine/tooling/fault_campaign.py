"""A fault campaign over real worker processes: a schedule of faults injected into concurrent
route sessions, and what came of it, checked against the whole model.

A :class:`Schedule` says which faults to inject and when (when session *s* has accepted *t*
tokens, on stage *k* of its current route): SIGKILL, SIGSTOP past the step deadline then
SIGCONT (a stall), SIGSTOP under it (a slow reply), a stale frame (epoch 0) and a malformed
frame aimed at a live session, and a cancellation. Full workers need no injection: the pool's
workers have fewer slots than there are sessions. :func:`run_schedule` starts a fresh pool,
runs the sessions, injects, waits for quiescence and returns a :class:`CampaignOutcome`: every
session's result, the faults injected, the hostile frames' answers, each worker's open
sessions and RSS growth after quiescence, and the workers that died without being killed.
``tests/e2e/test_fault_campaign.py`` draws schedules with hypothesis and checks the invariants;
``docs/reliability.md`` gives the soak command.

Not a test double: it drives real ``dgr worker`` processes only, over 127.0.0.1; every wait is
bounded and every process started is stopped.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import signal
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import GrpcStageTransport, expectations_for
from dgr_engine.client.routes import describe
from dgr_engine.client.shard_client import ShardClient
from dgr_engine.errors import ShardError
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.wire.frames import Expectations
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    SessionHandle,
    SessionManager,
    SessionResult,
    StageSpec,
)


class FaultAction(enum.StrEnum):
    KILL = "kill"
    """SIGKILL the stage's worker (a crash)."""
    STALL = "stall"
    """SIGSTOP it for ``stall_seconds`` (past the step deadline), then SIGCONT."""
    SLOW = "slow"
    """SIGSTOP it for ``slow_seconds`` (under the step deadline), then SIGCONT."""
    STALE_FRAME = "stale_frame"
    """Send the stage a frame of the session at epoch 0 (older than any route's)."""
    MALFORMED_FRAME = "malformed_frame"
    """Send the stage a frame of the session's live epoch with rows of the wrong width."""
    CANCEL = "cancel"
    """Cancel the session."""


@attrs.frozen
class Fault:
    action: FaultAction
    session: int
    """Whose progress triggers it, and whose current route names the stage."""
    at_token: int
    """Injected once that session has accepted this many tokens."""
    stage: int
    """Stage index in the session's route at that moment."""


@attrs.frozen
class CampaignConfig:
    """The pool and the sessions a schedule runs over."""

    model: Path
    layout: tuple[tuple[int, int], ...]
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    options: EngineOptions
    policy: FailurePolicy
    worker_args: tuple[str, ...] = (
        "--admission-wait",
        "1",
        "--stall-seconds",
        "1",
        "--resume-grace",
        "1",
        "--log-level",
        "INFO",  # each open and close is logged: a leak's log says which session and how
    )
    stall_seconds: float = 3.0
    slow_seconds: float = 0.3
    quiesce_seconds: float = 20.0
    """Bound on waiting for every worker's sessions to reach zero after the sessions end."""
    limit_seconds: float = 240.0
    """Bound on the whole schedule."""
    transport: str = "relay"
    """How the sessions' frames travel: ``relay`` (the client relays every boundary),
    ``ring`` (the ring of ``docs/chain.md`` over the frame link, ``docs/data-paths.md``) or
    ``ring-native`` (the ring over native links, ``docs/native-path.md``)."""


@attrs.define
class HostileFrame:
    action: FaultAction
    endpoint: str
    answer: str
    """The exception's type name (``"accepted"`` if the worker took it)."""


@attrs.define
class CampaignOutcome:
    results: list[SessionResult]
    injected: Counter[str] = attrs.Factory(Counter)
    """Faults actually injected, by action (a fault whose session ended first is skipped)."""
    hostile: list[HostileFrame] = attrs.Factory(list)
    open_after: dict[str, int] = attrs.Factory(dict)
    """Sessions each live worker still held after quiescence."""
    rss_growth_kib: dict[str, int] = attrs.Factory(dict)
    """RSS after quiescence minus RSS before the sessions, per worker alive throughout."""
    crashed: list[str] = attrs.Factory(list)
    """Workers that exited without being killed by the schedule."""
    leak_logs: dict[str, str] = attrs.Factory(dict)
    """For each worker still holding sessions after quiescence: its session log lines (what
    was opened and closed, and when), to tell which session leaked and how."""
    killed: list[str] = attrs.Factory(list)


def rss_kib(pid: int) -> int | None:
    """Resident set size of a live process, KiB (``None`` once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


async def run_schedule(config: CampaignConfig, faults: Sequence[Fault]) -> CampaignOutcome:
    """Runs every prompt as a session over a fresh pool while injecting ``faults``."""
    return await asyncio.wait_for(_run(config, faults), config.limit_seconds)


async def _run(config: CampaignConfig, faults: Sequence[Fault]) -> CampaignOutcome:
    provider = LoopbackRouteProvider(
        config.model,
        config.layout,
        spawn_on_demand=True,
        options=config.options,
        worker_args=config.worker_args,
    )
    await provider.start()
    try:
        return await _drive(config, provider, faults)
    finally:
        await provider.aclose()


async def _drive(
    config: CampaignConfig, provider: LoopbackRouteProvider, faults: Sequence[Fault]
) -> CampaignOutcome:
    loop = asyncio.get_running_loop()
    baseline = {w.endpoint: rss_kib(w.pid) for w in provider.workers}
    outcome = CampaignOutcome(results=[])
    pending = sorted(faults, key=lambda f: (f.at_token, f.session))
    handles: list[SessionHandle] = []
    background: set[asyncio.Task[None]] = set()
    raw = GrpcStageTransport(timeout=5.0, streaming=False)  # the hostile client

    def stage_of(fault: Fault) -> StageSpec | None:
        route = handles[fault.session].core.route
        if route is None or handles[fault.session].done:
            return None
        return route.stages[fault.stage % len(route.stages)]

    def resume_later(endpoint: str, seconds: float) -> None:
        worker = provider.worker(endpoint)
        loop.call_later(seconds, _signal, worker.process.proc, signal.SIGCONT)

    def inject(fault: Fault) -> None:
        stage = stage_of(fault)
        if stage is None:
            return
        handle, action = handles[fault.session], fault.action
        if action is FaultAction.CANCEL:
            handle.cancel("campaign")
        elif action is FaultAction.KILL:
            provider.kill(stage.endpoint)
            outcome.killed.append(stage.endpoint)
        elif action in (FaultAction.STALL, FaultAction.SLOW):
            provider.suspend(stage.endpoint)
            seconds = config.stall_seconds if action is FaultAction.STALL else config.slow_seconds
            resume_later(stage.endpoint, seconds)
        else:
            task = loop.create_task(_hostile(raw, outcome, action, stage, handle))
            background.add(task)
            task.add_done_callback(background.discard)
        outcome.injected[action.value] += 1

    def on_token_of(index: int, _token: int) -> None:
        count = len(handles[index].tokens)
        for fault in [f for f in pending if f.session == index and f.at_token <= count]:
            pending.remove(fault)
            inject(fault)

    transport = (
        GrpcStageTransport(timeout=5.0, close_timeout=0.5)
        if config.transport == "relay"
        else ChainStageTransport(
            timeout=5.0,
            close_timeout=0.5,
            ring=True,
            data_path="native" if config.transport == "ring-native" else "frame",
        )
    )
    manager = SessionManager(
        transport, provider, policy=config.policy, required_evidence=EvidenceClass.FIXTURE
    )
    try:
        for i, prompt in enumerate(config.prompts):
            handles.append(
                manager.start(
                    prompt,
                    max_new_tokens=config.max_new_tokens,
                    session_id=f"campaign-{i}",
                    on_token=functools.partial(on_token_of, i),
                )
            )
        outcome.results = [await h.wait() for h in handles]
        await manager.aclose()
        if background:
            await asyncio.wait(background, timeout=10.0)
        for worker in provider.workers:  # a stall injected late: let every worker run again
            _signal(worker.process.proc, signal.SIGCONT)
        await transport.settle_closes(config.quiesce_seconds)
        outcome.open_after = await _quiesce(provider, config.quiesce_seconds)
        for worker in provider.workers:
            if outcome.open_after.get(worker.endpoint):
                lines = worker.process.stderr_text().splitlines()
                kept = [line for line in lines if "session" in line or "stall" in line]
                outcome.leak_logs[worker.endpoint] = "\n".join(kept[-400:])
    finally:
        await transport.aclose()
        await raw.aclose()
    for worker in provider.workers:
        if worker.endpoint in outcome.killed:
            continue
        if not worker.running:
            outcome.crashed.append(f"{worker.endpoint}: exit {worker.process.proc.returncode}")
        before, after = baseline.get(worker.endpoint), rss_kib(worker.pid)
        if before is not None and after is not None:
            outcome.rss_growth_kib[worker.endpoint] = after - before
    return outcome


async def _hostile(
    raw: GrpcStageTransport,
    outcome: CampaignOutcome,
    action: FaultAction,
    stage: StageSpec,
    handle: SessionHandle,
) -> None:
    """One hostile frame at ``stage`` naming ``handle``'s session; records the answer."""
    client: ShardClient = raw.client(stage.endpoint)
    expect: Expectations = expectations_for(stage)
    epoch, position = handle.core.epoch, handle.core.kv_positions
    first = stage.boundary_in == 0
    positions = [position]
    tokens = [1] if first else None
    rows = None if first else np.zeros((1, stage.boundary_in), dtype=np.float32)
    if action is FaultAction.STALE_FRAME:
        epoch = 0  # older than any route's epoch
    elif first:  # the live epoch, positions with a gap: malformed whatever the session holds
        positions, tokens = [position, position + 2], [1, 1]
    else:  # the live epoch, rows one float too wide
        rows = np.zeros((1, stage.boundary_in + 1), dtype=np.float32)
    try:
        await client.forward(
            handle.session_id,
            epoch,
            handle.core.step,
            expect,
            positions,
            tokens=tokens,
            boundary=rows,
            timeout=5.0,
        )
    except ShardError as exc:  # a refusal, or no answer (a killed or stalled worker)
        answer = type(exc).__name__
    else:
        answer = "accepted"
    outcome.hostile.append(HostileFrame(action, stage.endpoint, answer))


async def _quiesce(provider: LoopbackRouteProvider, limit: float) -> dict[str, int]:
    """Polls every live worker's advert until none holds a session or ``limit`` s pass."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while True:
        counts: dict[str, int] = {}
        for worker in provider.workers:
            if worker.running:
                advert = await describe(worker.endpoint, timeout=5.0)
                counts[worker.endpoint] = advert.capacity.sessions_open
        if not any(counts.values()) or loop.time() >= end:
            return counts
        await asyncio.sleep(0.2)


def _signal(proc: object, sig: signal.Signals) -> None:
    poll = getattr(proc, "poll", None)
    if poll is not None and poll() is None:
        proc.send_signal(sig)  # type: ignore[attr-defined]
