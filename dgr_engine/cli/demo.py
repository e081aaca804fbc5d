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
from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.cli._progress import progress_printer, quiet_progress, sayer, timed
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.cli.certify import certify_or_reuse
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


def choose_model(args: argparse.Namespace, say: Callable[[str], None]) -> DemoModel:
    """The real model ``args.model`` (fetched once, verified), else the fixture; the fixture
    also when the real model cannot be had here, saying why in one line."""
    if args.fixture is None:
        from dgr_engine.artifacts.errors import ArtifactError
        from dgr_engine.artifacts.storage import StorageRefused
        from dgr_engine.models import ModelFetchFailed, ModelNotFetched, fetch_model, model_path
        from dgr_engine.models.fetch import models_root

        model = lookup_model(args.model)
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
            args.fixture = DEFAULT_FIXTURE
        else:
            return DemoModel(path, model.n_layer, model)
    spec = lookup_fixture(args.fixture)
    return DemoModel(_fixture(args.fixture), spec.n_layer, None)


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
    args: argparse.Namespace, model: DemoModel, say: Callable[[str], None]
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
    looked = args.evidence if args.evidence is not None else default_evidence_dir()
    found = await asyncio.to_thread(find_certification, lane, looked, lock=repo_lock)
    if found.certification is not None:
        say(f"reusing record {found.certification.path} (same lane, the repo's lock)")
        return Certified(repo_lock, looked, found.certification.evidence_class)
    home: Path = args.operator_dir
    evidence = args.evidence if args.evidence is not None else home / "evidence"
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


async def run_demo(args: argparse.Namespace, providers: list[LoopbackRouteProvider]) -> DemoOutcome:
    """The demo, with a throwaway CA and tracker key in a temporary directory (removed after)."""
    with tempfile.TemporaryDirectory(prefix="dgr-demo-keys-") as keys:
        return await _run_demo(args, providers, Path(keys))


async def _run_demo(
    args: argparse.Namespace, providers: list[LoopbackRouteProvider], keys: Path
) -> DemoOutcome:
    began_all = time.perf_counter()
    timings: dict[str, float] = {}
    console = Console()
    say = console.say
    began = time.perf_counter()
    model = await asyncio.to_thread(choose_model, args, say)
    timings["fetch"] = time.perf_counter() - began
    _defaults(args, chat=model.real is not None)
    try:
        layout = split_points(model.n_layer, args.stages)
    except ValueError as exc:
        raise DemoRefused(f"--stages: {exc}") from None
    if not 0 <= args.lose_stage < len(layout):
        raise DemoRefused(f"--lose-stage must be in [0, {len(layout)})")
    if model.real is not None:
        real = model.real
        say(
            f"model     {real.name}: {model.path.name} ({model.n_layer} layers, {real.arch}, "
            f"{real.license}; a real model, verified against dgr's manifest)"
        )
    else:
        say(
            f"model     {model.path.name}  ({model.n_layer} layers; generated fixture: fixture "
            "evidence)"
        )
    began = time.perf_counter()
    certified = await certify_lane(args, model, say)
    timings["certify"] = time.perf_counter() - began
    say(_evidence_line(model, certified))
    if model.real is None:
        say(fixture_speed_line(model.n_layer))

    pki = local_pki(keys)
    client_tls = pki.client_tls()
    tracker = GrantIssuer(Ed25519PrivateKey.generate(), "demo-tracker")
    say(
        "security  mutual TLS (a throwaway local CA) and route grants signed by the demo's "
        "tracker key: a worker opens a session only with its grant"
    )
    lost_range = layout[args.lose_stage]
    names = {f"demo-{i}": i for i in range(args.sessions)}
    first_epoch: dict[str, int] = {}

    def on_assign(sid: str, report: FailureReport | None, route: Route | None) -> None:
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

    def on_forward(record: ForwardRecord) -> None:
        sid = record.session_id
        if record.layers[0] != 0 or record.positions.start != 0:
            return
        first = first_epoch.setdefault(sid, record.epoch)
        if record.epoch != first:
            say(
                f"  session {names[sid]}  epoch {record.epoch}: re-prefill from position 0 (cache"
                f" miss, no migration): the prompt and {record.step} accepted tokens in batched"
                f" forwards (first call {len(record.positions)} tokens)"
            )

    provider = LoopbackRouteProvider(
        model.path,
        layout,
        spares=[] if args.no_spare else [lost_range],
        spawn_on_demand=args.no_spare,
        options=OPTIONS,
        worker_args=[
            "--evidence",
            str(certified.evidence),
            "--lock",
            str(certified.lock.path),
            *pki.worker_args(),
            *tracker.worker_args(keys),
        ],
        observer=on_assign,
        notice=sayer(),
        grants=tracker,
        client_tls=client_tls,
        certification_verifier=LockVerifier(certified.lock),
    )
    providers.append(provider)
    try:
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
        policy = FailurePolicy(step_deadline=10.0, session_deadline=120.0, backoff=(0.0, 0.2))
        secured = GrpcStageTransport(timeout=10.0, observer=on_forward, tls=client_tls)
        run = _Run(args, model, provider, certified, console, lost_range, timings)
        async with secured as transport:
            manager = SessionManager(
                transport,
                provider,
                policy=policy,
                required_evidence=certified.evidence_class,
            )
            if model.real is not None:
                results, expected = await run.chat(manager, names)
            else:
                results, expected = await run.fixture_sessions(manager, names)
            await manager.aclose()
            stats = transport.stats()
        parity = run.report(results, expected, first_epoch)
        _stage_table(say, stats, provider, run.killed, model.n_layer, run.elapsed, args)
        replacement = None
        if run.killed:
            replacement = next(
                (
                    w.endpoint
                    for w in provider.workers
                    if w.role != "primary" and w.endpoint in stats and w.layers == lost_range
                ),
                None,
            )
        timings["total"] = time.perf_counter() - began_all
        shown = (f"{k.replace('_', ' ')} {v:.2f} s" for k, v in timings.items())
        say("timings   " + "  ".join(shown))
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


