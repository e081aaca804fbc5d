"""Faults between hosts (issue 48): ``dgr worker`` processes on hosts of their own (network
namespaces of one machine, ``dgr_engine.tooling.host_lab``), TLS on, and faults made the way
real networks make them: silence (every packet dropped, no reset, no FIN, no ICMP), a
partition that heals, random loss.

tiny-llama split [0, 1) / [1, 3) / [3, 4), with a spare of each later range, one worker per
host; the client is this process, on the lab's bridge. For relay, chain, ring and native ring:
a silent middle stage, a middle stage cut off for 3 s and a silent last stage each end with the
whole model's tokens on the spare, every report naming the silent stage (never a healthy one),
within 2 x the step deadline of the fault; 2 % loss on every host finishes exact. After each,
every worker that was not faulted holds no session and no more threads than before.

CI runs as root here, with Debian's iproute2 and iptables (``dgr.sh test`` installs
iptables): the lab is made there, and in CI a lab that cannot be made fails these tests
saying why. On a machine that cannot make one (not root, no ``iptables``) they are skipped
saying why, and the rest of the suite runs (``tests/lab.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from dgr_engine.client.chained import ChainStageTransport, SilenceWatch
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.routes import EndpointRouteProvider, describe
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.host_lab import HostLab, HostLabError
from dgr_engine.tooling.loopback import LoopbackRouteProvider, PooledWorker
from dgr_engine.tooling.processes import WorkerPlacement
from dgr_engine.tooling.throwaway_ca import LocalPki, local_pki
from dgr_session import EvidenceClass, FailurePolicy, FailureReport, FaultKind, SessionManager
from dgr_session.route import Route
from dgr_session.transport import StageTransport
from tests import harness
from tests.lab import host_lab

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
LAYOUT = ((0, 1), (1, 3), (3, 4))
SPARES = ((1, 3), (3, 4))
"""Hosts 0, 1, 2 run the route; host 3 the middle range's spare, host 4 the last's."""
MIDDLE, LAST = 1, 2
PROMPT = [3, 17, 29, 41, 5, 8]
N_TOKENS = 48
FAULT_AT = 10
"""The fault comes once the session has this many tokens."""
FRAMES_PER_SECOND = 40
"""A native ring's workers' per-session frame budget (bursts of 8): its links would finish
tiny-llama's tokens before a fault could land; at 40 frames a second they run as over a WAN
(a native link holds a frame over its budget back; the Python paths are slower already)."""
STEP_DEADLINE = 2.5
"""Below the 3 s partition: a stage cut off that long is found out before it comes back."""
WATCH = SilenceWatch(after=0.75, timeout=1.0)
PARTITION_SECONDS = 3.0
SETTLE_SECONDS = 30.0
"""How long the workers that were not faulted may take to let go of the session."""
MODES = ("relay", "chain", "ring", "native-ring")


@pytest.fixture(scope="module")
def lab() -> Iterator[HostLab]:
    with host_lab(len(LAYOUT) + len(SPARES)) as made:
        yield made


@pytest.fixture(scope="module")
def pki(lab: HostLab, tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    addresses = [lab.address(h) for h in range(lab.n_hosts)]
    return local_pki(tmp_path_factory.mktemp("pki"), addresses)


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[int]:
    ((tokens, _),) = whole_model_reference(tiny_llama, [PROMPT], N_TOKENS, OPTIONS)
    return tokens


def transport_for(mode: str, pki: LocalPki) -> StageTransport:
    tls = pki.client_tls()
    if mode == "relay":
        return GrpcStageTransport(timeout=STEP_DEADLINE, close_timeout=2.0, tls=tls)
    return ChainStageTransport(
        timeout=STEP_DEADLINE,
        close_timeout=2.0,
        tls=tls,
        ring=mode != "chain",
        data_path="native" if mode == "native-ring" else "frame",
        silence=WATCH,
    )


@attrs.frozen
class Held:
    """What a worker holds: its open sessions and its threads (by name)."""

    sessions: int
    threads: tuple[str, ...]

    def within(self, before: Held) -> bool:
        return self.sessions <= before.sessions and len(self.own()) <= len(before.own())

    def own(self) -> tuple[str, ...]:
        """The threads but gRPC's event engine pool, which grows with load and shrinks when
        idle by itself (its ``lifeguard``): a session's threads are the others."""
        return tuple(t for t in self.threads if t != "event_engine")


def threads_of(worker: PooledWorker) -> tuple[str, ...]:
    """The names of the worker's threads."""
    tasks = Path(f"/proc/{worker.pid}/task")
    return tuple(sorted((t / "comm").read_text().strip() for t in tasks.iterdir()))


@attrs.define
class Run:
    """What one session between hosts saw."""

    tokens: tuple[int, ...] = ()
    reports: list[tuple[float, FailureReport]] = attrs.Factory(list)
    faulted_at: float | None = None


