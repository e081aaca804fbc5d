"""A lane is equal to another only when every part is; its id is the hash of its canonical form."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs
import pytest

from dgr_engine.certification.errors import EvidenceInvalid
from dgr_engine.certification.hardware import RESULT_FLAGS, cpu_fingerprint, hardware_fingerprint
from dgr_engine.certification.lane import LaneKey
from tests.harness import EvidenceKit

LANE = EvidenceKit.lane()
OTHER_VALUE: dict[str, Any] = {
    "n_layer": 5,
    "context_per_session": 512,
    "quant_types": ("F16",),
    "batching": "co-batch",
    "family_patch_sha256": "ab" * 32,
}


def test_the_lane_id_is_the_hash_of_the_canonical_json() -> None:
    text = json.dumps(LANE.canonical(), sort_keys=True, separators=(",", ":"))
    assert LANE.lane_id == hashlib.sha256(text.encode()).hexdigest()
    # pinned: a change in the canonical form (or in a part's name) changes every lane id
    assert LANE.lane_id == PINNED_ID, LANE.lane_id
    assert EvidenceKit.lane().lane_id == LANE.lane_id  # stable: another object, same id


PINNED_ID = "e3c162aa555bc540081d4b0759ea5603d13cb8d4400c5cdd332703f4066d5fa5"


@pytest.mark.parametrize("field", [a.name for a in attrs.fields(LaneKey)])
def test_one_differing_part_is_another_lane(field: str) -> None:
    value = OTHER_VALUE.get(field, f"{getattr(LANE, field)}-other")
    other = attrs.evolve(LANE, **{field: value})
    assert other != LANE and other.lane_id != LANE.lane_id
    assert LANE.differences(other) == [field]


def test_canonical_round_trip() -> None:
    assert LaneKey.from_canonical(json.loads(json.dumps(LANE.canonical()))) == LANE
    co_batched = attrs.evolve(LANE, batching="co-batch")
    assert LaneKey.from_canonical(json.loads(json.dumps(co_batched.canonical()))) == co_batched


def test_per_session_batching_is_left_out_of_the_canonical_form() -> None:
    """Lanes recorded before co-batching existed keep their ids: ``batching`` is written only
    when it is not the per-session default."""
    assert LANE.batching == "session" and "batching" not in LANE.canonical()
    assert attrs.evolve(LANE, batching="co-batch").canonical()["batching"] == "co-batch"


def test_an_architecture_without_a_family_patch_keeps_its_lane_id() -> None:
    """Lanes recorded before family patches existed keep their ids: ``family_patch_sha256`` is
    written only when the architecture has one; with one, it is part of the lane."""
    assert LANE.family_patch_sha256 == "" and "family_patch_sha256" not in LANE.canonical()
    gemma = attrs.evolve(LANE, arch="gemma3", family_patch_sha256="cd" * 32)
    assert gemma.canonical()["family_patch_sha256"] == "cd" * 32
    assert LaneKey.from_canonical(json.loads(json.dumps(gemma.canonical()))) == gemma
    patched_again = attrs.evolve(gemma, family_patch_sha256="ef" * 32)
    assert patched_again.lane_id != gemma.lane_id
    assert gemma.differences(patched_again) == ["family_patch_sha256"]


def test_a_worker_lane_names_its_architectures_family_patch() -> None:
    """What a worker advertises: the base stack's hash for every architecture, and the family
    patch's for one that has it (from the binding)."""
    from dgr_engine._binding import PATCH_STACK_SHA256, family_patch_sha256
    from dgr_engine.worker.reporting.identity import BuildIdentity

    build = BuildIdentity._of_this_build(b"\x01" * 32, ("F32",), None)
    llama = build.lane_key(arch="llama", n_layer=4, context_per_session=256)
    gemma = build.lane_key(arch="gemma3", n_layer=4, context_per_session=256)
    assert llama.patch_stack_sha256 == gemma.patch_stack_sha256 == PATCH_STACK_SHA256.hex()
    assert llama.family_patch_sha256 == "" and "family_patch_sha256" not in llama.canonical()
    assert gemma.family_patch_sha256 == family_patch_sha256("gemma3").hex() != ""
    assert gemma.differences(attrs.evolve(llama, arch="gemma3")) == ["family_patch_sha256"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.pop("hardware"), "lane.hardware"),
        (lambda d: d.update(colour="blue"), "lane.colour"),
        (lambda d: d.update(n_layer="4"), "lane.n_layer"),
        (lambda d: d.update(n_layer=True), "lane.n_layer"),
        (lambda d: d.update(context_per_session=0), "lane.context_per_session"),
        (lambda d: d.update(quant_types="F32"), "lane.quant_types"),
        (lambda d: d.update(kv_type=None), "lane.kv_type"),
        (lambda d: d.update(batching="session"), "lane.batching"),  # only ever left out
        (lambda d: d.update(batching="sometimes"), "lane.batching"),
        (lambda d: d.update(family_patch_sha256=""), "lane.family_patch_sha256"),  # left out
        (lambda d: d.update(family_patch_sha256="AB" * 32), "lane.family_patch_sha256"),
    ],
)
def test_a_bad_canonical_lane_is_refused_naming_the_field(change: Any, field: str) -> None:
    data = LANE.canonical()
    change(data)
    with pytest.raises(EvidenceInvalid) as refused:
        LaneKey.from_canonical(data)
    assert refused.value.field == field and field in str(refused.value)


X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC   7B13 64-Core Processor
flags\t\t: fpu sse3 ssse3 avx avx2 fma f16c hypervisor aes
processor\t: 1
model name\t: Another CPU
flags\t\t: avx512f
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd asimdhp asimddp sve i8mm cpuid
CPU implementer\t: 0x41
"""


def test_cpu_fingerprints() -> None:
    assert cpu_fingerprint(X86, "x86_64") == (
        "x86_64 | AMD EPYC 7B13 64-Core Processor | avx avx2 f16c fma sse3 ssse3"
    )  # first processor only, kernel-selecting flags only, sorted, spaces squeezed
    assert cpu_fingerprint(ARM, "aarch64") == "aarch64 | ? | asimd asimddp asimdhp i8mm sve"
    assert cpu_fingerprint("", "riscv64") == "riscv64 | ? | -"
    assert "hypervisor" not in RESULT_FLAGS and "aes" not in RESULT_FLAGS


def test_this_machine_has_a_fingerprint() -> None:
    text = hardware_fingerprint()
    assert text.count(" | ") == 2 and text == hardware_fingerprint()
