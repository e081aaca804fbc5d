"""Value types: model identity, recipe, lane, stage, route, failure policy."""

from __future__ import annotations

import attrs
import pytest

from dgr_session import (
    CertificationStatus,
    EvidenceClass,
    FailurePolicy,
    Lane,
    ModelIdentity,
    Recipe,
    Route,
    RouteInvalid,
    StageSpec,
)
from dgr_session.testing import fixture_identity, fixture_lane, fixture_recipe


def test_bytes_fields_print_as_short_hex() -> None:
    identity = ModelIdentity(bytes(range(32)), "llama", 4)
    assert "content_hash=<000102030405…>" in repr(identity)
    assert "\\x" not in repr(identity)
    lane = Lane("cpu", "abc", b"\xab\xcd", "0.1", "x86")
    assert "patch_stack_hash=<abcd>" in repr(lane)


def test_values_are_frozen_slotted_and_compare_by_value() -> None:
    identity = fixture_identity(4)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        identity.n_layer = 5  # type: ignore[misc]
    assert not hasattr(identity, "__dict__")
    assert fixture_identity(4) == identity
    assert fixture_identity(5) != identity
    assert Recipe(["Q4_K"], 64).quant_types == ("Q4_K",)


@pytest.mark.parametrize("n_layer", [0, -1])
def test_identity_needs_layers(n_layer: int) -> None:
    with pytest.raises(ValueError, match="n_layer"):
        ModelIdentity(b"\x00", "llama", n_layer)


def test_certified_lane_needs_evidence_and_dark_is_the_default() -> None:
    with pytest.raises(ValueError, match="evidence"):
        Lane("cpu", "abc", b"", "0.1", "x86", CertificationStatus.CERTIFIED, None)
    dark = Lane("cpu", "abc", b"", "0.1", "x86")
    assert not dark.certified
    assert dark.certification is CertificationStatus.DARK
    certified = fixture_lane()
    assert certified.certified and certified.evidence is EvidenceClass.FIXTURE
    assert {e.value for e in EvidenceClass} == {"fixture", "real-model", "real-hardware", "release"}


def test_evidence_rank_is_fixture_real_model_real_hardware_release() -> None:
    ranks = {e.value: e.rank for e in EvidenceClass}
    assert ranks == {"fixture": 0, "real-model": 1, "real-hardware": 2, "release": 3}
    ordered = sorted(EvidenceClass, key=lambda e: e.rank)
    assert ordered == [
        EvidenceClass.FIXTURE,
        EvidenceClass.REAL_MODEL,
        EvidenceClass.REAL_HARDWARE,
        EvidenceClass.RELEASE,
    ]
    # each class meets its own requirement and the ones below it, none above
    for weaker, stronger in zip(ordered, ordered[1:], strict=False):
        assert stronger.satisfies(weaker) and not weaker.satisfies(stronger)
        assert weaker.satisfies(weaker)


def test_lane_ids_default_empty_and_take_part_in_equality() -> None:
    base = fixture_lane()
    assert (base.lane_id, base.record_id) == ("", "")
    assert Lane("cpu", "abc", b"", "0.1", "x86").lane_id == ""
    with_ids = attrs.evolve(base, lane_id="ab" * 32, record_id="cd" * 32)
    assert with_ids == attrs.evolve(base, lane_id="ab" * 32, record_id="cd" * 32)
    assert hash(with_ids) == hash(attrs.evolve(base, lane_id="ab" * 32, record_id="cd" * 32))
    assert with_ids != base
    assert attrs.evolve(with_ids, lane_id="ef" * 32) != with_ids
    assert attrs.evolve(with_ids, record_id="ef" * 32) != with_ids
    assert attrs.evolve(base, lane_id="ab" * 32) != attrs.evolve(base, record_id="ab" * 32)


def test_stage_layer_range_must_be_non_empty() -> None:
    kwargs = {"identity": fixture_identity(4), "recipe": fixture_recipe(), "lane": fixture_lane()}
    with pytest.raises(ValueError, match="layer_end"):
        StageSpec("a", 2, 2, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer_begin"):
        StageSpec("a", -1, 2, **kwargs)  # type: ignore[arg-type]
    assert StageSpec("a", 1, 3, **kwargs).n_layers == 2  # type: ignore[arg-type]


def test_empty_route_is_invalid() -> None:
    with pytest.raises(RouteInvalid):
        Route([])


def test_policy_defaults_are_bounded() -> None:
    policy = FailurePolicy()
    assert 0 < policy.step_deadline < policy.session_deadline < float("inf")
    assert policy.max_route_changes >= 0 and policy.max_attempts_per_step >= 1
    assert all(0 <= delay < float("inf") for delay in policy.backoff)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"step_deadline": 0},
        {"step_deadline": float("inf")},
        {"session_deadline": float("nan")},
        {"max_route_changes": -1},
        {"max_attempts_per_step": 0},
        {"backoff": (1.0, -0.5)},
        {"backoff": (float("inf"),)},
    ],
)
def test_policy_rejects_unbounded_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FailurePolicy(**kwargs)  # type: ignore[arg-type]


def test_backoff_schedule_repeats_its_last_entry() -> None:
    policy = FailurePolicy(backoff=(0.0, 0.5, 2.0))
    assert [policy.backoff_after(n) for n in range(0, 6)] == [0.0, 0.0, 0.5, 2.0, 2.0, 2.0]
    assert FailurePolicy(backoff=()).backoff_after(3) == 0.0