async def _session(
    manager: SessionManager, on_token: Callable[[int], None] | None, session_id: str
) -> tuple[int, ...]:
    handle = manager.start(
        PROMPT, max_new_tokens=N_TOKENS, session_id=session_id, on_token=on_token
    )
    result = await handle.wait()
    assert result.error is None, result.error
    return result.tokens


async def _warm(mode: str, pki: LocalPki, provider: LoopbackRouteProvider) -> None:
    """One session over the primaries and one over the spares, so that every worker has run
    what a session starts before its baseline is read."""
    serving = {r: [w.endpoint for w in provider.workers if w.layers == r] for r in LAYOUT}
    routes = [[serving[r][0] for r in LAYOUT], [serving[r][-1] for r in LAYOUT]]
    for n, endpoints in enumerate(routes):
        fixed = EndpointRouteProvider(endpoints, tls=pki.client_tls())
        async with transport_for(mode, pki) as transport:  # type: ignore[attr-defined]
            manager = SessionManager(
                transport,
                fixed,
                policy=FailurePolicy(step_deadline=STEP_DEADLINE),
                required_evidence=EvidenceClass.FIXTURE,
            )
            await _session(manager, None, f"warm-{n}")
            await manager.aclose()


async def _baseline(workers: list[PooledWorker], pki: LocalPki) -> dict[str, Held]:
    out = {}
    for worker in workers:
        advert = await describe(worker.endpoint, timeout=5.0, tls=pki.client_tls())
        out[worker.endpoint] = Held(advert.capacity.sessions_open, threads_of(worker))
    return out


