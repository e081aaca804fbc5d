"""The main job: a local route of shard workers, a stage lost and recovered, whole-model parity.

On one machine, by default on the real model SmolLM2-135M-Instruct (--model NAME: another of
'dgr models list'): fetches it once (verified against dgr's manifest; cached); starts one 'dgr
worker' process per stage on 127.0.0.1, plus a spare for the stage it will lose (--no-spare: a
replacement is started on demand instead); streams the model's chat answer to a question
(--prompt, default "What is the capital of France?") over gRPC; SIGKILLs the worker of stage
--lose-stage when the answer has --lose-at tokens, so the session loses its route mid-answer,
gets a new route and re-prefills under a new epoch; stops at the model's end-of-turn token (or
--steps tokens); checks the text against the whole model run in-process with the same engine
options; prints per-stage timings, seam bytes and each phase's time. Ends with PARITY OK
(exit 0) or PARITY FAILED (exit 1), and stops every process it started, also on Ctrl-C or
SIGTERM. With --fixture NAME (or when the real model cannot be had here, which it says) it runs
--sessions concurrent sessions of token ids on a generated fixture instead.

The workers serve mutual TLS with a throwaway local CA and open a session only with a route grant
signed by the demo's tracker key (both made in a temporary directory, removed at the end): the
secure path is the one the demo shows.

Dark lanes are unroutable: the demo's lane must be certified first. It reuses a passing record
of exactly this lane under the repo's lock (the committed evidence/), else certifies the lane
here ('dgr certify'). A real model's records need a certifier key the lock trusts: the demo
then acts for you as the operator of your own machine, with a lock of its own made from the
repo's (declaring the model, this machine's hardware lane and your key) in --operator-dir
(default ~/.cache/dgr/demo). The records it makes go to --evidence when given, else to
--operator-dir/evidence, never into the checkout. The sessions require the class the record
has (real-hardware on a declared hardware lane, real-model otherwise, fixture for a generated
model), and the demo says which. On a fixture (a few layers of random weights) the speed
figures mean nothing, and the demo says so beside them.

The engine options are dgr's defaults (those of 'dgr worker', 'dgr certify', 'dgr generate').
Progress (fetching, building a fixture, starting workers) goes to stderr; --quiet drops it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.lock import Lock, load_lock
from dgr_engine.certification.record import default_evidence_dir
from dgr_engine.certification.registry import find_certification
from dgr_engine.certification.verify import LockVerifier
from dgr_engine.cli._demo_operator import demo_home, expected_class, operator_lock
from dgr_engine.cli._lane_certify import certify_or_reuse
from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.cli._progress import progress_printer, quiet_progress, sayer, timed
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.client.relay import ForwardRecord, GrpcStageTransport, StageStats
from dgr_engine.client.text import prompt_ids, start_text, until_stop
from dgr_engine.errors import EngineError
from dgr_engine.fixtures import (
    default_fixtures_dir,
    ensure_fixture,
    estimated_bytes,
    fixture_filename,
)
from dgr_engine.fixtures import lookup as lookup_fixture
from dgr_engine.models import RealModel, UnknownModel
from dgr_engine.models import lookup as lookup_model
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points, whole_model_greedy
from dgr_engine.security.grants import GrantIssuer
from dgr_engine.security.tls import ClientTls
from dgr_engine.tokenizer import Tokenizer
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.peer_build import PeerUse
from dgr_engine.tooling.throwaway_ca import local_pki
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FailureReport,
    Route,
    SessionManager,
    SessionResult,
)

OPTIONS = EngineOptions()
"""The workers' and the whole-model reference's engine options: dgr's one set of defaults (as
``dgr worker``, ``dgr certify`` and ``dgr generate`` have them), so the lane the demo certifies
or reuses is the lane a user's own commands run."""
PROMPT_LEN = 12
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_FIXTURE = "tiny-llama"
"""The fixture of --fixture's default and of the fall-back when the real model cannot be had."""
QUESTION = "What is the capital of France?"
"""The chat demo's question unless --prompt."""
CHAT_STEPS, CHAT_LOSE_AT = 64, 3
"""The chat answer's token limit and the token count at which its stage is lost."""
FIXTURE_STEPS, FIXTURE_LOSE_AT, FIXTURE_SESSIONS = 24, 8, 3


class DemoRefused(Exception):
    """A command-line value the demo cannot run with (one line, exit 2)."""


class DemoFailed(Exception):
    """The demo could not get as far as routing (one line, exit 1)."""


