"""How tracker code uses dgr as a library: workers, adverts, its own routing, billing.

Run: ``.venv/bin/python examples/tracker.py``. First the provider's side: the fixture lane is
certified on this machine (``dgr certify --reuse``: a record of exactly this lane, reused when
one exists), so its workers advertise ``certified`` with fixture evidence. Then four
``dgr worker`` processes on 127.0.0.1
(two layouts of the generated 4-layer fixture, so there is a choice: [0,2)+[2,4) and
[0,1)+[1,4)), reads every worker's advert, and routes with the tracker's OWN route provider
(below): dgr supplies the inputs, the routing policy is the tracker's. Three sessions run over
gRPC; a worker on their route is SIGKILLed mid-decode, the provider avoids the blamed endpoint
and moves them to the other layout. Tokens are checked against the whole model, and the per-stage
counters are printed as a bill. Every worker is stopped at the end, also on an error or Ctrl-C.

The channel is secured as a deployment's would be: the workers serve mutual TLS (here with a
throwaway CA, ``dgr_engine.local_pki``; a real tracker uses its operators' PKI)
and open a session only with a route grant signed by the tracker's Ed25519 key, which
``CheapestRoute.grant_route`` issues for every session and epoch.

It imports only dgr's public surface, the top levels of ``dgr_engine`` and ``dgr_session``
(``docs/api.md`` says what each role imports).
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine import (
    Advert,
    ClientTls,
    EngineOptions,
    GrantIssuer,
    GrpcStageTransport,
    LockVerifier,
    ShardClient,
    WorkerProcess,
    describe,
    dgr_command,
    ensure_fixture,
    local_pki,
    whole_model_greedy,
)
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FailureReport,
    FaultKind,
    ModelIdentity,
    Route,
    SessionManager,
)

PATH = ensure_fixture("tiny-llama")  # a generated GGUF: fixture evidence only
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=32, max_sessions=4)
# The model is a generated fixture: its lanes can hold fixture evidence at most. A production
# tracker leaves required_evidence at its default, real-hardware.
REQUIRED = EvidenceClass.FIXTURE
RANGES = [(0, 2), (2, 4), (0, 1), (1, 4)]
PROMPTS = [[1, 17, 42, 99, 7, 64], [5, 8, 13, 21, 34], [250, 3, 77, 12, 9, 200, 31]]
N_NEW = 12


def stage_cost(advert: Advert) -> float:
    """The tracker's price of a stage: the bytes it ships to the next stage per token (the last
    stage's logits go to the client whatever the route), how busy it is, its recent errors."""
    seam = 0 if advert.span.is_last else advert.seam.bytes_per_token_out
    c = advert.capacity
    busy = (c.sessions_open + c.sessions_waiting) / c.sessions_max + advert.load.in_flight
    return seam + 1000 * busy + 10_000 * advert.health.recent_errors


class CheapestRoute:
    """A ``dgr_session.RouteProvider``: fresh adverts of the workers not blamed yet, the
    compatible ones, then the cheapest chain of ranges covering every layer (a full worker is
    dear, not excluded: its line is fair, and busy is load, not a fault). It is also a
    ``GrantingRouteProvider``: the manager asks it to sign each route for its session and
    epoch. Its ``certification_verifier`` checks every stage's certification record against
    the tracker's own lock (``certification/lock.json``) instead of the worker's word."""

    def __init__(
        self, endpoints: list[str], model: ModelIdentity, grants: GrantIssuer, tls: ClientTls
    ) -> None:
        self.endpoints = endpoints
        self.model = model  # what the client asked for: GGUF hash, arch, n_layer
        self.blamed: set[str] = set()
        self.grants = grants
        self.tls = tls
        self.certification_verifier = LockVerifier()  # the manager validates routes with it

    def grant_route(self, session_id: str, epoch: int, route: Route) -> Route:
        return self.grants.grant_route(session_id, epoch, route)

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        if report is not None and report.endpoint is not None:
            print(f"  {session_id}: {report.endpoint} {report.fault.value} at step {report.step}")
            if report.fault not in (FaultKind.BUSY, FaultKind.STATE_LOST):  # load, cache miss
                self.blamed.add(report.endpoint)  # a fault: never route to it again
        pool: dict[str, Advert] = {}
        for endpoint in self.endpoints:
            if endpoint in self.blamed:
                continue
            try:
                pool[endpoint] = await describe(endpoint, timeout=2.0, tls=self.tls)
            except (ConnectionError, TimeoutError):
                continue  # unreachable: not routable now
        pool = {
            e: a
            for e, a in pool.items()
            # the model asked for, certified at the class the route needs (validate_route checks
            # it all again: recipe, build, widths, cover, certification)
            if a.identity == self.model
            and a.lane.evidence is not None
            and a.lane.evidence.satisfies(REQUIRED)
        }

        def chains(layer: int) -> list[list[str]]:  # every way to cover [layer, n_layer)
            if layer == self.model.n_layer:
                return [[]]
            return [
                [e, *rest]
                for e, a in pool.items()
                if a.span.layer_begin == layer
                for rest in chains(a.span.layer_end)
            ]

        options = chains(0)
        if not options:
            return None  # the session waits its backoff and asks again, within its budget
        best = min(options, key=lambda c: sum(stage_cost(pool[e]) for e in c))
        return Route(pool[e].stage_spec(e) for e in best)


