"""A worker is certified only by a signed record of exactly its lane; anything else leaves it
dark, and a client checks the record an advert carries against its own lock.

The records are those ``dgr certify`` made in this test run (``fixture_evidence``); the
workers are in-process ``ShardWorker`` objects over the real engine (no serving needed: the
advert is computed from the lane lookup done at construction).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import attrs
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine import ShardEngine
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import (
    EvidenceRecord,
    Requirement,
    Verdict,
    load_evidence,
    load_record,
    record_json,
    write_record,
)
from dgr_engine.certification.verify import LockVerifier
from dgr_engine.numerics import Numerics
from dgr_engine.wire.advert import Advert, advert_from_proto, advert_to_proto
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_session.errors import UnverifiedCertification
from dgr_session.identity import CertificationStatus, EvidenceClass
from dgr_session.route import Route, StageSpec, validate_route
from tests.harness import EvidenceKit

CERTIFIED_CTX = 256  # dgr certify's default context per session


def worker(
    model: Path,
    evidence: Path | None,
    *,
    ctx: int = CERTIFIED_CTX,
    build=None,
    numerics: Numerics | None = None,
) -> ShardWorker:
    engine = ShardEngine(
        model, layers=(0, 2), max_sessions=1, n_ctx_per_session=ctx, n_threads=1, numerics=numerics
    )
    return ShardWorker(
        engine,
        build if build is not None else BuildIdentity.of_model(model),
        WorkerConfig(evidence_dir=evidence),
    )


def the_record(evidence: Path, model_sha: str) -> Path:
    loaded = load_evidence(evidence, load_lock())
    for record, path in zip(loaded.records, loaded.paths, strict=True):
        if record.lane.model_sha256 == model_sha:
            return path
    raise AssertionError(f"no record of model {model_sha[:12]} in {evidence}")


def test_the_certified_lane_advertises_its_record(tiny_llama: Path, fixture_evidence: Path) -> None:
    w = worker(tiny_llama, fixture_evidence)
    try:
        lane = w.advert().lane
        path = the_record(fixture_evidence, w.lane_key.model_sha256)
        assert lane.certification is CertificationStatus.CERTIFIED
        assert lane.evidence is EvidenceClass.FIXTURE
        assert lane.record_id == path.stem
        assert lane.lane_id == w.lane_key.lane_id == path.parent.name
        assert path.parent.parent.name == "fixture"
    finally:
        w.engine.close()


def test_another_context_per_session_is_another_lane(
    tiny_llama: Path, fixture_evidence: Path
) -> None:
    w = worker(tiny_llama, fixture_evidence, ctx=2 * CERTIFIED_CTX)
    try:
        assert w.advert().lane.certification is CertificationStatus.DARK
        assert w.advert().lane.record_id == ""
        assert any("context_per_session" in r for r in w.lane_lookup.reasons)
    finally:
        w.engine.close()


@pytest.mark.parametrize(
    "change",
    [
        {"hardware": "x86_64 | Some Other CPU | avx avx2"},
        {"dgr_version": "9.9.9"},
        {"build_flags": "GGML_NATIVE=ON"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_one_differing_part_leaves_the_worker_dark(
    tiny_llama: Path, fixture_evidence: Path, change: dict[str, str]
) -> None:
    build = attrs.evolve(BuildIdentity.of_model(tiny_llama), **change)  # type: ignore[arg-type]
    w = worker(tiny_llama, fixture_evidence, build=build)
    try:
        assert w.advert().lane.certification is CertificationStatus.DARK
        assert any(next(iter(change)) in r for r in w.lane_lookup.reasons)
    finally:
        w.engine.close()


@pytest.mark.parametrize(
    ("numerics", "part"),
    [(Numerics("f32", "auto"), "kv_type"), (Numerics("f16", "off"), "flash_attn")],
    ids=lambda v: v if isinstance(v, str) else str(v),
)
def test_other_numerics_leave_the_worker_dark(
    tiny_llama: Path, fixture_evidence: Path, numerics: Numerics, part: str
) -> None:
    # the engine's numerics are the lane's (a build stating others is overruled by the engine)
    w = worker(tiny_llama, fixture_evidence, numerics=numerics)
    try:
        assert getattr(w.lane_key, part) == getattr(numerics, part)
        assert w.advert().lane.certification is CertificationStatus.DARK
        assert any(part in r for r in w.lane_lookup.reasons)
    finally:
        w.engine.close()


def test_a_tampered_record_is_refused_and_the_worker_stays_dark(
    tiny_llama: Path, fixture_evidence: Path, tmp_path: Path
) -> None:
    sha = BuildIdentity.of_model(tiny_llama).model_sha256.hex()
    source = the_record(fixture_evidence, sha)
    target = tmp_path / source.relative_to(fixture_evidence)
    target.parent.mkdir(parents=True)
    data = json.loads(source.read_text())
    data["requirements"][0]["verdict"] = "pass"
    data["figures"][0]["value"] += 1.0  # edited after it was made
    target.write_text(json.dumps(data))
    w = worker(tiny_llama, tmp_path)
    try:
        assert w.advert().lane.certification is CertificationStatus.DARK
        assert any("record_id" in r and str(target) in r for r in w.lane_lookup.reasons)
    finally:
        w.engine.close()
    shutil.copy(source, target)  # the untouched record certifies again
    w = worker(tiny_llama, tmp_path)
    try:
        assert w.advert().lane.certification is CertificationStatus.CERTIFIED
    finally:
        w.engine.close()


# --- hostile records and lying adverts (issue 28) ----------------------------------------------


def _honest(evidence: Path, model: Path) -> EvidenceRecord:
    path = the_record(evidence, BuildIdentity.of_model(model).model_sha256.hex())
    return load_record(path, load_lock())


def test_a_worker_given_a_forged_record_stays_dark_beside_an_honest_one(
    tiny_llama: Path, fixture_evidence: Path, tmp_path: Path
) -> None:
    honest = _honest(fixture_evidence, tiny_llama)
    evidence = tmp_path / "evidence"
    write_record(honest, evidence)  # as it was signed
    wider = 2 * CERTIFIED_CTX
    fake = attrs.evolve(  # the hostile pass: context 256 -> 512, every verdict "pass"
        honest,
        lane=attrs.evolve(honest.lane, context_per_session=wider),
        requirements=[Requirement(r.id, Verdict.PASS, r.detail) for r in honest.requirements],
    )
    forged = write_record(fake, evidence)  # re-hashed by dgr's own writer, signature kept
    stranger = write_record(
        attrs.evolve(fake, command=("forged",)), evidence, key=Ed25519PrivateKey.generate()
    )
    w = worker(tiny_llama, evidence, ctx=wider)
    try:
        assert w.lane_key.lane_id == fake.lane_id  # the forged records name this very lane
        assert w.advert().lane.certification is CertificationStatus.DARK
        reasons = " | ".join(w.lane_lookup.reasons)
        assert f"{forged}: signature: does not verify" in reasons, reasons
        assert f"{stranger}: signature: signed by key" in reasons and "unknown key" in reasons
    finally:
        w.engine.close()
    w = worker(tiny_llama, evidence)
    try:
        lane = w.advert().lane
        assert lane.certification is CertificationStatus.CERTIFIED
        assert lane.record_id == honest.record_id
    finally:
        w.engine.close()


def _stage(advert: Advert) -> StageSpec:
    return advert_from_proto(advert_to_proto(advert)).stage_spec("127.0.0.1:1")


def _route_check(stage: StageSpec, verifier: LockVerifier) -> None:
    validate_route(
        Route([stage]), required_evidence=EvidenceClass.FIXTURE, verify_certification=verifier
    )


def test_the_client_checks_the_advert_against_its_own_lock(
    tiny_llama: Path, fixture_evidence: Path, kit: EvidenceKit
) -> None:
    sha = BuildIdentity.of_model(tiny_llama).model_sha256.hex()
    n_layer = load_record(the_record(fixture_evidence, sha), load_lock()).lane.n_layer
    engine = ShardEngine(
        tiny_llama,
        layers=(0, n_layer),
        max_sessions=1,
        n_ctx_per_session=CERTIFIED_CTX,
        n_threads=1,
    )
    w = ShardWorker(
        engine, BuildIdentity.of_model(tiny_llama), WorkerConfig(evidence_dir=fixture_evidence)
    )
    try:
        advert = w.advert()
        stage = _stage(advert)
        ours = LockVerifier(load_lock())
        assert stage.lane.record  # the signed record travels in the advert
        _route_check(stage, ours)  # the honest advert verifies
        honest = _honest(fixture_evidence, tiny_llama)
        lane = advert.lane
        forged = attrs.evolve(
            honest,
            requirements=[Requirement(r.id, Verdict.PASS, r.detail) for r in honest.requirements],
            figures=(),
        )
        lies = {
            "a higher class than the record's": attrs.evolve(
                lane, evidence=EvidenceClass.REAL_HARDWARE
            ),
            "no record": attrs.evolve(lane, record=""),
            "an edited record": attrs.evolve(
                lane, record=record_json(forged), record_id=forged.record_id
            ),
            "another model's record": attrs.evolve(
                lane,
                record=record_json(load_record(_other_record(fixture_evidence, sha), load_lock())),
            ),
        }
        expected = {
            "a higher class than the record's": "differs in evidence class",
            "no record": "carries no signed record",
            "an edited record": "bad signature",
            "another model's record": "differs in lane id, record id",
        }
        for what, lying in lies.items():
            lying_stage = _stage(attrs.evolve(advert, lane=lying))
            with pytest.raises(UnverifiedCertification) as refused:
                _route_check(lying_stage, ours)
            assert expected[what] in str(refused.value), (what, str(refused.value))
            assert refused.value.stage_index == 0
        # a client whose lock is another (the worker's lock is not the client's) refuses too
        theirs = LockVerifier(
            kit.edit_lock(lambda d: d["thresholds"]["isolation"].update(tokens=9))
        )
        with pytest.raises(UnverifiedCertification, match="lock changed"):
            _route_check(stage, theirs)
        # without a verifier the route takes the worker's word (what dgr_session does alone)
        validate_route(
            Route([_stage(attrs.evolve(advert, lane=lies["no record"]))]),
            required_evidence=EvidenceClass.FIXTURE,
        )
    finally:
        engine.close()


def _other_record(evidence: Path, sha: str) -> Path:
    loaded = load_evidence(evidence, load_lock())
    return next(
        p for r, p in zip(loaded.records, loaded.paths, strict=True) if r.lane.model_sha256 != sha
    )


def test_a_session_never_routes_a_worker_whose_record_its_lock_does_not_vouch_for(
    tiny_llama: Path, fixture_evidence: Path, tmp_path: Path
) -> None:
    """A worker run under its own lock, which trusts a key of its operator's, certifies itself
    with a record signed by that key. Its advert says ``certified``; the client's lock (the
    repo's) does not vouch for it, so the session refuses the route before sending the worker
    anything, while a session over an honest worker beside it stays exact."""
    from dgr_engine.certification.signing import public_key_text
    from dgr_engine.client.relay import GrpcStageTransport
    from dgr_engine.options import EngineOptions
    from dgr_engine.reference import whole_model_greedy
    from dgr_engine.tooling.loopback import LoopbackRouteProvider
    from dgr_session.manager import SessionManager
    from dgr_session.policy import FailurePolicy

    honest = _honest(fixture_evidence, tiny_llama)
    rogue = Ed25519PrivateKey.generate()
    data = json.loads((Path(__file__).resolve().parents[2] / "certification/lock.json").read_text())
    data["certifiers"].append(
        {"name": "rogue", "public_key": public_key_text(rogue.public_key()), "classes": ["fixture"]}
    )
    their_lock = tmp_path / "lock.json"
    their_lock.write_text(json.dumps(data))
    theirs = attrs.evolve(honest, lock_sha256=load_lock(their_lock).sha256)
    evidence = tmp_path / "evidence"
    write_record(theirs, evidence, key=rogue)
    options = EngineOptions()  # dgr certify's defaults, the one set
    layout = [(0, honest.lane.n_layer)]
    prompt = [1, 5, 9, 2, 7, 3]
    (want,) = whole_model_greedy(tiny_llama, [prompt], 6, options)

    async def run() -> None:
        lying = LoopbackRouteProvider(
            tiny_llama,
            layout,
            options=options,
            worker_args=["--evidence", str(evidence), "--lock", str(their_lock)],
        )
        fair = LoopbackRouteProvider(
            tiny_llama, layout, options=options, worker_args=["--evidence", str(fixture_evidence)]
        )
        try:
            await lying.start()
            await fair.start()
            told = lying.workers[0].advert.lane
            assert told.certified and told.record_id == theirs.record_id  # the worker's word
            policy = FailurePolicy(step_deadline=10.0, session_deadline=30.0, backoff=(0.0,))
            async with GrpcStageTransport(timeout=10.0) as transport:
                bad = SessionManager(
                    transport, lying, policy=policy, required_evidence=EvidenceClass.FIXTURE
                )
                good = SessionManager(
                    transport, fair, policy=policy, required_evidence=EvidenceClass.FIXTURE
                )
                refused = bad.start(prompt, max_new_tokens=6)
                exact = good.start(prompt, max_new_tokens=6)
                results = await asyncio.wait_for(asyncio.gather(refused.wait(), exact.wait()), 60.0)
                await bad.aclose()
                await good.aclose()
                stats = transport.stats()
        finally:
            await lying.aclose()
            await fair.aclose()
        no, yes = results
        assert no.error is not None and not no.tokens
        assert "does not verify under the client's trust" in str(no.error), no.error
        assert "made under lock" in str(no.error), no.error
        assert lying.workers[0].endpoint not in stats  # never sent a thing
        assert yes.error is None and list(yes.tokens) == want

    asyncio.run(run())