@attrs.frozen
class DemoSettings:
    """``dgr demo``'s command line, read once at its edge (:meth:`from_args`). The numbers whose
    defaults depend on the model (a chat answer or a fixture's sessions) stay as given
    (``None``: the default) until :meth:`sessions_for` fills them in."""

    model: str
    """``--model``: the real model of the catalog, by name."""
    fixture: str | None
    """``--fixture``: a generated fixture instead (``None``: the real model)."""
    prompt: str | None
    """``--prompt``: the chat question (``None``: :data:`QUESTION`)."""
    stages: int
    """``--stages``: stages of the route."""
    sessions: int | None
    """``--sessions``: concurrent sessions on a fixture."""
    steps: int | None
    """``--steps``: new tokens at most."""
    lose_stage: int
    """``--lose-stage``: the stage index killed mid-decode."""
    lose_at: int | None
    """``--lose-at``: tokens the (first) session has when its stage is lost."""
    spare: bool
    """A spare worker waits for the stage that is lost (``--no-spare``: one is started on
    demand)."""
    evidence: Path | None
    """``--evidence``: where the lane's record is looked for and made."""
    operator_dir: Path
    """``--operator-dir``, else the demo's own folder: the operator lock, key and records."""
    verbose: bool
    """``--verbose``: state changes and stage calls logged to stderr."""
    quiet: bool
    """``--quiet``: no progress on stderr."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoSettings:
        """The settings :func:`configure` parsed."""
        return cls(
            model=args.model,
            fixture=args.fixture,
            prompt=args.prompt,
            stages=args.stages,
            sessions=args.sessions,
            steps=args.steps,
            lose_stage=args.lose_stage,
            lose_at=args.lose_at,
            spare=not args.no_spare,
            evidence=args.evidence,
            operator_dir=args.operator_dir if args.operator_dir is not None else demo_home(),
            verbose=args.verbose,
            quiet=args.quiet,
        )

    def sessions_for(self, *, chat: bool) -> DemoSessions:
        """The sessions of the chat answer (``chat``) or of a fixture, the defaults that
        depend on which filled in; :class:`DemoRefused` when the values do not fit them."""
        if chat:
            if self.sessions not in (None, 1):
                raise DemoRefused(
                    "--sessions goes with --fixture: the chat demo streams one answer"
                )
            question = QUESTION if self.prompt is None else self.prompt
            count, steps, lose_at = 1, CHAT_STEPS, CHAT_LOSE_AT
        else:
            question, count, steps, lose_at = None, FIXTURE_SESSIONS, FIXTURE_STEPS, FIXTURE_LOSE_AT
        sessions = DemoSessions(
            question,
            count if self.sessions is None else self.sessions,
            steps if self.steps is None else self.steps,
            lose_at if self.lose_at is None else self.lose_at,
        )
        if sessions.count < 1:
            raise DemoRefused("--sessions must be at least 1")
        if not 0 < sessions.lose_at < sessions.steps:
            raise DemoRefused("--lose-at must be in (0, --steps)")
        return sessions


@attrs.frozen
class DemoSessions:
    """The sessions the demo runs (:meth:`DemoSettings.sessions_for`)."""

    question: str | None
    """The chat question (``None``: token-id sessions on a fixture)."""
    count: int
    """Concurrent sessions (one chat answer)."""
    steps: int
    """New tokens per session at most."""
    lose_at: int
    """Tokens the first session has when its stage is lost."""

    @property
    def names(self) -> dict[str, int]:
        """The sessions' ids and their indices."""
        return {f"demo-{i}": i for i in range(self.count)}


@attrs.frozen
class DemoPlan:
    """What the demo runs on its model (:func:`plan_demo`)."""

    sessions: DemoSessions
    layout: tuple[tuple[int, int], ...]
    """The stages' layer ranges."""
    lose_stage: int
    """The index of the stage that is lost."""

    @property
    def lost_range(self) -> tuple[int, int]:
        """The layer range of the stage that is lost."""
        return self.layout[self.lose_stage]


@attrs.frozen
class DemoOutcome:
    """What the demo measured (returned by :func:`run_demo` for tests)."""

    results: tuple[SessionResult, ...]
    expected: tuple[tuple[int, ...], ...]
    killed: str
    replacement: str | None
    parity: bool
    text: str | None = None
    """The route's chat answer (``None`` on a fixture)."""
    expected_text: str | None = None
    """The whole model's."""
    evidence: EvidenceClass = EvidenceClass.FIXTURE
    """The class the sessions required (the record's)."""
    timings: dict[str, float] = attrs.Factory(dict)
    """Seconds per phase: fetch, certify, workers, first_token, recovery, total."""


@attrs.frozen
class DemoModel:
    """The model the demo runs on."""

    path: Path
    n_layer: int
    real: RealModel | None
    """The catalog entry (``None``: a generated fixture)."""


@attrs.frozen
class Certified:
    """The lane's certification the workers load and the sessions require."""

    lock: Lock
    evidence: Path
    """The directory holding the record (the workers' ``--evidence``)."""
    evidence_class: EvidenceClass


