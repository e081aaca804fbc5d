"""The capability advert: proto round trip, route building, and what it is computed from."""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dgr_engine.wire.advert import (
    Advert,
    Capacity,
    DataPaths,
    Health,
    LayerSpan,
    Load,
    SeamCost,
    advert_from_proto,
    advert_to_proto,
)
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker.reporting import identity as ident
from dgr_engine.worker.reporting.load import LoadMeter
from dgr_session.errors import DarkLane, InsufficientEvidence
from dgr_session.identity import (
    CertificationStatus,
    EvidenceClass,
    Lane,
    LaneDifference,
    ModelIdentity,
    NearestRecord,
    Recipe,
)
from dgr_session.route import Route, validate_route

HASH = hashlib.sha256(b"model").digest()


def advert(begin: int, end: int, n_layer: int = 4, width: int = 64, **lane_kw: object) -> Advert:
    is_first, is_last = begin == 0, end == n_layer
    lane_args: dict[str, object] = {
        "backend": "cpu",
        "llama_cpp_commit": "abc",
        "patch_stack_hash": b"\x01" * 32,
        "dgr_version": "0.1.0",
        "hardware": "x86_64",
        "certification": CertificationStatus.DARK,
        "evidence": None,
        "lane_id": "ab" * 32,
    }
    lane_args.update(lane_kw)
    return Advert(
        identity=ModelIdentity(content_hash=HASH, arch="llama", n_layer=n_layer),
        recipe=Recipe(quant_types=("F32",), context=256),
        lane=Lane(**lane_args),  # type: ignore[arg-type]
        schema_version=1,
        span=LayerSpan(begin, end, is_first, is_last, is_first),
        capacity=Capacity(
            4, 1, 900, 256, 64, 600.0, sessions_waiting=2, admission_wait_seconds=5.0
        ),
        load=Load(1, 0, 12.5, 10.0),
        seam=SeamCost("f32", 0 if is_first else width, 256 if is_last else width, 8, 256),
        health=Health(3.5, 1, 2, 10.0),
    )


@given(
    begin=st.integers(0, 40),
    n=st.integers(1, 3),
    free=st.integers(0, 2**63),
    rps=st.floats(0, 1e9),
    sha=st.one_of(st.none(), st.text("0123456789abcdef", min_size=40, max_size=40)),
    evidence=st.sampled_from(list(EvidenceClass)),
    certified=st.booleans(),
    family=st.sampled_from([b"", b"\x02" * 32]),
    frame_link_port=st.integers(0, 65535),
)
def test_advert_round_trips(
    begin: int,
    n: int,
    free: int,
    rps: float,
    sha: str | None,
    evidence: EvidenceClass,
    certified: bool,
    family: bytes,
    frame_link_port: int,
) -> None:
    status = CertificationStatus.CERTIFIED if certified else CertificationStatus.DARK
    a = advert(
        begin,
        begin + n,
        n_layer=43,
        certification=status,
        evidence=evidence if certified else None,  # a dark lane names no evidence
        record_id="ef" * 32 if certified else "",
        family_patch_hash=family,  # a family patch's architecture, or none
    )
    a = attrs.evolve(
        a,
        identity=attrs.evolve(a.identity, official_target_sha=sha),
        capacity=attrs.evolve(a.capacity, kv_tokens_free=free),
        load=attrs.evolve(a.load, rows_per_second=rps),
        data_paths=DataPaths(frame_link_port=frame_link_port),  # 0: none offered
    )
    wire = pb.Advert.FromString(advert_to_proto(a).SerializeToString())
    assert advert_from_proto(wire) == a


def test_unspecified_lane_status_reads_dark_and_bad_dtypes_are_refused() -> None:
    msg = advert_to_proto(advert(0, 4))
    msg.certification.status = pb.LANE_STATUS_UNSPECIFIED
    assert advert_from_proto(msg).lane.certification is CertificationStatus.DARK
    msg.seam.dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(ValueError):
        advert_from_proto(msg)


def test_adverts_build_a_route_that_validates() -> None:
    stages = [advert(0, 1), advert(1, 3), advert(3, 4)]
    route = Route([a.stage_spec(f"127.0.0.1:{5000 + i}") for i, a in enumerate(stages)])
    assert [s.boundary_in for s in route.stages] == [0, 64, 64]
    assert [s.boundary_out for s in route.stages] == [64, 64, 0]
    for required in EvidenceClass:  # a dark lane is never routable, whatever is required
        with pytest.raises(DarkLane, match="is dark"):
            validate_route(route, required_evidence=required)
    stages = [
        advert(
            a,
            b,
            certification=CertificationStatus.CERTIFIED,
            evidence=EvidenceClass.FIXTURE,
            record_id="cd" * 32,
        )
        for a, b in ((0, 1), (1, 3), (3, 4))
    ]
    route = Route([a.stage_spec(f"127.0.0.1:{5000 + i}") for i, a in enumerate(stages)])
    assert validate_route(route, required_evidence=EvidenceClass.FIXTURE) is route
    with pytest.raises(InsufficientEvidence, match="requires real-hardware") as refused:
        validate_route(route)  # the default is real-hardware
    assert refused.value.stage_index == 0 and refused.value.endpoint == "127.0.0.1:5000"


