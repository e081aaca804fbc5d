"""One set of engine defaults: a worker started by hand with them runs the lane that the
committed real-hardware record of SmolLM2 certifies, and ``dgr worker``, ``dgr certify`` and
``EngineOptions`` agree on them."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from loguru import logger

from dgr_engine import cli
from dgr_engine.certification.hardware import hardware_fingerprint
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import EvidenceRecord, RecordKind, load_evidence
from dgr_engine.cli.worker import certify_command
from dgr_engine.engine import ShardEngine
from dgr_engine.models.catalog import lookup
from dgr_engine.options import EngineOptions
from dgr_engine.worker.config import WorkerConfig
from dgr_engine.worker.lifecycle.sessions import TableSnapshot
from dgr_engine.worker.reporting.advertiser import Advertiser
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_engine.worker.reporting.load import LoadSnapshot
from dgr_session.errors import DarkLane
from dgr_session.identity import (
    CertificationStatus,
    EvidenceClass,
    LaneDifference,
    ModelIdentity,
    Recipe,
)
from dgr_session.route import Route, StageSpec, validate_route

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "evidence"
"""The committed records (the tests' own evidence directory is another, empty one)."""
SMOLLM2 = "smollm2-135m-instruct"


def _unused_sessions() -> TableSnapshot:
    raise AssertionError("the lane needs no live counts")


def _unused_load() -> LoadSnapshot:
    raise AssertionError("the lane needs no live counts")


def test_dgr_worker_dgr_certify_and_engine_options_share_one_set_of_defaults() -> None:
    defaults = EngineOptions()
    assert (defaults.n_threads, defaults.n_ctx_per_session) == (1, 256)
    assert (defaults.n_batch, defaults.max_sessions) == (64, 8)
    route = ["--spawn", "3", "--model", "m.gguf"]
    for argv in (
        ["worker", "--model", "m.gguf", "--layers", "0:10"],
        ["certify", "--model", "m.gguf"],
        ["generate", *route],
        ["chat", *route],
        ["serve", *route],
    ):
        assert EngineOptions.from_args(cli.parser().parse_args(argv)) == defaults, argv[0]


def committed_smollm2_records() -> list[EvidenceRecord]:
    """The committed real-hardware certification records of SmolLM2."""
    (gguf,) = lookup(SMOLLM2).manifest().files
    loaded = load_evidence(COMMITTED, load_lock())
    records = [
        r
        for r in loaded.records
        if r.kind is RecordKind.CERTIFICATION
        and r.evidence_class is EvidenceClass.REAL_HARDWARE
        and r.lane.model_sha256 == gguf.sha256
    ]
    assert records, f"no committed certification record of {SMOLLM2}: {loaded.refused}"
    return records


def smollm2_worker(tiny_llama: Path, argv: list[str]) -> Advertiser:
    """The advertiser of ``dgr worker --model smollm2-135m-instruct --layers 0:10 ARGV`` with
    the committed records, made as ``ShardWorker`` makes it (the build with the engine's
    numerics, ``lane_key`` of the engine's own info) without loading SmolLM2: its content hash
    and tensor types are those of the catalog's manifest (what ``dgr models fetch`` verifies
    the file against), its shape is the manifest's, and the context per session is what an
    engine made with these options really provides. The machine is one of the committed
    records' hardware class (the class is a fact of the machine, not a default: on any other
    machine the lane differs in ``hardware`` alone, which ``test_hardware_is_the_one_part_...``
    shows), so that the test means the same on every machine."""
    args = cli.parser().parse_args(["worker", "--model", SMOLLM2, "--layers", "0:10", *argv])
    options = EngineOptions.from_args(args)
    smol = lookup(SMOLLM2).manifest()
    (gguf,) = smol.files
    (hardware,) = {r.lane.hardware for r in committed_smollm2_records()}
    build = attrs.evolve(
        BuildIdentity.of_model(tiny_llama),  # this build (the binding's half)
        model_sha256=bytes.fromhex(gguf.sha256),
        quant_types=smol.quant_types,
        fixture_mark=None,
        hardware=hardware,
    ).with_numerics(options.numerics)
    with ShardEngine(tiny_llama, layers=(0, 1), **options.engine_kwargs()) as probe:
        engine_info = probe.info
    info = attrs.evolve(engine_info, arch=smol.arch, n_layer=smol.n_layer, layer_end=10)
    # the repository's lock, and the command dgr worker advertises
    config = WorkerConfig(evidence_dir=COMMITTED, certify_command=certify_command(args))
    return Advertiser(
        build,
        info,
        config,
        logger,
        sessions=_unused_sessions,
        load=_unused_load,
        waiting=lambda: 0,
    )


def test_a_worker_started_with_default_options_on_smollm2_is_certified_by_the_committed_record(
    tiny_llama: Path,
) -> None:
    advertiser = smollm2_worker(tiny_llama, [])
    records = committed_smollm2_records()
    assert {r.lane for r in records} == {advertiser.lane_key}, [
        advertiser.lane_key.differences(r.lane) for r in records
    ]
    lane = advertiser.lane()
    assert lane.certification is CertificationStatus.CERTIFIED, advertiser.lane_lookup.reasons
    assert lane.evidence is EvidenceClass.REAL_HARDWARE


def test_a_worker_started_with_another_context_is_refused_naming_the_context_and_the_command(
    tiny_llama: Path,
) -> None:
    """The lane is dark; its advert says the committed record differs in the context only and
    how to certify the lane, and a client's refusal says both, naming the stage."""
    advertiser = smollm2_worker(tiny_llama, ["--ctx", "512"])
    lane = advertiser.lane()
    assert lane.certification is CertificationStatus.DARK
    near = lane.nearest_at(EvidenceClass.REAL_HARDWARE)
    assert near is not None
    assert near.differences == (LaneDifference("context_per_session", "512", "256"),)
    assert lane.certify_command == f"dgr certify --model {SMOLLM2} --ctx 512"
    smol = lookup(SMOLLM2).manifest()
    stage = StageSpec(
        "127.0.0.1:40123",
        0,
        smol.n_layer,
        ModelIdentity(bytes.fromhex(smol.files[0].sha256), smol.arch, smol.n_layer),
        Recipe(smol.quant_types, 512),
        lane,
    )
    with pytest.raises(DarkLane) as caught:
        validate_route(Route([stage]))
    message = str(caught.value)
    assert message.startswith("stage 0 (127.0.0.1:40123) layers [0,30): lane ")
    assert f"record {near.record_id[:12]} differs in context_per_session 512 (nearest" in message
    assert f"dgr certify --model {SMOLLM2} --ctx 512 (then restart the worker)" in message


def test_hardware_is_the_one_part_of_the_lane_that_another_machine_changes(
    tiny_llama: Path,
) -> None:
    """The same worker on this machine: its lane is the committed records' where this machine
    is of their hardware class, and differs from it in ``hardware`` alone elsewhere."""
    advertiser = smollm2_worker(tiny_llama, [])
    here = attrs.evolve(advertiser.lane_key, hardware=hardware_fingerprint())
    (recorded,) = {r.lane for r in committed_smollm2_records()}
    assert here.differences(recorded) == (
        [] if recorded.hardware == hardware_fingerprint() else ["hardware"]
    )