def prompts(n_sessions: int, n_vocab: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(0, n_vocab, size=length)] for _ in range(n_sessions)]


def _route_text(route: Route, provider: LoopbackRouteProvider) -> str:
    parts = []
    for stage in route.stages:
        role = provider.worker(stage.endpoint).role
        mark = "" if role == "primary" else f" ({role})"
        parts.append(f"{stage.endpoint} [{stage.layer_begin},{stage.layer_end}){mark}")
    return " -> ".join(parts)


class Console:
    """The demo's stdout: whole lines, and streamed text that a line may interrupt (the line
    starts on a fresh line; the text resumes after a continuation mark)."""

    def __init__(self) -> None:
        self._open = False  # a streamed line is waiting for more text
        self._resume = False  # a line interrupted the stream

    def say(self, text: str) -> None:
        if self._open:
            print(flush=True)
            self._open, self._resume = False, True
        print(text, flush=True)

    def stream(self, label: str, piece: str) -> None:
        if not self._open:
            lead = f"{label:<10}" + ("... " if self._resume else "")
            print(lead, end="", flush=True)
            piece = piece.lstrip() if self._resume else piece
            self._open, self._resume = True, False
        print(piece.replace("\n", "\n" + " " * 10), end="", flush=True)

    def end_stream(self) -> None:
        if self._open:
            print(flush=True)
        self._open = self._resume = False


