"""A worker is certified only by a record of exactly its lane; anything else leaves it dark.

The records are those ``dgr certify`` made in this test run (``fixture_evidence``); the
workers are in-process ``ShardWorker`` objects over the real engine (no serving needed: the
advert is computed from the lane lookup done at construction).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest

from dgr_engine import ShardEngine
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import load_evidence
from dgr_engine.numerics import Numerics
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.identity import BuildIdentity
from dgr_session.identity import CertificationStatus, EvidenceClass

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