async def read_adverts(endpoints: list[str], tls: ClientTls) -> dict[str, Advert]:
    """What the tracker reads from every worker (``dgr_engine.Advert`` has every field)."""
    adverts = {}
    for endpoint in endpoints:
        async with ShardClient(endpoint, timeout=10.0, tls=tls) as client:
            assert await client.serving()  # the standard gRPC health service
            a = adverts[endpoint] = await client.describe()
        secured = a.security
        channel = "mutual TLS" if secured.client_certificates else "TLS" if secured.tls else "plain"
        print(
            f"{endpoint} [{a.span.layer_begin},{a.span.layer_end}) model "
            f"{a.identity.content_hash.hex()[:12]} slots {a.capacity.sessions_open}/"
            f"{a.capacity.sessions_max} (+{a.capacity.sessions_waiting} waiting) in flight "
            f"{a.load.in_flight} seam "
            f"{a.seam.bytes_per_token_in}/{a.seam.bytes_per_token_out} B/token errors "
            f"{a.health.recent_errors} lane {a.lane.certification.value} "
            f"({a.lane.evidence.value if a.lane.evidence else 'no'} evidence) {channel}"
        )
    return adverts


async def track(workers: dict[str, WorkerProcess], grants: GrantIssuer, tls: ClientTls) -> None:
    adverts = await read_adverts(list(workers), tls)
    model = next(iter(adverts.values())).identity
    provider = CheapestRoute(list(workers), model, grants, tls)
    policy = FailurePolicy(step_deadline=10.0, session_deadline=120.0, backoff=(0.0, 0.2))
    killed: list[str] = []

    def on_token(token: int) -> None:  # session 0's tokens: lose its last stage at 4 tokens
        route = handles[0].core.route
        if len(handles[0].tokens) == 4 and route is not None and not killed:
            killed.append(route.endpoints[-1])
            print(f"  SIGKILL {killed[0]} mid-decode")
            workers[killed[0]].kill()

    # Dark lanes are never routable; the sessions require the class this model can have.
    async with GrpcStageTransport(timeout=10.0, tls=tls) as transport:
        async with SessionManager(
            transport, provider, policy=policy, required_evidence=REQUIRED
        ) as manager:
            hooks = [on_token, None, None]
            handles = [
                manager.start(p, max_new_tokens=N_NEW, session_id=f"s{i}", on_token=hook)
                for i, (p, hook) in enumerate(zip(PROMPTS, hooks, strict=True))
            ]
            results = [await h.wait() for h in handles]
        stats = transport.stats()
    for endpoint in workers.keys() - set(killed):  # every stage closed what it opened
        assert (await describe(endpoint, tls=tls)).capacity.sessions_open == 0
    # usage records of session 0, the client's view (the manager's) beside each living
    # worker's own (its Usage RPC): the tracker bills from one and reconciles with the other
    print("usage of s0 (client | worker):")
    for record in results[0].usage:
        if record.endpoint in killed:
            theirs = "(worker gone)"
        else:
            async with ShardClient(record.endpoint, timeout=10.0, tls=tls) as client:
                # the tracker's credential: a grant for this session at this stage
                credential = grants.usage_grant("s0", record.endpoint)
                theirs_all = await client.usage("s0", grant=credential)
                mine = [r for r in theirs_all if r.epoch == record.epoch]
            assert [(r.rows_prefill, r.rows_decode, r.rows_replay) for r in mine] == [
                (record.rows_prefill, record.rows_decode, record.rows_replay)
            ]
            theirs = "same rows"
        cause = f", replay after {record.replay_cause.value}" if record.replay_cause else ""
        print(
            f"  epoch {record.epoch} stage {record.stage_index} {record.endpoint} rows prefill "
            f"{record.rows_prefill} decode {record.rows_decode} replay {record.rows_replay}"
            f"{cause} | {theirs}"
        )

    expected = whole_model_greedy(PATH, PROMPTS, N_NEW, OPTIONS)
    for result, want in zip(results, expected, strict=True):
        print(f"{result.session_id}: {result.state.value}, {result.route_changes} route change(s)")
        assert list(result.tokens) == want, result.error  # the whole model's tokens
    assert results[0].route_changes == 1 and provider.blamed == set(killed)
    print("bill (per stage; successful forwards only):")
    for s in stats.values():
        print(
            f"  {s.endpoint} [{s.layers[0]},{s.layers[1]}) forwards {s.forwards} rows {s.rows}"
            f" (layer-rows {s.rows * (s.layers[1] - s.layers[0])}) bytes in {s.bytes_sent}"
            f" out {s.bytes_received}"
        )


def main() -> None:
    # The provider's side, before it advertises: certify the lane (or reuse its record).
    subprocess.run(
        [dgr_command(), "certify", "--fixture", "tiny-llama", "--reuse", *OPTIONS.worker_argv()],
        check=True,
        timeout=600,
    )
    workers: dict[str, WorkerProcess] = {}
    with tempfile.TemporaryDirectory(prefix="tracker-keys-") as keys:
        pki = local_pki(Path(keys))  # a throwaway CA: worker and client certificates
        grants = GrantIssuer(Ed25519PrivateKey.generate(), key_id="tracker-1")
        secure = [*pki.worker_args(), *grants.worker_args(keys)]  # mutual TLS + grant key
        try:
            for layers in RANGES:  # spawn returns once the worker printed LISTENING 127.0.0.1:PORT
                worker = WorkerProcess.spawn(
                    PATH, layers, options=OPTIONS, log_level="WARNING", extra_args=secure
                )
                workers[worker.address] = worker
            asyncio.run(track(workers, grants, pki.client_tls()))
        finally:
            for worker in workers.values():
                worker.stop()  # SIGTERM, bounded wait, then SIGKILL; a no-op once it has exited
    print("tracker: OK")


if __name__ == "__main__":
    main()