def choose_model(settings: DemoSettings, say: Callable[[str], None]) -> DemoModel:
    """The real model ``settings.model`` (fetched once, verified), else the fixture; the fixture
    :data:`DEFAULT_FIXTURE` also when the real model cannot be had here, saying why in one
    line."""
    fixture = settings.fixture
    if fixture is None:
        from dgr_engine.artifacts.errors import ArtifactError
        from dgr_engine.artifacts.storage import StorageRefused
        from dgr_engine.models import ModelFetchFailed, ModelNotFetched, fetch_model, model_path
        from dgr_engine.models.fetch import models_root

        model = lookup_model(settings.model)
        report, finish = progress_printer("fetch")
        try:
            root = models_root(None)
            try:
                path = model_path(model, root)
            except ModelNotFetched:
                say(f"fetch     {model.name} ({model.size / 2**20:.0f} MiB) into {root}, once")
                try:
                    path, _ = fetch_model(
                        model, root, progress=report, notice=lambda t: say(f"          {t}")
                    )
                finally:
                    finish()
        except (ModelFetchFailed, ArtifactError, StorageRefused, OSError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            say(
                f"model     {model.name} cannot be had here ({why}): falling back to the "
                f"generated fixture {DEFAULT_FIXTURE} (fixture evidence only)"
            )
            fixture = DEFAULT_FIXTURE
        else:
            return DemoModel(path, model.n_layer, model)
    spec = lookup_fixture(fixture)
    return DemoModel(_fixture(fixture), spec.n_layer, None)


def _fixture(name: str) -> Path:
    """The fixture ``name``, built first (with progress) when the cache lacks it."""
    spec = lookup_fixture(name)
    if (default_fixtures_dir() / fixture_filename(spec)).is_file():
        return ensure_fixture(name)
    report, finish = progress_printer("build")
    try:
        with timed(f"building the fixture {name} (~{estimated_bytes(spec) / 1e6:.1f} MB)"):
            return ensure_fixture(name, progress=lambda done, total: report(name, done, total))
    finally:
        finish()


def _say(text: str) -> None:
    print(text, flush=True)


async def certify_lane(
    settings: DemoSettings, model: DemoModel, say: Callable[[str], None]
) -> Certified:
    """A passing record of exactly the demo's lane: reused from the repo's evidence under the
    repo's lock, else from (or made in) the demo's own folder, under the repo's lock for a
    fixture and under the operator lock for a real model."""
    from dgr_engine.certify.runner import lane_of

    try:
        repo_lock = load_lock()
    except EvidenceError as exc:
        raise DemoFailed(f"no usable lock: {exc}") from None
    lane = await asyncio.to_thread(lane_of, model.path, OPTIONS)
    looked = settings.evidence if settings.evidence is not None else default_evidence_dir()
    found = await asyncio.to_thread(find_certification, lane, looked, lock=repo_lock)
    if found.certification is not None:
        say(f"reusing record {found.certification.path} (same lane, the repo's lock)")
        return Certified(repo_lock, looked, found.certification.evidence_class)
    home = settings.operator_dir
    evidence = settings.evidence if settings.evidence is not None else home / "evidence"
    lock = repo_lock
    key = None
    if model.real is not None:
        say(
            f"certify   no record of this lane counts under the repo's lock here: you are the "
            f"operator of your own machine, so the demo declares {model.real.name} and this "
            f"machine in a lock of yours ({home / 'lock.json'}, key {home / 'certifier.pem'})"
        )
        try:
            operator = await asyncio.to_thread(
                operator_lock,
                repo_lock,
                home,
                name=model.real.name,
                arch=model.real.arch,
                sha256=lane.model_sha256,
                evidence=evidence,
            )
        except (EvidenceError, ValueError, OSError) as exc:
            raise DemoFailed(f"cannot make the operator lock in {home}: {exc}") from None
        lock, key = operator.lock, operator.key
        state = "new (its time is now)" if operator.new else "kept (it already declares them)"
        say(f"          operator lock {state}; records in {evidence}")
        found = await asyncio.to_thread(find_certification, lane, evidence, lock=lock)
        if found.certification is not None:
            say(f"reusing record {found.certification.path} (same lane, your lock)")
            return Certified(lock, evidence, found.certification.evidence_class)
        say(f"          certifying the lane under it: {expected_class(lock).value} evidence")
    else:
        found = await asyncio.to_thread(find_certification, lane, evidence, lock=lock)
        if found.certification is not None:
            say(f"reusing record {found.certification.path} (same lane, the repo's lock)")
            return Certified(lock, evidence, found.certification.evidence_class)
        say(f"certify   the fixture lane on this machine (records in {evidence})")
    # the llama.cpp RPC comparison (speed.vs_rpc) is dgr certify's to make, not the demo's:
    # off, so a first run certifies in minutes, not after a cold peer build
    try:
        code = await certify_or_reuse(
            model.path, OPTIONS, lock, evidence, reuse=True, key=key, rpc=PeerUse.OFF
        )
    except (EvidenceError, ValueError) as exc:  # refused before any work: one line
        raise DemoFailed(f"cannot certify the lane: {exc}") from None
    if code != 0:
        raise DemoFailed("the lane did not pass certification: not routing over it")
    found = await asyncio.to_thread(find_certification, lane, evidence, lock=lock)
    if found.certification is None:
        raise DemoFailed(f"no record of the lane counts: {'; '.join(found.reasons)}")
    return Certified(lock, evidence, found.certification.evidence_class)


def fixture_speed_line(n_layer: int) -> str:
    """What the speed figures mean on a fixture: nothing (said before the figures come)."""
    return (
        f"speed     meaningless here: a generated fixture ({n_layer} layers of random weights) "
        "costs less per forward than the hop to the next stage, so its speed figures (the "
        "certification's speed.* lines, the stage table's ms, the timings) say nothing about "
        "dgr's speed; on a fixture the demo shows parity and recovery"
    )


def _evidence_line(model: DemoModel, certified: Certified) -> str:
    cls = certified.evidence_class
    if model.real is None:
        return (
            "lanes     certified with FIXTURE evidence (generated model: not real-model or "
            "real-hardware evidence); sessions require fixture evidence"
        )
    why = (
        "a real model on a hardware lane the lock declares: this machine and build"
        if cls is EvidenceClass.REAL_HARDWARE
        else "a real model; the lock declares no hardware lane of this machine and build"
    )
    return (
        f"lanes     certified with {cls.value.upper()} evidence ({why}); sessions require "
        f"{cls.value} evidence"
    )


def plan_demo(settings: DemoSettings, model: DemoModel) -> DemoPlan:
    """The sessions, stages and lost stage on ``model``; :class:`DemoRefused` when the settings
    do not fit it."""
    sessions = settings.sessions_for(chat=model.real is not None)
    try:
        layout = split_points(model.n_layer, settings.stages)
    except ValueError as exc:
        raise DemoRefused(f"--stages: {exc}") from None
    if not 0 <= settings.lose_stage < len(layout):
        raise DemoRefused(f"--lose-stage must be in [0, {len(layout)})")
    return DemoPlan(sessions, tuple(layout), settings.lose_stage)


async def run_demo(settings: DemoSettings, providers: list[LoopbackRouteProvider]) -> DemoOutcome:
    """The demo, with a throwaway CA and tracker key in a temporary directory (removed after)."""
    with tempfile.TemporaryDirectory(prefix="dgr-demo-keys-") as keys:
        return await _run_demo(settings, providers, Path(keys))


async def _run_demo(
    settings: DemoSettings, providers: list[LoopbackRouteProvider], keys: Path
) -> DemoOutcome:
    """The steps: the model, the plan, the lane's certification, the trust, the workers, the
    sessions (a stage lost), the report."""
    began_all = time.perf_counter()
    timings: dict[str, float] = {}
    console = Console()
    say = console.say
    began = time.perf_counter()
    model = await asyncio.to_thread(choose_model, settings, say)
    timings["fetch"] = time.perf_counter() - began
    plan = plan_demo(settings, model)
    say(_model_line(model))
    began = time.perf_counter()
    certified = await certify_lane(settings, model, say)
    timings["certify"] = time.perf_counter() - began
    say(_evidence_line(model, certified))
    if model.real is None:
        say(fixture_speed_line(model.n_layer))
    trust = _trust(keys)
    say(
        "security  mutual TLS (a throwaway local CA) and route grants signed by the demo's "
        "tracker key: a worker opens a session only with its grant"
    )
    narrator = _Narrator(say, plan.sessions.names)
    provider = _provider(settings, model, plan, certified, trust, narrator)
    providers.append(provider)
    try:
        await _start_workers(provider, say, timings)
        run = _Run(plan, model, provider, console, timings)
        results, expected, stats = await _run_sessions(run, certified, trust, narrator)
        parity = run.report(results, expected, narrator.first_epoch)
        _stage_table(say, stats, provider, run.killed, model.n_layer, run.elapsed, plan.sessions)
        replacement = _replacement(provider, stats, run.killed, plan.lost_range)
        timings["total"] = time.perf_counter() - began_all
        say(_timings_line(timings))
        return DemoOutcome(
            results=tuple(results),
            expected=tuple(tuple(e) for e in expected),
            killed=run.killed[0] if run.killed else "",
            replacement=replacement,
            parity=parity and bool(run.killed),
            text=run.text,
            expected_text=run.expected_text,
            evidence=certified.evidence_class,
            timings=timings,
        )
    finally:
        await provider.aclose()


def _model_line(model: DemoModel) -> str:
    if model.real is not None:
        real = model.real
        return (
            f"model     {real.name}: {model.path.name} ({model.n_layer} layers, {real.arch}, "
            f"{real.license}; a real model, verified against dgr's manifest)"
        )
    return (
        f"model     {model.path.name}  ({model.n_layer} layers; generated fixture: fixture "
        "evidence)"
    )


@attrs.frozen
class _Trust:
    """The demo's throwaway trust: mutual TLS of a local CA, route grants of a tracker key."""

    client_tls: ClientTls
    """The client's side of the mutual TLS."""
    tracker: GrantIssuer
    """Signs the route grants the workers require."""
    worker_args: tuple[str, ...]
    """The ``dgr worker`` arguments that serve the TLS and check the grants."""


def _trust(keys: Path) -> _Trust:
    """A fresh CA and tracker key in ``keys``."""
    pki = local_pki(keys)
    client_tls = pki.client_tls()
    tracker = GrantIssuer(Ed25519PrivateKey.generate(), "demo-tracker")
    return _Trust(client_tls, tracker, (*pki.worker_args(), *tracker.worker_args(keys)))


class _Narrator:
    """Says what happens to the sessions' routes: the first route, each lost stage and new
    route, each re-prefill under a new epoch."""

    def __init__(self, say: Callable[[str], None], names: dict[str, int]) -> None:
        self.say, self.names = say, names
        self.first_epoch: dict[str, int] = {}  # each session's epoch at its first prefill
        # the provider whose routes are told: set once made (it calls on_assign)
        self.provider: LoopbackRouteProvider | None = None

    def on_assign(self, sid: str, report: FailureReport | None, route: Route | None) -> None:
        provider = self.provider
        assert provider is not None
        say, names = self.say, self.names
        if report is None and route is not None and len(provider.assigned) == 1:
            say(f"route     {_route_text(route, provider)}")
        if report is not None:
            where = f"stage {report.stage_index} {report.endpoint}"
            detail = report.detail if len(report.detail) < 90 else report.detail[:87] + "..."
            say(
                f"  session {names[sid]}  epoch {report.epoch}  step {report.step}: {where} "
                f"{report.fault.value} ({detail})"
            )
        if route is not None and report is not None:
            say(f"  session {names[sid]}  new route: {_route_text(route, provider)}")

    def on_forward(self, record: ForwardRecord) -> None:
        sid = record.session_id
        if record.layers[0] != 0 or record.positions.start != 0:
            return
        first = self.first_epoch.setdefault(sid, record.epoch)
        if record.epoch != first:
            self.say(
                f"  session {self.names[sid]}  epoch {record.epoch}: re-prefill from position 0"
                f" (cache miss, no migration): the prompt and {record.step} accepted tokens in"
                f" batched forwards (first call {len(record.positions)} tokens)"
            )


def _provider(
    settings: DemoSettings,
    model: DemoModel,
    plan: DemoPlan,
    certified: Certified,
    trust: _Trust,
    narrator: _Narrator,
) -> LoopbackRouteProvider:
    """The route's workers (not started yet): secured, loading the lane's certification, with
    a spare for the stage that is lost unless ``--no-spare``."""
    provider = LoopbackRouteProvider(
        model.path,
        plan.layout,
        spares=[plan.lost_range] if settings.spare else [],
        spawn_on_demand=not settings.spare,
        options=OPTIONS,
        worker_args=[
            "--evidence",
            str(certified.evidence),
            "--lock",
            str(certified.lock.path),
            *trust.worker_args,
        ],
        observer=narrator.on_assign,
        notice=sayer(),
        grants=trust.tracker,
        client_tls=trust.client_tls,
        certification_verifier=LockVerifier(certified.lock),
    )
    narrator.provider = provider
    return provider


async def _start_workers(
    provider: LoopbackRouteProvider, say: Callable[[str], None], timings: dict[str, float]
) -> None:
    """Starts the workers and says what each serves."""
    began = time.perf_counter()
    await provider.start()
    timings["workers"] = time.perf_counter() - began
    threads = f"{OPTIONS.n_threads} thread{'' if OPTIONS.n_threads == 1 else 's'}"
    say(f"workers   started in {timings['workers']:.2f} s (dgr worker, {threads} each)")
    for worker in provider.workers:
        span, seam = worker.advert.span, worker.advert.seam
        ids = "  +token ids" if (span.needs_token_ids and not span.is_first) else ""
        say(
            f"          {worker.role:<8} [{worker.layers[0]},{worker.layers[1]})  pid "
            f"{worker.pid:<7} {worker.endpoint}  seam in {seam.bytes_per_token_in} B/token,"
            f" out {seam.bytes_per_token_out} B/token{ids}"
        )


async def _run_sessions(
    run: _Run, certified: Certified, trust: _Trust, narrator: _Narrator
) -> tuple[list[SessionResult], list[list[int]], dict[str, StageStats]]:
    """The sessions over the secured route: their results, the whole model's tokens, and the
    stages' counters."""
    policy = FailurePolicy(step_deadline=10.0, session_deadline=120.0, backoff=(0.0, 0.2))
    secured = GrpcStageTransport(timeout=10.0, observer=narrator.on_forward, tls=trust.client_tls)
    async with secured as transport:
        manager = SessionManager(
            transport,
            run.provider,
            policy=policy,
            required_evidence=certified.evidence_class,
        )
        if run.model.real is not None:
            results, expected = await run.chat(manager)
        else:
            results, expected = await run.fixture_sessions(manager)
        await manager.aclose()
        return results, expected, transport.stats()


def _replacement(
    provider: LoopbackRouteProvider,
    stats: dict[str, StageStats],
    killed: list[str],
    lost_range: tuple[int, int],
) -> str | None:
    """The worker that served the lost stage's range after it (``None``: none did)."""
    if not killed:
        return None
    return next(
        (
            w.endpoint
            for w in provider.workers
            if w.role != "primary" and w.endpoint in stats and w.layers == lost_range
        ),
        None,
    )


def _timings_line(timings: dict[str, float]) -> str:
    shown = (f"{k.replace('_', ' ')} {v:.2f} s" for k, v in timings.items())
    return "timings   " + "  ".join(shown)


class _Run:
    """The sessions of one demo run: the chat answer on a real model, or token-id sessions on
    a fixture; both lose a stage mid-decode."""

    def __init__(
        self,
        plan: DemoPlan,
        model: DemoModel,
        provider: LoopbackRouteProvider,
        console: Console,
        timings: dict[str, float],
    ) -> None:
        self.plan, self.sessions = plan, plan.sessions
        self.model, self.provider = model, provider
        self.console, self.timings = console, timings
        self.killed: list[str] = []
        self.killed_at = 0.0
        self.elapsed = 0.0
        self.text: str | None = None
        self.expected_text: str | None = None
        self.stopped_at: str | None = None

    def _kill(self, route: Route | None, accepted: int) -> None:
        assert route is not None
        lose_stage = self.plan.lose_stage
        endpoint = route.stages[lose_stage].endpoint
        worker = self.provider.kill(endpoint)
        self.killed.append(endpoint)
        self.killed_at = time.perf_counter()
        a, b = self.plan.lost_range
        self.console.say(
            f"step {accepted:>3}  SIGKILL stage {lose_stage} [{a},{b}) pid {worker.pid}"
            f" ({endpoint}) while the session{'s are' if self.sessions.count > 1 else ' is'} "
            "mid-decode"
        )

    async def fixture_sessions(
        self, manager: SessionManager
    ) -> tuple[list[SessionResult], list[list[int]]]:
        sessions = self.sessions
        n_vocab = self.provider.workers[len(self.provider.layout) - 1].advert.seam.width_out
        all_prompts = prompts(sessions.count, n_vocab)
        reference = time.perf_counter()
        expected = await asyncio.to_thread(
            whole_model_greedy, self.model.path, all_prompts, sessions.steps, OPTIONS
        )
        self.console.say(
            f"reference whole-model greedy, in-process ShardEngine (same options), "
            f"{time.perf_counter() - reference:.2f} s"
        )

        def on_token(token: int) -> None:
            handle = handles[0]
            self._first_token(began)
            if not self.killed and len(handle.tokens) == sessions.lose_at:
                self._kill(handle.core.route, sessions.lose_at)

        began = time.perf_counter()
        handles = [
            manager.start(
                prompt,
                max_new_tokens=sessions.steps,
                session_id=sid,
                on_token=on_token if i == 0 else None,
            )
            for i, (sid, prompt) in enumerate(zip(sessions.names, all_prompts, strict=True))
        ]
        self.console.say(
            f"sessions  {sessions.count} concurrent, {PROMPT_LEN}-token prompts, "
            f"{sessions.steps} new tokens each (SessionManager over gRPC streams)"
        )
        results = [await h.wait() for h in handles]
        self.elapsed = time.perf_counter() - began
        return results, expected

    def _first_token(self, began: float) -> None:
        now = time.perf_counter()
        self.timings.setdefault("first_token", now - began)
        if self.killed and "recovery" not in self.timings:
            self.timings["recovery"] = now - self.killed_at

    async def chat(self, manager: SessionManager) -> tuple[list[SessionResult], list[list[int]]]:
        sessions, console = self.sessions, self.console
        question = sessions.question
        assert question is not None
        tokenizer = await asyncio.to_thread(Tokenizer, self.model.path)
        try:
            ids = prompt_ids(tokenizer, question, chat=True)
            console.say(
                f"question  {question}  (the model's chat template: {len(ids)} prompt tokens;"
                f" greedy, at most {sessions.steps} new tokens, stops at its end-of-turn token)"
            )
            accepted: list[int] = []
            pieces: list[str] = []
            (sid,) = sessions.names

            def on_text(piece: str) -> None:
                pieces.append(piece)
                console.stream("answer", piece)

            def on_token(token: int) -> None:
                accepted.append(token)
                self._first_token(began)
                if not self.killed and len(accepted) == sessions.lose_at:
                    self._kill(handle.core.route, len(accepted))

            began = time.perf_counter()
            handle, stream = start_text(
                manager,
                tokenizer,
                question,
                max_new_tokens=sessions.steps,
                on_text=on_text,
                on_token=on_token,
                chat=True,
                session_id=sid,
            )
            result = await handle.wait()
            self.elapsed = time.perf_counter() - began
            tail = stream.flush()
            if tail:
                on_text(tail)
            console.end_stream()
            self.text = "".join(pieces)
            began = time.perf_counter()
            whole = await asyncio.to_thread(
                whole_model_greedy, self.model.path, [ids], sessions.steps, OPTIONS
            )
            expected = until_stop(whole[0], tokenizer.eog_tokens)
            self.expected_text = tokenizer.decode(
                [t for t in expected if t not in tokenizer.eog_tokens]
            )
            self.timings["whole_model"] = time.perf_counter() - began
            last = expected[-1] if expected else None
            if last is not None and last in tokenizer.eog_tokens:
                piece = tokenizer.piece(last, special=True).decode(errors="replace")
                self.stopped_at = f"stopped at the end-of-turn token {last} {piece!r}"
            else:
                self.stopped_at = f"stopped at the limit of {sessions.steps} tokens"
        finally:
            tokenizer.close()
        if not self.killed:
            console.say(
                f"          the answer ended before {sessions.lose_at} tokens: no stage was lost "
                "(a lower --lose-at, or another --prompt)"
            )
        return [result], [expected]

    def report(
        self,
        results: list[SessionResult],
        expected: list[list[int]],
        first_epoch: dict[str, int],
    ) -> bool:
        say = self.console.say
        say("")
        parity = True
        for i, (result, want) in enumerate(zip(results, expected, strict=True)):
            same = list(result.tokens) == want and result.error is None
            parity &= same
            shown = " ".join(map(str, result.tokens[:12]))
            say(
                f"session {i}  {result.state.value}  epoch {first_epoch.get(result.session_id)}"
                f" -> {result.epoch}  route changes {result.route_changes}  tokens {shown} ..."
                f"  whole-model equal: {same}"
            )
            if result.error is not None:
                say(f"          error: {result.error}")
        if self.text is not None:
            same_text = self.text == self.expected_text
            parity &= same_text
            say(f"whole     {self.expected_text}")
            say(
                f"          (the whole model in-process, same options, {len(expected[0])} tokens,"
                f" {self.stopped_at}); text equal to the route's: {same_text}"
            )
        return parity


def _stage_table(
    say: Callable[[str], None],
    stats: dict[str, StageStats],
    provider: LoopbackRouteProvider,
    killed: list[str],
    n_layer: int,
    elapsed: float,
    sessions: DemoSessions,
) -> None:
    say("")
    say(
        f"{'stage endpoint':<22} {'layers':<7} {'fwd':>4} {'rows':>5} {'engine ms':>9} "
        f"{'rtt ms':>7} {'overhead µs':>11} {'bytes in':>9} {'bytes out':>10}"
    )
    between = 0
    for s in stats.values():
        worker = provider.worker(s.endpoint)
        note = (
            " killed"
            if s.endpoint in killed
            else ("" if worker.role == "primary" else f" {worker.role}")
        )
        per = s.overhead_us / max(1, s.forwards)
        say(
            f"{s.endpoint:<22} [{s.layers[0]},{s.layers[1]}){'':<2} {s.forwards:>4} "
            f"{s.rows:>5} {s.compute_us / 1000:>9.1f} {s.rtt_us / 1000:>7.1f} {per:>11.0f} "
            f"{s.bytes_sent:>9,} {s.bytes_received:>10,}{note}"
        )
        if s.layers[1] != n_layer:
            between += s.bytes_received
    say(
        f"boundary bytes between stages: {between:,}; wall {elapsed:.2f} s for "
        f"{sessions.count} x {sessions.steps} tokens at most"
    )


def configure(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a real model of the catalog ('dgr models list'; default {DEFAULT_MODEL})",
    )
    which.add_argument(
        "--fixture",
        default=None,
        help="a generated fixture instead (tiny-llama or tiny-v4): token ids, fixture evidence",
    )
    p.add_argument("--prompt", default=None, help=f"the chat question (default {QUESTION!r})")
    p.add_argument("--stages", type=int, default=3, help="stages of the route (default 3)")
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help=f"concurrent route sessions, with --fixture (default {FIXTURE_SESSIONS}; the chat "
        "demo streams one answer)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"new tokens at most (default {CHAT_STEPS} for the chat answer, which stops at its"
        f" end-of-turn token; {FIXTURE_STEPS} per fixture session)",
    )
    p.add_argument(
        "--lose-stage", type=int, default=1, help="stage index killed mid-decode (default 1)"
    )
    p.add_argument(
        "--lose-at",
        type=int,
        default=None,
        help=f"tokens the (first) session has when its stage is lost (default {CHAT_LOSE_AT} "
        f"for the chat answer, {FIXTURE_LOSE_AT} on a fixture)",
    )
    p.add_argument(
        "--no-spare", action="store_true", help="no spare: spawn a replacement on demand"
    )
    p.add_argument(
        "--evidence",
        type=Path,
        default=None,
        help="where the demo looks for its lane's record and writes the one it makes (default: "
        "it looks in $DGR_EVIDENCE_DIR, else the checkout's evidence/, and then in "
        "--operator-dir/evidence, where any record it makes goes: never into the checkout)",
    )
    p.add_argument(
        "--operator-dir",
        type=Path,
        default=None,
        help="where the demo keeps your operator lock, certifier key and the records made "
        "under them (default ~/.cache/dgr/demo)",
    )
    p.add_argument(
        "--verbose", action="store_true", help="log state changes and stage calls to stderr"
    )


def _check(settings: DemoSettings) -> None:
    """What can be refused before anything runs (:class:`DemoRefused`)."""
    if settings.fixture is not None:
        if settings.prompt is not None:
            raise DemoRefused("--prompt goes with a real model: the fixtures have no tokenizer")
        try:
            lookup_fixture(settings.fixture)
        except ValueError as exc:
            raise DemoRefused(str(exc)) from None
    else:
        try:
            lookup_model(settings.model)
        except UnknownModel as exc:
            raise DemoRefused(str(exc)) from None
        if settings.prompt is not None and not settings.prompt.strip():
            raise DemoRefused("--prompt needs some text")
    settings.sessions_for(chat=settings.fixture is None)


def run(args: argparse.Namespace) -> int:
    settings = DemoSettings.from_args(args)
    if settings.verbose:
        log_to_stderr("DEBUG")
    try:
        _check(settings)
    except DemoRefused as exc:
        print(f"dgr demo: {exc}", file=sys.stderr)
        return 2
    providers: list[LoopbackRouteProvider] = []
    outcome: DemoOutcome | None = None
    try:
        with sigterm_as_interrupt(), quiet_progress(settings.quiet):
            outcome = asyncio.run(run_demo(settings, providers))
    except KeyboardInterrupt:
        print("interrupted: every worker stopped", file=sys.stderr)
        return 130
    except DemoRefused as exc:
        print(f"dgr demo: {exc}", file=sys.stderr)
        return 2
    except (DemoFailed, EngineError) as exc:
        print(f"dgr demo: {exc}", file=sys.stderr)
        print("PARITY FAILED", flush=True)
        return 1
    finally:
        for provider in providers:
            provider.kill_all()  # no-op when already stopped
    ok = outcome is not None and outcome.parity
    print("PARITY OK" if ok else "PARITY FAILED", flush=True)
    return 0 if ok else 1
