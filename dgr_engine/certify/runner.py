"""``dgr certify``: run the certification scenarios of one lane here and write its record.

The lane is the model, this build, this machine's hardware class and the recipe; the evidence
class is derived from facts (:mod:`~dgr_engine.certification.classify`), never chosen. Stage
layouts come from the lock's stage counts and the model's layer count (a count above the
layers is skipped: 10+ stages only where the model has the layers). Per layout, over real
worker processes: route parity and relayed-chain parity against the whole model, each stage
alone, and each shard's peak RSS; on the 2-stage layout, session isolation; on the lock's speed
layouts, the useful-speed figures; on the 3-stage layout (else the last), a stage lost
mid-decode. Progress goes to ``progress`` as it runs. The record is signed by the certifier
key given (by default the fixture certifier, for fixture evidence only); a key the lock does
not trust for the derived class is refused before anything runs.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.certification import signing
from dgr_engine.certification.classify import EvidenceFacts, derive_facts
from dgr_engine.certification.errors import SignatureRefused
from dgr_engine.certification.gates import HOP_PARTS
from dgr_engine.certification.lane import LaneKey
from dgr_engine.certification.lock import Lock, Thresholds
from dgr_engine.certification.record import (
    EvidenceRecord,
    Figure,
    RecordKind,
    Requirement,
    Verdict,
    signed,
    write_record,
)
from dgr_engine.certification.release import release_state
from dgr_engine.certify import scenarios
from dgr_engine.certify.scenarios import Layout, Reference
from dgr_engine.engine import ShardEngine
from dgr_engine.gguf_check import check_gguf
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points, whole_model_reference
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.peer_build import PeerUse, find_peers
from dgr_engine.tooling.processes import worker_omp_wait_policy
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_session.identity import EvidenceClass

_CHECKOUT = Path(__file__).resolve().parents[2]
PROMPT_LEN = 12
FIXTURE_SPEED_NOTE = (
    " (a generated fixture: a few layers of random weights, where a forward costs less than "
    "the hop to the next stage; its speed says nothing about a real model's)"
)
"""Ends the speed requirements of fixture evidence: the figures are measured and reported,
but a route over a toy model is slower than its whole model by construction."""
_FIXTURE_SPEED_TAG = " (meaningless on a generated fixture)"
"""Ends the speed progress lines of fixture evidence."""


@attrs.frozen
class CertifyResult:
    """The record written, where, and how long the run took."""

    record: EvidenceRecord
    path: Path
    seconds: float


def layouts_for(n_layer: int, stage_counts: Sequence[int]) -> list[Layout]:
    """Even layouts for each stage count the model has the layers for."""
    return [tuple(split_points(n_layer, k)) for k in sorted(set(stage_counts)) if k <= n_layer]


def git_commit() -> tuple[str, bool]:
    """(dgr's commit, ``+dirty`` appended when the tree has changes; whether clean)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(_CHECKOUT), *args], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None:
        return "unknown", False
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return head + ("+dirty" if dirty else ""), not dirty


def signing_key_for(
    lock: Lock, evidence: EvidenceClass, key: Ed25519PrivateKey | None
) -> Ed25519PrivateKey:
    """The key to sign a record of ``evidence`` class with: ``key``, else the fixture
    certifier for fixture evidence; :class:`SignatureRefused` (before any work) when there is
    none or the lock would not admit its signature on such a record."""
    if key is None:
        if evidence is not EvidenceClass.FIXTURE:
            raise SignatureRefused(
                f"signature: {evidence.value} evidence needs the operator's certifier key "
                "(--sign-key FILE); the fixture certifier signs fixture evidence only",
                reason="unsigned",
            )
        key = signing.FIXTURE_CERTIFIER
    key_id = signing.key_id_of(key.public_key())
    certifier = lock.certifier(key_id)
    if certifier is None:
        raise SignatureRefused(
            f"signature: the lock ({lock.path}) does not declare the signing key {key_id}: "
            "its records would be refused (unknown key)",
            key_id=key_id,
            reason="unknown key",
        )
    if evidence not in certifier.classes:
        trusted = ", ".join(c.value for c in certifier.classes)
        raise SignatureRefused(
            f"signature: the lock trusts key {key_id} ({certifier.name}) for {trusted}, not "
            f"{evidence.value} evidence: its records would be refused",
            key_id=key_id,
            reason="key not trusted for class",
        )
    return key


def evidence_class_reason(facts: EvidenceFacts, lane: LaneKey) -> str:
    """Why the record has its class, in one line (a real model off a declared hardware lane
    says which facts of this machine no hardware lane of the lock names)."""
    cls = facts.evidence_class.value
    if facts.fixture_mark is not None:
        return f"{cls}: a generated fixture (dgr.fixture mark {facts.fixture_mark!r})"
    if facts.hardware_lane is None:
        return (
            f"{cls}: the lock's real model {facts.real_model}, but no hardware lane of the lock "
            f"names this machine and build ({lane.hardware}; llama.cpp "
            f"{lane.llama_cpp_commit[:12]}, patch stack {lane.patch_stack_sha256[:12]}, "
            f"{lane.backend}), so not real-hardware (declare it: dgr lock declare-hardware)"
        )
    return (
        f"{cls}: the lock's real model {facts.real_model} on its hardware lane "
        f"{facts.hardware_lane}"
    )


def machine_facts(hardware: str) -> dict[str, str]:
    return {
        "hardware": hardware,
        "cpus": str(os.cpu_count() or 0),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def _prompts(n: int, n_vocab: int) -> tuple[tuple[int, ...], ...]:
    rng = np.random.default_rng(11)
    return tuple(tuple(int(t) for t in rng.integers(0, n_vocab, PROMPT_LEN)) for _ in range(n))


def lane_of(model: str | os.PathLike[str], options: EngineOptions) -> LaneKey:
    """The lane ``model`` served with ``options`` has on this machine and build."""
    build = BuildIdentity.of_model(model).with_numerics(options.numerics)
    build = attrs.evolve(build, batching=options.batching)
    # the context the engine really provides (llama.cpp rounds it up), as a worker states it
    with ShardEngine(Path(model), layers=(0, 1), **options.engine_kwargs()) as probe:
        info = probe.info
    return build.lane_key(
        arch=info.arch, n_layer=info.n_layer, context_per_session=info.n_ctx_per_session
    )


async def certify(
    model: str | os.PathLike[str],
    *,
    options: EngineOptions,
    lock: Lock,
    evidence_dir: str | os.PathLike[str],
    command: Sequence[str],
    progress: Callable[[str], None] = lambda _text: None,
    key: Ed25519PrivateKey | None = None,
    rpc: PeerUse = PeerUse.AUTO,
) -> CertifyResult:
    """Certify the lane of ``model`` with ``options`` on this machine; write the record,
    signed by ``key`` (default: the fixture certifier, for fixture evidence only). ``rpc``:
    when llama.cpp RPC runs beside the speed layouts (``speed.vs_rpc``; :class:`PeerUse`)."""
    began = time.perf_counter()
    started = dt.datetime.now(dt.UTC)
    model = Path(model).resolve()
    lock.require_committed()
    lock.admit(lock.sha256, started, path=None)  # refuses before work that could not count
    limits = lock.thresholds
    if options.max_sessions < limits.isolation_sessions:
        raise ValueError(
            f"the lock's isolation scenario runs {limits.isolation_sessions} concurrent "
            f"sessions: certify with at least that many sessions per worker (max_sessions is "
            f"not part of the lane), not {options.max_sessions}"
        )
    header = check_gguf(model)  # once: arrays skipped, nothing materialised
    build = BuildIdentity.of_model(model, header)
    arch, n_layer = header.arch or "?", header.n_main_layers
    n_vocab = header.n_vocab
    if n_vocab is None:
        raise ValueError(f"{model}: no token_embd.weight tensor in its header")
    lane = await asyncio.to_thread(lane_of, model, options)
    commit, _clean = git_commit()
    release = release_state(lane.dgr_version)
    facts = derive_facts(
        lane, fixture_mark=build.fixture_mark, lock=lock, release_build=release.is_release
    )
    evidence = facts.evidence_class  # UnclassifiableModel before anything runs
    class_reason = evidence_class_reason(facts, lane)
    key = signing_key_for(lock, evidence, key)
    comparable = lock.require_comparable_lane(evidence, lane.backend, arch, facts.real_model)
    family = comparable.family
    layouts = layouts_for(n_layer, limits.layout_stage_counts)
    failure_layout = next((lay for lay in layouts if len(lay) == 3), layouts[-1])
    lose_stage = 1 if len(failure_layout) >= 3 else len(failure_layout) - 1
    progress(
        f"lane {lane.lane_id[:12]} in the lock's {comparable.name} ({arch}, {n_layer} layers, "
        f"{evidence.value} evidence: "
        f"{'fixture mark ' + repr(facts.fixture_mark) if facts.fixture_mark else facts.real_model})"
    )
    progress(f"evidence class: {class_reason}")
    why_not = "; ".join(release.reasons)
    progress(
        f"release build: {'yes' if release.is_release else f'no ({why_not})'}; signed by key "
        f"{signing.key_id_of(key.public_key())}"
    )
    progress(f"layouts: {', '.join(f'{len(lay)} stages' for lay in layouts)}")
    rpc_side, rpc_reason = await _rpc_side(rpc, evidence, model, options, n_layer, progress)

    prompts = _prompts(limits.isolation_sessions, n_vocab)
    with _Step(progress, "whole-model reference", indent="") as step:
        ref = await _reference(model, prompts, limits.isolation_tokens, options)
        step.outcome = f"{len(prompts)} prompts x {limits.isolation_tokens} tokens"
    fixture = evidence is EvidenceClass.FIXTURE
    speed_note, speed_tag = (FIXTURE_SPEED_NOTE, _FIXTURE_SPEED_TAG) if fixture else ("", "")

    figures: list[Figure] = []
    parity_notes: list[str] = []
    stage_notes: list[str] = []
    rss_notes: list[str] = []
    decode_notes: list[str] = []
    prefill_notes: list[str] = []
    parity_ok = stage_ok = rss_ok = True
    decode_ok = prefill_ok = True
    isolation: scenarios.Outcome | None = None
    failure: scenarios.Outcome | None = None
    shares: dict[str, float] | None = None
    vs_rpc: list[scenarios.RpcComparison] = []
    speed_prompt = list(np.resize(np.asarray(prompts[0]), limits.speed.prefill_tokens))
    with tempfile.TemporaryDirectory(prefix="dgr-certify-") as empty:
        for index, layout in enumerate(layouts):
            text = scenarios.layout_text(layout)
            progress(f"[{index + 1}/{len(layouts)}] {len(layout)} stages {text}")
            spares = [layout[lose_stage]] if layout == failure_layout else []
            provider = LoopbackRouteProvider(
                model,
                layout,
                spares=spares,
                options=options,
                worker_args=["--evidence", empty],
            )
            try:
                with _Step(progress, "workers") as step:
                    await provider.start()
                    step.outcome = f"{len(provider.workers)} started"
                with _Step(progress, "parity") as step:
                    results = await scenarios.run_sessions(
                        provider,
                        evidence,
                        ref.prompts[:1],
                        limits.isolation_tokens,
                        deadline=limits.step_deadline_seconds,
                    )
                    if scenarios.compare(results, ref, [0]):
                        parity_ok = False
                        parity_notes.append(f"{len(layout)} stages: route tokens differ")
                    chain_ok, alone_ok, note, sizes = await scenarios.stage_checks(
                        provider, model, layout, options, ref, f"certify-{index}"
                    )
                    parity_ok &= chain_ok
                    stage_ok &= alone_ok
                    if note:
                        (parity_notes if not chain_ok else stage_notes).append(
                            f"{len(layout)} stages: {note}"
                        )
                    chain_text = "bit-exact" if chain_ok and not results[0].error else "FAILED"
                    step.outcome = (
                        f"{chain_text}, each stage alone {'bit-exact' if alone_ok else 'FAILED'}"
                    )
                if len(layout) in limits.speed.stage_counts:
                    with _Step(progress, "speed (whole/route)") as step:
                        measured = await scenarios.speed(
                            provider,
                            evidence,
                            model,
                            options,
                            speed_prompt,
                            limits,
                            len(layout),
                            rpc=rpc_side,
                        )
                        step.outcome = (
                            f"decode {measured.decode_ratio:.2f}, prefill "
                            f"{measured.prefill_ratio:.2f}{speed_tag}"
                        )
                    figures += measured.figures
                    if shares is None:
                        shares = measured.shares
                    decode_ok &= measured.decode_ratio >= limits.speed.decode_ratio_min
                    prefill_ok &= measured.prefill_ratio >= limits.speed.prefill_ratio_min
                    decode_notes.append(f"{len(layout)} stages {measured.decode_ratio:.2f}")
                    prefill_notes.append(f"{len(layout)} stages {measured.prefill_ratio:.2f}")
                    if measured.vs_rpc is not None:
                        vs_rpc.append(measured.vs_rpc)
                        progress(f"      {_rpc_line(measured.vs_rpc)}")
                if len(layout) == 2 or (isolation is None and index == len(layouts) - 1):
                    with _Step(progress, "isolation") as step:
                        isolation = await scenarios.isolation(provider, evidence, ref, limits)
                        step.outcome = isolation.requirement.verdict.value
                    figures += isolation.figures
                rss_figures, ok, note = scenarios.resources(provider, layout, sizes, limits)
                figures += rss_figures
                rss_ok &= ok
                if note:
                    rss_notes.append(f"{len(layout)} stages: {note}")
                if layout == failure_layout:
                    with _Step(progress, "stage lost mid-decode") as step:
                        failure = await scenarios.bounded_failure(
                            provider, evidence, ref, limits, lose_stage
                        )
                        step.outcome = failure.requirement.detail
                    figures += failure.figures
            finally:
                await provider.aclose()
    assert isolation is not None and failure is not None
    rpc_outcome = scenarios.judge_vs_rpc(
        vs_rpc,
        limits.speed.vs_rpc_decode_ratio_min,
        not_measured=rpc_reason,
        how=_rpc_how(options, limits),
    )
    figures += rpc_outcome.figures
    if shares is not None:
        figures += [Figure(f"hop.{p}_share", shares[p], "share", "decode") for p in HOP_PARTS]
    seconds = time.perf_counter() - began
    figures.append(Figure("certify.seconds", seconds, "s", ""))
    n_text = ", ".join(str(len(lay)) for lay in layouts)
    requirements = [
        _req(
            "parity.layouts",
            parity_ok,
            f"{n_text} stages: tokens and logits bit-exact against the whole model"
            if parity_ok
            else "; ".join(parity_notes),
        ),
        _req(
            "execution.per_stage",
            stage_ok,
            "every stage of every layout alone bit-exact against its in-process range"
            if stage_ok
            else "; ".join(stage_notes),
        ),
        isolation.requirement,
        failure.requirement,
        _req(
            "resources.rss",
            rss_ok,
            f"peak RSS <= {limits.rss_factor:g} x (weights + KV) + {limits.rss_slack_mib:g} MiB"
            if rss_ok
            else "; ".join(rss_notes),
        ),
        _req(
            "speed.decode",
            decode_ok,
            f"whole/route >= {limits.speed.decode_ratio_min:g}: {', '.join(decode_notes)}"
            f"{speed_note}",
        ),
        _req(
            "speed.prefill",
            prefill_ok,
            f"whole/route >= {limits.speed.prefill_ratio_min:g}: {', '.join(prefill_notes)}"
            f"{speed_note}",
        ),
        rpc_outcome.requirement,
        _req("mtp.off", True, "MTP off: no shard loads or runs MTP/nextn layers"),
    ]
    record = EvidenceRecord(
        kind=RecordKind.CERTIFICATION,
        lane=lane,
        lock_sha256=lock.sha256,
        facts=facts,
        family=family,
        command=tuple(command),
        dgr_commit=commit,
        machine={**machine_facts(lane.hardware), "evidence_class": class_reason},
        started_at=started,
        ended_at=dt.datetime.now(dt.UTC),
        figures=tuple(figures),
        requirements=tuple(requirements),
    )
    record = signed(record, key)
    path = write_record(record, evidence_dir)
    return CertifyResult(record, path, seconds)


async def _rpc_side(
    use: PeerUse,
    evidence: EvidenceClass,
    model: Path,
    options: EngineOptions,
    n_layer: int,
    progress: Callable[[str], None],
) -> tuple[scenarios.RpcSide | None, str]:
    """llama.cpp RPC for the speed layouts as ``use`` asks (built first when missing, at
    real-model class or above, with progress), or the reason it is not run."""
    build = evidence.rank >= EvidenceClass.REAL_MODEL.rank
    peers = await asyncio.to_thread(find_peers, use, build_when_missing=build, log=progress)
    if peers.prefix is None:
        progress(f"llama.cpp RPC: not measured ({peers.reason})")
        return None, peers.reason
    progress(f"llama.cpp RPC beside each speed layout: the peers at {peers.prefix}")
    return scenarios.RpcSide.of(peers.prefix, model, options, n_layer), ""


def _rpc_line(c: scenarios.RpcComparison) -> str:
    if c.rpc_tps is None:
        return f"vs llama.cpp RPC: not measured ({c.error})"
    return (
        f"vs llama.cpp RPC (same split): route {c.route_tps:.1f} tok/s, RPC {c.rpc_tps:.1f} "
        f"tok/s, route/RPC {c.route_tps / c.rpc_tps:.2f}"
    )


def _rpc_how(options: EngineOptions, limits: Thresholds) -> str:
    s = limits.speed
    return (
        "route: a ring over the fastest data path its stages offer; "
        f"{options.n_threads} thread(s) per computing process, kv {options.kv_type}, "
        f"flash attention {options.flash_attn}, OMP_WAIT_POLICY PASSIVE for RPC, "
        f"{worker_omp_wait_policy()} for the route; "
        f"{s.decode_tokens} tokens at depth {s.prefill_tokens}; median of {s.rounds} "
        f"interleaved rounds; {os.cpu_count()} cores shared by every process"
    )


class _Step:
    """One scenario's progress: ``NAME ...`` when it starts; ``NAME: OUTCOME (N.N s)`` when it
    ends (``NAME: failed after N.N s`` when it raises). Set ``outcome`` inside the block."""

    def __init__(self, progress: Callable[[str], None], name: str, indent: str = " " * 6):
        self._progress, self._name, self._indent = progress, name, indent
        self.outcome = "done"
        self._began = 0.0

    def __enter__(self) -> _Step:
        self._began = time.perf_counter()
        self._progress(f"{self._indent}{self._name} ...")
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        seconds = time.perf_counter() - self._began
        if kind is None:
            self._progress(f"{self._indent}{self._name}: {self.outcome} ({seconds:.1f} s)")
        else:
            self._progress(f"{self._indent}{self._name}: failed after {seconds:.1f} s")


def _req(rid: str, ok: bool, detail: str) -> Requirement:
    return Requirement(rid, Verdict.PASS if ok else Verdict.FAIL, detail)


async def _reference(
    model: Path, prompts: Sequence[Sequence[int]], n_tokens: int, options: EngineOptions
) -> Reference:
    runs = await asyncio.to_thread(whole_model_reference, model, prompts, n_tokens, options)
    return Reference(
        prompts=tuple(tuple(p) for p in prompts),
        tokens=tuple(tuple(tokens) for tokens, _ in runs),
        logits=tuple(tuple(logits) for _, logits in runs),
    )
