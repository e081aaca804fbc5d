"""The suite's shared helpers, in one place: bounded runs, the engine options and prompt most
worker tests use, the evidence kit of the certification tests, one route session over a
loopback provider, the evidence directories ``dgr certify`` fills for a run, the rule that the
fast set (``-m "not slow"``) starts no worker process, and frame link peers (raw connections,
and an honest session over a worker's link).

``conftest.py`` turns these into fixtures and hooks; test modules import what they need from
here (``from tests.harness import run``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import grpc
import numpy as np

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.processes import dgr_command
from dgr_engine.wire import frame_link as fl
from dgr_engine.wire.frames import encode_forward, output_from_reply
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import grpc_code
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    SessionHandle,
    SessionManager,
    SessionResult,
)

REPO = Path(__file__).resolve().parents[1]
"""The checkout the suite runs in."""

T = TypeVar("T")

WORKER_OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
"""The engine options of most tests that start workers: one thread each (2 cores are shared by
every process of a route), room for four sessions."""

PARITY_PROMPT = [int(t) for t in (np.arange(16) * 37 + 11) % 256]
"""A 16-token prompt inside every fixture's vocabulary, for parity runs."""


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def run(coro: Coroutine[Any, Any, T], limit: float = 60.0) -> T:
    """Runs a test scenario in a fresh event loop with an overall time bound (seconds)."""
    return asyncio.run(asyncio.wait_for(coro, limit))


# -- the fast set starts no worker process ------------------------------------------------------

WORKER_SUBCOMMANDS = frozenset({"worker", "certify", "demo", "generate", "chat", "serve"})
"""``dgr`` subcommands that run (or spawn) a shard worker."""


class WorkerInFastSet(AssertionError):
    """A test outside the slow set tried to start a worker process."""


def starts_a_worker(args: Any) -> bool:
    """Whether a command line (``Popen``'s first argument) runs a shard worker: ``dgr`` (or
    ``python -m dgr_engine.cli``) with a subcommand that serves or spawns workers, or a
    benchmark (``python -m benchmarks.NAME``: they stand routes up)."""
    if isinstance(args, str | bytes | os.PathLike):
        words = os.fsdecode(args).split()
    else:
        words = [os.fsdecode(a) for a in args]
    for i, word in enumerate(words):
        rest = words[i + 1 :]
        if os.path.basename(word) == "dgr" and rest[:1] and rest[0] in WORKER_SUBCOMMANDS:
            return True
        if word == "-m" and rest[:1] == ["dgr_engine.cli"]:
            return rest[1:2] != [] and rest[1] in WORKER_SUBCOMMANDS
        if word == "-m" and rest[:1] and rest[0].startswith("benchmarks"):
            return True
    return False


def no_worker_popen(real: type[subprocess.Popen[Any]]) -> type[subprocess.Popen[Any]]:
    """``subprocess.Popen`` that refuses to start a worker process (:func:`starts_a_worker`)."""

    class NoWorkerPopen(real):  # type: ignore[valid-type,misc]
        def __new__(cls, args: Any, *rest: Any, **kwargs: Any) -> Any:
            # refused before an instance exists (a half-made Popen complains when collected)
            if starts_a_worker(args):
                raise WorkerInFastSet(
                    f"a test outside the slow set started a worker process: {args!r}; "
                    "move it to tests/e2e/ or mark it slow"
                )
            return super().__new__(cls)

    return NoWorkerPopen


# -- evidence directories ------------------------------------------------------------------------

CERTIFIED_FIXTURES = ("tiny-llama", "tiny-v4")
"""The fixtures whose lanes (``dgr certify``'s default engine options) the suite certifies."""
CO_BATCH_FIXTURES = ("tiny-llama",)
"""Fixtures whose co-batching lanes (``--batching co-batch``) the suite certifies as well."""


def certify(root: Path, name: str, *extra: str) -> None:
    """``dgr certify --fixture NAME`` into ``root`` as a user would run it (without the
    llama.cpp RPC comparison, which no test of the suite reads from these records), its output
    kept beside ``root``."""
    done = subprocess.run(
        [dgr_command(), "certify", "--fixture", name, "--evidence", str(root), "--rpc", "off"]
        + list(extra),
        capture_output=True,
        text=True,
        timeout=600,
    )
    what = " ".join([name, *extra])
    assert done.returncode == 0, f"dgr certify --fixture {what}:\n{done.stdout}{done.stderr}"
    (root.parent / f"certify-{'-'.join([name, *extra[1:]])}.log").write_text(done.stdout)


SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma3-270m"
"""The catalog's real models the slow tests run (``dgr models list``)."""


@attrs.frozen
class RealLane:
    """A real model's lane certified in this test run under an operator lock of the run's own:
    the model (fetched through ``dgr_engine.models``, verified), the lock and the records."""

    model: Path
    lock: Path
    evidence: Path

    def serve_args(self) -> list[str]:
        """A worker's or ``dgr serve``'s arguments for this lane: the default engine options
        (the lane's), the lock, the records."""
        options = EngineOptions().worker_argv()
        return [*options, "--lock", str(self.lock), "--evidence", str(self.evidence)]

    def serve_arg_flags(self) -> list[str]:
        """A serve benchmark's ``--serve-arg`` flags that route ``dgr serve`` over this lane."""
        trust = ["--lock", str(self.lock), "--evidence", str(self.evidence)]
        return [f"--serve-arg={a}" for a in trust]


def certify_real_lane(home: Path, name: str) -> RealLane:
    """Certifies the catalog model ``name``'s lane (the default engine options) on this machine
    with ``dgr certify`` as an operator would run it, under an operator lock made in ``home``
    from the repo's lock (it declares the model, this machine's hardware lane and a new
    certifier key; nothing read from dgr's cache but the model file). The command must exit 0:
    every correctness requirement passed. Speed is judged, recorded and never required here
    (a run on two loaded cores can say fail; ``dgr gate`` reads it, not the suite)."""
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.cli._demo_operator import operator_lock
    from dgr_engine.models import lookup, resolve_model

    model = resolve_model(name)
    entry = lookup(name)
    operator = operator_lock(
        load_lock(), home, name=entry.name, arch=entry.arch, sha256=entry.sha256
    )
    done = subprocess.run(
        [dgr_command(), "certify", "--model", name, "--rpc", "off"]
        + ["--lock", str(operator.lock.path), "--evidence", str(operator.evidence)]
        + ["--sign-key", str(operator.key_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    (home / "certify.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"dgr certify --model {name}:\n{done.stdout}{done.stderr}"
    return RealLane(model, operator.lock.path, operator.evidence)


@attrs.define
class EvidenceDirs:
    """The evidence directories of one test run, made on first use: ``empty`` (one per test:
    what its workers read unless it asks for certified lanes), ``certified`` (the records ``dgr
    certify`` made in this run for :data:`CERTIFIED_FIXTURES`), ``co_batch`` (those plus
    the co-batching lanes of :data:`CO_BATCH_FIXTURES`) and each real model's lane
    (:meth:`real_lane`). Nothing is reused from an earlier run or from dgr's cache, so a run
    on a machine that never ran dgr does what every run does."""

    base: Path = attrs.field(factory=lambda: Path(tempfile.mkdtemp(prefix="dgr-test-evidence-")))
    _certified: Path | None = None
    _co_batch: Path | None = None
    _real: dict[str, RealLane] = attrs.field(factory=dict)

    _made: int = 0

    def empty(self) -> Path:
        """A new empty directory: one test's, so what one test's workers write there (a demo's
        records) is never what another reads."""
        self._made += 1
        path = self.base / "empty" / str(self._made) / "evidence"
        path.mkdir(parents=True)
        return path

    def certified(self) -> Path:
        if self._certified is None:
            root = self.base / "certified" / "evidence"
            root.mkdir(parents=True, exist_ok=True)
            for name in CERTIFIED_FIXTURES:
                certify(root, name)
            self._certified = root
        return self._certified

    def co_batch(self) -> Path:
        if self._co_batch is None:
            root = self.base / "co-batch" / "evidence"
            root.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(self.certified(), root)
            for name in CO_BATCH_FIXTURES:
                certify(root, name, "--batching", "co-batch")
            self._co_batch = root
        return self._co_batch

    def real_lane(self, name: str) -> RealLane:
        """The catalog model ``name``'s lane, certified once in this run
        (:func:`certify_real_lane`)."""
        if name not in self._real:
            home = self.base / "lanes" / name
            home.mkdir(parents=True, exist_ok=True)
            self._real[name] = certify_real_lane(home, name)
        return self._real[name]

    def operator_home(self) -> Path:
        """A new operator home, not yet made (``$DGR_OPERATOR_HOME`` of one test): nothing a
        test certifies for its own model reaches the user's, or another test's."""
        self._made += 1
        return self.base / "operator" / str(self._made)

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


# -- the certification tests' kit ----------------------------------------------------------------


class EvidenceKit:
    """Makes locks, lanes and evidence records for the certification tests (in ``root``).

    The kit's lock is the repo's plus two test certifiers made for the kit: ``operator``,
    trusted for real-model and real-hardware evidence, and ``releaser``, trusted for release.
    :meth:`write` signs a record with the key its class calls for (the fixture certifier for
    fixture evidence)."""

    def __init__(self, root: Path) -> None:
        import json

        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from dgr_engine.certification.lock import load_lock
        from dgr_engine.certification.signing import public_key_text

        self.root = root
        self.operator = Ed25519PrivateKey.generate()
        self.releaser = Ed25519PrivateKey.generate()
        data = json.loads((REPO / "certification/lock.json").read_text())
        data["certifiers"] += [
            {
                "name": "test-operator",
                "public_key": public_key_text(self.operator.public_key()),
                "classes": ["real-model", "real-hardware"],
            },
            {
                "name": "test-releaser",
                "public_key": public_key_text(self.releaser.public_key()),
                "classes": ["release"],
            },
        ]
        self.lock_path = root / "lock.json"
        self.lock_path.write_text(json.dumps(data, indent=2))
        self.lock = load_lock(self.lock_path)  # outside git: its time is the declared one

    def edit_lock(self, edit: Any) -> Any:
        """Rewrites the lock (``edit`` changes the parsed JSON in place) and reloads it."""
        import json

        from dgr_engine.certification.lock import load_lock

        data = json.loads(self.lock_path.read_text())
        edit(data)
        self.lock_path.write_text(json.dumps(data))
        self.lock = load_lock(self.lock_path)
        return self.lock

    @staticmethod
    def lane(**changes: Any) -> Any:
        from dgr_engine.certification.lane import LaneKey

        fields: dict[str, Any] = {
            "backend": "cpu",
            "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
            "patch_stack_sha256": "ab" * 32,
            "dgr_version": "0.1.0",
            "build_flags": "GGML_NATIVE=OFF",
            "system_info": "CPU : AVX2 = 1 |",
            "hardware": "x86_64 | Test CPU | avx avx2",
            "model_sha256": "cd" * 32,
            "arch": "llama",
            "n_layer": 4,
            "quant_types": ("F32",),
            "kv_type": "f16",
            "flash_attn": "auto",
            "context_per_session": 256,
            "placement": "cpu",
        }
        fields.update(changes)
        return LaneKey(**fields)

    @staticmethod
    def fixture_facts(**changes: Any) -> Any:
        from dgr_engine.certification.classify import EvidenceFacts

        fields: dict[str, Any] = {
            "fixture_mark": "dgr-fixtures/2 tiny-llama",
            "real_model": None,
            "hardware_lane": None,
            "release_build": False,
        }
        fields.update(changes)
        return EvidenceFacts(**fields)

    def record(
        self,
        *,
        kind: str = "certification",
        family: str = "dense",
        failing: tuple[str, ...] = (),
        shares: dict[str, float] | None = None,
        requirement_ids: tuple[str, ...] | None = None,
        **changes: Any,
    ) -> Any:
        """A record made now under the kit's lock; every requirement passes but ``failing``."""
        import datetime as dt

        from dgr_engine.certification import gates
        from dgr_engine.certification.record import (
            EvidenceRecord,
            Figure,
            RecordKind,
            Requirement,
            Verdict,
        )

        ids = requirement_ids
        if ids is None:
            ids = {
                "certification": gates.CORRECTNESS + gates.SPEED,
                "baseline": ("baseline.parity", "baseline.speed"),
                "mtp": gates.MTP_REQUIREMENTS,
            }[kind]
        shares = shares or {"engine": 0.4, "worker": 0.1, "transit": 0.3, "client": 0.2}
        now = dt.datetime.now(dt.UTC)
        fields: dict[str, Any] = {
            "kind": RecordKind(kind),
            "lane": self.lane(arch="deepseek4" if family == "v4" else "llama"),
            "lock_sha256": self.lock.sha256,
            "facts": self.fixture_facts(),
            "family": family,
            "command": ("dgr", "certify", "--fixture", "tiny-llama"),
            "dgr_commit": "0" * 40,
            "machine": {"hardware": "x86_64 | Test CPU | avx avx2", "cpus": "2"},
            "started_at": now,
            "ended_at": now + dt.timedelta(seconds=8),
            "figures": [Figure("speed.decode_ratio", 0.5, "whole/route", "2 stages")]
            + [Figure(f"hop.{p}_share", v, "share", "decode") for p, v in shares.items()],
            "requirements": [
                Requirement(r, Verdict.FAIL if r in failing else Verdict.PASS, f"{r} detail")
                for r in ids
            ],
        }
        fields.update(changes)
        return EvidenceRecord(**fields)

    def key_for(self, record: Any) -> Any:
        """The key the kit signs ``record`` with: the one its class calls for."""
        from dgr_engine.certification.signing import FIXTURE_CERTIFIER
        from dgr_session.identity import EvidenceClass

        return {
            EvidenceClass.FIXTURE: FIXTURE_CERTIFIER,
            EvidenceClass.REAL_MODEL: self.operator,
            EvidenceClass.REAL_HARDWARE: self.operator,
            EvidenceClass.RELEASE: self.releaser,
        }[record.evidence_class]

    def write(self, record: Any, directory: Path | None = None, *, key: Any = None) -> Path:
        """``record`` written under ``directory`` (default: the kit's evidence/), signed by
        ``key`` (default: :meth:`key_for`)."""
        from dgr_engine.certification.record import write_record

        key = key if key is not None else self.key_for(record)
        path: Path = write_record(record, directory or self.root / "evidence", key=key)
        return path


# -- one route session over a loopback provider's workers ----------------------------------------

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


# -- frame link peers: raw connections, and an honest session over the link -----------------------

LINK_READ_SECONDS = 10.0
"""Bound on any one read from a frame link (a worker that answers nothing fails the test)."""

LinkStatus = tuple["grpc.StatusCode", str, dict[str, str]]
"""A frame link call's end: its code, details and trailers."""


class LinkPeer:
    """A raw frame link connection (``dgr_engine/wire/frame_link.py``): bytes out, messages
    in, every read bounded by ``LINK_READ_SECONDS``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int, host: str = "127.0.0.1") -> LinkPeer:
        return cls(*await asyncio.open_connection(host, port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> LinkStatus | None:
        """Everything the worker sends until it closes the connection: its ``STATUS``, or
        ``None`` when it closed without one (a call dropped: nobody to tell). Replies before
        the ``STATUS`` are skipped; anything after it, or bytes that are not messages, fail."""
        status: LinkStatus | None = None
        async with asyncio.timeout(LINK_READ_SECONDS):
            while True:
                try:
                    kind, payload = await fl.read_message(self.reader, 1 << 24)
                except asyncio.IncompleteReadError as end:
                    assert end.partial == b"", f"the worker sent half a message: {end.partial!r}"
                    return status
                except ConnectionResetError:
                    return status  # it closed with our bytes unread: a reset, not a FIN
                assert status is None, f"a {kind.name} after the STATUS"
                if kind is fl.Kind.STATUS:
                    code, details, trailers = fl.decode_status(payload)
                    status = grpc_code(code), details, dict(trailers)
                else:
                    assert kind is fl.Kind.MESSAGE, kind

    async def status(self) -> LinkStatus:
        """The call's ``STATUS``; the worker must send one."""
        status = await self.answer()
        assert status is not None, "the worker closed the connection without a STATUS"
        return status

    async def closed(self) -> bytes:
        """Waits for the worker to close the connection; what it sent before."""
        async with asyncio.timeout(LINK_READ_SECONDS):
            try:
                return await self.reader.read()
            except ConnectionResetError:
                return b""

    def close(self) -> None:
        self.writer.close()


def link_open(method: str = "ChainStream") -> bytes:
    """A frame link ``OPEN`` of ``method`` with no metadata."""
    return fl.pack(fl.Kind.OPEN, fl.encode_open(method, []))


class LinkSession:
    """An honest session over a worker's frame link: opened over gRPC (``address``), its
    output stream (``ChainOutput``) and its frames (``ChainStream``) on the link
    (``link_port``); one token per :meth:`step`, the last row's logits kept (``logits``).
    ``front``: an engine running the layers before the worker's (the session then sends it
    boundary rows, as the stage before would)."""

    def __init__(
        self,
        address: str,
        link_port: int,
        session_id: str,
        prompt: Sequence[int],
        front: Any = None,
    ) -> None:
        self.address, self.session_id, self.prompt, self.front = address, session_id, prompt, front
        self.target = fl.FrameLinkTarget("127.0.0.1", link_port)
        self.logits: list[np.ndarray] = []
        self.secret = b""
        self.expect: Any = None
        self.output: fl.FrameLinkCall[Any] | None = None
        self.stream: fl.FrameLinkCall[Any] | None = None

    async def open(self) -> None:
        async with ShardClient(self.address, timeout=LINK_READ_SECONDS) as client:
            self.expect = expectations_of(await client.describe())
            await client.open(self.session_id, 1, self.expect)
            self.secret = client.session_secret(self.session_id, 1)
        if self.front is not None:
            self.front.open_session(1, 1)
        request = pb.ChainOutputRequest(
            session_id=self.session_id, epoch=1, session_secret=self.secret
        )
        self.output = self.target.ChainOutput(request)
        async with asyncio.timeout(LINK_READ_SECONDS):
            assert await self.output.read() == pb.ChainOutputReply()  # registered
        self.stream = self.target.ChainStream()

    def frame(self) -> pb.ForwardRequest:
        """The next step's frame (the prompt, then the last token chosen greedily)."""
        step = len(self.logits)
        rows = list(self.prompt) if step == 0 else [int(np.argmax(self.logits[-1]))]
        at = 0 if step == 0 else len(self.prompt) + step - 1
        positions = np.arange(at, at + len(rows), dtype=np.int32)
        boundary = None
        if self.front is not None:
            boundary = self.front.forward(1, 1, positions, tokens=np.asarray(rows, np.int32))
        return encode_forward(
            self.session_id,
            1,
            step,
            self.expect,
            positions,
            tokens=None if boundary is not None else rows,
            boundary=boundary,
            logit_rows=[len(rows) - 1],
            session_secret=self.secret,
        )

    async def step(self) -> None:
        assert self.stream is not None and self.output is not None
        await self.stream.write(self.frame())
        async with asyncio.timeout(LINK_READ_SECONDS):
            reply = await self.output.read()
        self.logits.append(output_from_reply(reply.reply)[-1].copy())

    async def close(self) -> None:
        """Ends the stream (OK), closes the session, and sees its output stream end."""
        assert self.stream is not None and self.output is not None
        await self.stream.done_writing()
        async with asyncio.timeout(LINK_READ_SECONDS):
            assert await self.stream.read() in (None, grpc.aio.EOF)  # the stream ended OK
        request = pb.CloseSessionRequest(
            session_id=self.session_id, epoch=1, session_secret=self.secret
        )
        async with grpc.aio.insecure_channel(self.address) as channel:
            await shard_pb2_grpc.ShardStub(channel).CloseSession(request, timeout=LINK_READ_SECONDS)
        if self.front is not None:
            self.front.close_session(1, 1)
        async with asyncio.timeout(LINK_READ_SECONDS):
            assert await self.output.read() in (None, grpc.aio.EOF)  # its client closed the epoch

    def exact(self, want: Sequence[np.ndarray]) -> bool:
        """Every step's logits so far equal ``want``'s, bit for bit (and there was one)."""
        return 0 < len(self.logits) <= len(want) and all(
            np.array_equal(got, row) for got, row in zip(self.logits, want, strict=False)
        )