def test_a_certified_lane_round_trips_with_its_record() -> None:
    a = advert(
        0,
        4,
        certification=CertificationStatus.CERTIFIED,
        evidence=EvidenceClass.FIXTURE,
        record_id="cd" * 32,
    )
    back = advert_from_proto(pb.Advert.FromString(advert_to_proto(a).SerializeToString()))
    assert back == a
    assert (back.lane.lane_id, back.lane.record_id) == ("ab" * 32, "cd" * 32)


# --- what the advert is computed from ----------------------------------------------------------


def test_file_sha256_streams_the_whole_file(tiny_llama: Path) -> None:
    assert ident.file_sha256(tiny_llama) == hashlib.sha256(tiny_llama.read_bytes()).digest()


def test_tensor_types_come_from_the_gguf(tiny_llama: Path) -> None:
    assert ident.gguf_tensor_types(tiny_llama) == ("F32",)


def test_the_dgr_version_is_known() -> None:
    assert ident.dgr_version() != "0+unknown"


def test_load_meter_windows() -> None:
    now = [100.0]
    meter = LoadMeter(window_seconds=10.0, clock=lambda: now[0])
    meter.admitted()
    meter.admitted()
    meter.started()
    snap = meter.snapshot()
    assert (snap.in_flight, snap.queued) == (2, 1)
    meter.stopped()
    meter.finished(20)
    meter.finished(0)
    meter.error()
    now[0] = 105.0
    snap = meter.snapshot()
    assert (snap.in_flight, snap.queued, snap.recent_errors, snap.total_errors) == (0, 0, 1, 1)
    assert snap.rows_per_second == pytest.approx(20 / 5.0)
    now[0] = 120.0
    snap = meter.snapshot()
    assert (snap.rows_per_second, snap.recent_errors, snap.total_errors) == (0.0, 0, 1)
    assert snap.uptime_seconds == pytest.approx(20.0)


def test_model_sha256_is_cached_by_path_size_and_mtime(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_llama.read_bytes())
    cache = tmp_path / "cache"
    want = hashlib.sha256(model.read_bytes()).digest()
    assert ident.model_sha256(model, cache) == want
    (entry,) = (cache / "model-sha256").iterdir()
    entry.write_text("ab" * 32)  # a cache hit is not re-hashed...
    assert ident.model_sha256(model, cache) == bytes.fromhex("ab" * 32)
    with model.open("ab") as f:  # ...a changed file (size, mtime) is
        f.write(b"\0")
    assert ident.model_sha256(model, cache) == hashlib.sha256(model.read_bytes()).digest()


def test_free_slots_count_the_admission_line() -> None:
    assert Capacity(4, 1, 900, 256, 64).sessions_free == 3
    assert Capacity(4, 4, 0, 256, 64, sessions_waiting=2).sessions_free == 0
    assert Capacity(4, 3, 0, 256, 64, sessions_waiting=1).sessions_free == 0


# --- advice: why a lane is dark -----------------------------------------------------------------


def test_a_dark_lanes_advice_round_trips() -> None:
    near = NearestRecord(
        "71" * 32,
        EvidenceClass.REAL_HARDWARE,
        [
            LaneDifference("context_per_session", "512", "256"),
            LaneDifference("kv_type", "f32", "f16"),
        ],
    )
    a = advert(0, 4, nearest=(near,), certify_command="dgr certify --model m.gguf --ctx 512")
    back = advert_from_proto(pb.Advert.FromString(advert_to_proto(a).SerializeToString()))
    assert back.lane.nearest == (near,)
    assert back.lane.certify_command == "dgr certify --model m.gguf --ctx 512"


def test_an_advert_without_advice_reads_as_none() -> None:
    """What a worker older than the fields sends."""
    back = advert_from_proto(advert_to_proto(advert(0, 4)))
    assert back.lane.nearest == () and back.lane.certify_command == ""


def test_advice_off_the_wire_is_bounded_and_printable() -> None:
    msg = advert_to_proto(advert(0, 4))
    msg.certification.certify_command = "dgr certify\n\x1b[2Jrm -rf" + "x" * 5000
    for evidence in (pb.EVIDENCE_CLASS_UNSPECIFIED, 77, *[pb.EVIDENCE_CLASS_FIXTURE] * 20):
        near = msg.certification.nearest.add(record_id="r\r\n", evidence=evidence)
        for _ in range(100):
            near.differences.add(part="ctx\x07", value="5" * 5000, recorded="256")
    lane = advert_from_proto(msg).lane
    assert lane.certify_command.startswith("dgr certify??[2Jrm -rf")
    assert len(lane.certify_command) == 2048
    assert len(lane.nearest) == 6  # the first 8 entries, less the 2 of no known class
    assert all(n.evidence is EvidenceClass.FIXTURE for n in lane.nearest)
    first = lane.nearest[0]
    assert first.record_id == "r??" and len(first.differences) == 32
    assert first.differences[0].part == "ctx?" and len(first.differences[0].value) == 512
    assert "\n" not in str(first.differences[0])