async def _settled(
    workers: list[PooledWorker], pki: LocalPki, before: dict[str, Held]
) -> dict[str, Held]:
    """What each worker holds once back within ``before``, else at the end of
    ``SETTLE_SECONDS``."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        now = await _baseline(workers, pki)
        back = all(now[e].within(before[e]) for e in now)
        if back or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.5)  # polling a remote count: nothing to wait on


def run_between_hosts(
    mode: str,
    fault: Callable[[HostLab, asyncio.AbstractEventLoop], None],
    faulted_host: int | None,
    lab: HostLab,
    pki: LocalPki,
    model: Path,
) -> tuple[Run, dict[str, Held], dict[str, Held], list[PooledWorker]]:
    run = Run()
    # a native link waits for its frame budget; the Python paths refuse a frame over it
    paced = ["--frames-per-second", str(FRAMES_PER_SECOND)] if mode == "native-ring" else []

    def observed(_sid: str, report: FailureReport | None, _route: Route | None) -> None:
        if report is not None and report.fault is not FaultKind.BUSY:
            run.reports.append((time.monotonic(), report))

    provider = LoopbackRouteProvider(
        model,
        LAYOUT,
        spares=SPARES,
        options=OPTIONS,
        worker_args=[*pki.worker_args(), *pki.chain_args(), *paced],
        client_tls=pki.client_tls(),
        observer=observed,
        placement=lambda n: WorkerPlacement(lab.address(n), lab.runner(n)),
    )

    async def go() -> tuple[dict[str, Held], dict[str, Held]]:
        await provider.start()
        try:
            await _warm(mode, pki, provider)
            survivors = [w for n, w in enumerate(provider.workers) if n != faulted_host]
            before = await _baseline(survivors, pki)
            loop = asyncio.get_running_loop()

            def on_token(_token: int) -> None:
                if run.faulted_at is None and len(handle_tokens) + 1 == FAULT_AT:
                    run.faulted_at = time.monotonic()
                    fault(lab, loop)
                handle_tokens.append(_token)

            handle_tokens: list[int] = []
            async with transport_for(mode, pki) as transport:  # type: ignore[attr-defined]
                manager = SessionManager(
                    transport,
                    provider,
                    policy=FailurePolicy(step_deadline=STEP_DEADLINE, max_route_changes=4),
                    required_evidence=EvidenceClass.FIXTURE,
                )
                run.tokens = await _session(manager, on_token, f"{mode}-between-hosts")
                await manager.aclose()
            after = await _settled(survivors, pki, before)
            return before, after
        finally:
            for host in range(lab.n_hosts):
                lab.heal(host)
            await provider.aclose()

    before, after = harness.run(go(), 240.0)
    return run, before, after, provider.workers


def _silence(host: int) -> Callable[[HostLab, asyncio.AbstractEventLoop], None]:
    return lambda lab, _loop: lab.silence(host)


def _partition(host: int) -> Callable[[HostLab, asyncio.AbstractEventLoop], None]:
    def cut(lab: HostLab, loop: asyncio.AbstractEventLoop) -> None:
        lab.silence(host)
        loop.call_later(PARTITION_SECONDS, lab.heal, host)

    return cut


def _lossy(lab: HostLab, _loop: asyncio.AbstractEventLoop) -> None:
    for host in range(lab.n_hosts):
        lab.lose(host, 0.02)


FAULTS: dict[str, tuple[Callable[[HostLab, asyncio.AbstractEventLoop], None], int | None]] = {
    "silent-middle": (_silence(MIDDLE), MIDDLE),
    "partitioned-middle": (_partition(MIDDLE), MIDDLE),
    "silent-last": (_silence(LAST), LAST),
    "two-percent-loss": (_lossy, None),
}


@pytest.mark.parametrize("fault_name", list(FAULTS))
@pytest.mark.parametrize("mode", MODES)
def test_a_fault_between_hosts_blames_the_silent_stage_and_the_session_ends_exact(
    mode: str, fault_name: str, lab: HostLab, pki: LocalPki, tiny_llama: Path, want: list[int]
) -> None:
    fault, host = FAULTS[fault_name]
    run, before, after, workers = run_between_hosts(mode, fault, host, lab, pki, tiny_llama)
    assert list(run.tokens) == want, (mode, fault_name)
    assert run.faulted_at is not None
    named = [r.endpoint for _, r in run.reports if r.endpoint is not None]
    if host is None:  # loss: nobody went silent, so nobody may be named
        assert named == [], [r for _, r in run.reports]
    else:
        silent = workers[host].endpoint
        assert named and set(named) == {silent}, (mode, fault_name, run.reports)
        first = next(t for t, r in run.reports if r.endpoint == silent)
        assert first - run.faulted_at <= 2 * STEP_DEADLINE, first - run.faulted_at
    for endpoint, held in after.items():
        assert held.within(before[endpoint]), (endpoint, before[endpoint], held)


def test_a_native_link_refused_falls_back_to_the_frame_path_and_blames_nobody(
    lab: HostLab, pki: LocalPki, tiny_llama: Path, want: list[int]
) -> None:
    """A middle stage whose native link port refuses every connection (its host's firewall)
    while the rest of it serves: a ring with ``data_path="auto"`` takes the frame path for the
    epoch instead, counted, with the whole model's tokens and no stage named."""
    reports: list[FailureReport] = []
    provider = LoopbackRouteProvider(
        tiny_llama,
        LAYOUT,
        options=OPTIONS,
        worker_args=[*pki.worker_args(), *pki.chain_args()],
        client_tls=pki.client_tls(),
        observer=lambda _sid, report, _route: reports.append(report) if report else None,
        placement=lambda n: WorkerPlacement(lab.address(n), lab.runner(n)),
    )

    async def go() -> tuple[tuple[int, ...], ChainStageTransport]:
        await provider.start()
        try:
            middle = provider.workers[MIDDLE]
            lab.refuse_port(MIDDLE, middle.advert.data_paths.native_link_port)
            transport = ChainStageTransport(
                timeout=STEP_DEADLINE, close_timeout=2.0, tls=pki.client_tls(), ring=True
            )
            async with transport:
                manager = SessionManager(
                    transport,
                    provider,
                    policy=FailurePolicy(step_deadline=STEP_DEADLINE),
                    required_evidence=EvidenceClass.FIXTURE,
                )
                tokens = await _session(manager, None, "native-refused")
                await manager.aclose()
            return tokens, transport
        finally:
            lab.heal(MIDDLE)
            await provider.aclose()

    tokens, transport = harness.run(go(), 240.0)
    assert list(tokens) == want
    assert reports == []
    stats = transport.chain_stats
    assert (stats.native_fallbacks, stats.frame_link_epochs, stats.native_epochs) == (1, 1, 0)


DELAY_MS = 15.0
"""Each host's packets wait this long (netem): 30 ms a round trip between two hosts."""


def test_routes_between_delayed_hosts_are_exact(
    lab: HostLab, pki: LocalPki, tiny_llama: Path, want: list[int]
) -> None:
    """Every host's packets delayed (netem, where the kernel has it: it is a kernel module,
    not in every kernel; without it the test is skipped saying so): over relay, chain, ring
    and native ring the tokens are the whole model's and nobody is blamed."""
    try:
        for host in range(lab.n_hosts):
            lab.delay(host, DELAY_MS)
    except HostLabError as exc:
        for host in range(lab.n_hosts):
            lab.undelay(host)
        pytest.skip(f"this kernel delays no packets (netem): {exc}")
    try:
        for mode in MODES:
            run, _, _, _ = run_between_hosts(mode, _nothing, None, lab, pki, tiny_llama)
            assert list(run.tokens) == want, mode
            assert run.reports == [], (mode, run.reports)
    finally:
        for host in range(lab.n_hosts):
            lab.undelay(host)


def _nothing(_lab: HostLab, _loop: asyncio.AbstractEventLoop) -> None:
    """No fault: the delay is the whole test."""