class _Run:
    """The sessions of one demo run: the chat answer on a real model, or token-id sessions on
    a fixture; both lose a stage mid-decode."""

    def __init__(
        self,
        args: argparse.Namespace,
        model: DemoModel,
        provider: LoopbackRouteProvider,
        certified: Certified,
        console: Console,
        lost_range: tuple[int, int],
        timings: dict[str, float],
    ) -> None:
        self.args, self.model, self.provider = args, model, provider
        self.certified, self.console, self.lost_range = certified, console, lost_range
        self.timings = timings
        self.killed: list[str] = []
        self.killed_at = 0.0
        self.elapsed = 0.0
        self.text: str | None = None
        self.expected_text: str | None = None
        self.stopped_at: str | None = None

    def _kill(self, route: Route | None, accepted: int) -> None:
        assert route is not None
        endpoint = route.stages[self.args.lose_stage].endpoint
        worker = self.provider.kill(endpoint)
        self.killed.append(endpoint)
        self.killed_at = time.perf_counter()
        a, b = self.lost_range
        self.console.say(
            f"step {accepted:>3}  SIGKILL stage {self.args.lose_stage} [{a},{b}) pid {worker.pid}"
            f" ({endpoint}) while the session{'s are' if self.args.sessions > 1 else ' is'} "
            "mid-decode"
        )

    async def fixture_sessions(
        self, manager: SessionManager, names: dict[str, int]
    ) -> tuple[list[SessionResult], list[list[int]]]:
        args = self.args
        n_vocab = self.provider.workers[len(self.provider.layout) - 1].advert.seam.width_out
        all_prompts = prompts(args.sessions, n_vocab)
        reference = time.perf_counter()
        expected = await asyncio.to_thread(
            whole_model_greedy, self.model.path, all_prompts, args.steps, OPTIONS
        )
        self.console.say(
            f"reference whole-model greedy, in-process ShardEngine (same options), "
            f"{time.perf_counter() - reference:.2f} s"
        )

        def on_token(token: int) -> None:
            handle = handles[0]
            self._first_token(began)
            if not self.killed and len(handle.tokens) == args.lose_at:
                self._kill(handle.core.route, args.lose_at)

        began = time.perf_counter()
        handles = [
            manager.start(
                prompt,
                max_new_tokens=args.steps,
                session_id=sid,
                on_token=on_token if i == 0 else None,
            )
            for i, (sid, prompt) in enumerate(zip(names, all_prompts, strict=True))
        ]
        self.console.say(
            f"sessions  {args.sessions} concurrent, {PROMPT_LEN}-token prompts, "
            f"{args.steps} new tokens each (SessionManager over gRPC streams)"
        )
        results = [await h.wait() for h in handles]
        self.elapsed = time.perf_counter() - began
        return results, expected

    def _first_token(self, began: float) -> None:
        now = time.perf_counter()
        self.timings.setdefault("first_token", now - began)
        if self.killed and "recovery" not in self.timings:
            self.timings["recovery"] = now - self.killed_at

    async def chat(
        self, manager: SessionManager, names: dict[str, int]
    ) -> tuple[list[SessionResult], list[list[int]]]:
        args, console = self.args, self.console
        tokenizer = await asyncio.to_thread(Tokenizer, self.model.path)
        try:
            ids = prompt_ids(tokenizer, args.prompt, chat=True)
            console.say(
                f"question  {args.prompt}  (the model's chat template: {len(ids)} prompt tokens;"
                f" greedy, at most {args.steps} new tokens, stops at its end-of-turn token)"
            )
            accepted: list[int] = []
            pieces: list[str] = []
            (sid,) = names

            def on_text(piece: str) -> None:
                pieces.append(piece)
                console.stream("answer", piece)

            def on_token(token: int) -> None:
                accepted.append(token)
                self._first_token(began)
                if not self.killed and len(accepted) == args.lose_at:
                    self._kill(handle.core.route, len(accepted))

            began = time.perf_counter()
            handle, stream = start_text(
                manager,
                tokenizer,
                args.prompt,
                max_new_tokens=args.steps,
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
                whole_model_greedy, self.model.path, [ids], args.steps, OPTIONS
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
                self.stopped_at = f"stopped at the limit of {args.steps} tokens"
        finally:
            tokenizer.close()
        if not self.killed:
            console.say(
                f"          the answer ended before {args.lose_at} tokens: no stage was lost "
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
    args: argparse.Namespace,
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
        f"{args.sessions} x {args.steps} tokens at most"
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


def _defaults(args: argparse.Namespace, *, chat: bool) -> None:
    """Fills in the defaults that depend on the model, and checks the values against them."""
    if chat:
        if args.sessions not in (None, 1):
            raise DemoRefused("--sessions goes with --fixture: the chat demo streams one answer")
        args.sessions = 1
        args.steps = CHAT_STEPS if args.steps is None else args.steps
        args.lose_at = CHAT_LOSE_AT if args.lose_at is None else args.lose_at
        args.prompt = QUESTION if args.prompt is None else args.prompt
    else:
        args.sessions = FIXTURE_SESSIONS if args.sessions is None else args.sessions
        args.steps = FIXTURE_STEPS if args.steps is None else args.steps
        args.lose_at = FIXTURE_LOSE_AT if args.lose_at is None else args.lose_at
    if args.sessions < 1:
        raise DemoRefused("--sessions must be at least 1")
    if not 0 < args.lose_at < args.steps:
        raise DemoRefused("--lose-at must be in (0, --steps)")


def _check(args: argparse.Namespace) -> None:
    """What can be refused before anything runs (:class:`DemoRefused`)."""
    if args.fixture is not None:
        if args.prompt is not None:
            raise DemoRefused("--prompt goes with a real model: the fixtures have no tokenizer")
        try:
            lookup_fixture(args.fixture)
        except ValueError as exc:
            raise DemoRefused(str(exc)) from None
        _defaults(argparse.Namespace(**vars(args)), chat=False)
    else:
        try:
            lookup_model(args.model)
        except UnknownModel as exc:
            raise DemoRefused(str(exc)) from None
        if args.prompt is not None and not args.prompt.strip():
            raise DemoRefused("--prompt needs some text")
        _defaults(argparse.Namespace(**vars(args)), chat=True)
    if args.operator_dir is None:
        args.operator_dir = demo_home()


def run(args: argparse.Namespace) -> int:
    if args.verbose:
        log_to_stderr("DEBUG")
    try:
        _check(args)
    except DemoRefused as exc:
        print(f"dgr demo: {exc}", file=sys.stderr)
        return 2
    providers: list[LoopbackRouteProvider] = []
    outcome: DemoOutcome | None = None
    try:
        with sigterm_as_interrupt(), quiet_progress(args.quiet):
            outcome = asyncio.run(run_demo(args, providers))
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
