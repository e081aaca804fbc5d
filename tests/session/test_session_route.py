"""Route validation: every violation is a typed error naming the stage."""

from __future__ import annotations

import itertools

import attrs
import pytest

from dgr_session import (
    BoundaryMismatch,
    CertificationStatus,
    DarkLane,
    EvidenceClass,
    InsufficientEvidence,
    Lane,
    LaneDifference,
    ModelIdentity,
    NearestRecord,
    Recipe,
    Route,
    RouteIncompatible,
    RouteInvalid,
    StageSpec,
    validate_route,
)
from dgr_session.testing import fixture_identity, fixture_lane, fixture_recipe, make_route

IDENTITY = fixture_identity(6)
#: The evidence classes, weakest first, spelled out here rather than taken from the enum.
ORDER = ("fixture", "real-model", "real-hardware", "release")


def good_route() -> Route:
    """Three stages on fixture lanes (certified with fixture evidence)."""
    return make_route(["a", "b", "c"], [2, 4], identity=IDENTITY)


def check(
    route: Route,
    *,
    identity: ModelIdentity | None = None,
    recipe: Recipe | None = None,
    min_context: int = 0,
) -> Route:
    """``validate_route`` for routes on fixture lanes: fixture evidence is all it requires."""
    return validate_route(
        route,
        identity=identity,
        recipe=recipe,
        min_context=min_context,
        required_evidence=EvidenceClass.FIXTURE,
    )


def lane(evidence: EvidenceClass | None) -> Lane:
    """The fixture lane's build and hardware, certified with ``evidence`` (dark when None)."""
    dark = evidence is None
    return attrs.evolve(
        fixture_lane(),
        certification=CertificationStatus.DARK if dark else CertificationStatus.CERTIFIED,
        evidence=evidence,
        lane_id="1a2b3c4d5e6f" * 4,
        record_id="" if dark else "9f8e7d6c5b4a" * 4,
    )


def on_lanes(*evidence: EvidenceClass | None) -> Route:
    """``good_route`` with stage i on a lane certified with ``evidence[i]``."""
    return Route(
        attrs.evolve(stage, lane=lane(e))
        for stage, e in zip(good_route().stages, evidence, strict=True)
    )


def with_stage(route: Route, index: int, **changes: object) -> Route:
    stages = list(route.stages)
    stages[index] = attrs.evolve(stages[index], **changes)  # type: ignore[arg-type]
    return Route(stages)


def test_valid_route_passes_and_is_returned() -> None:
    route = good_route()
    assert check(route) is route
    assert route.endpoints == ("a", "b", "c")
    assert route.identity == IDENTITY
    single = make_route(["solo"], [], identity=IDENTITY)
    assert check(single) is single


@pytest.mark.parametrize(
    ("index", "changes", "error", "text"),
    [
        (1, {"layer_begin": 3}, RouteInvalid, "gap"),
        (1, {"layer_begin": 1}, RouteInvalid, "overlap"),
        (2, {"layer_end": 5}, RouteInvalid, "not n_layer"),
        (2, {"layer_end": 7}, RouteInvalid, "> n_layer"),
        (1, {"identity": fixture_identity(7)}, RouteIncompatible, "serves"),
        (2, {"recipe": Recipe(("Q8_0",), 4096)}, RouteIncompatible, "runs"),
        (1, {"recipe": attrs.evolve(fixture_recipe(), kv_type="f16")}, RouteIncompatible, "kv_"),
        (
            2,
            {"recipe": attrs.evolve(fixture_recipe(), flash_attn="off")},
            RouteIncompatible,
            "flash_attn='off'",
        ),
        (1, {"boundary_in": 8}, BoundaryMismatch, "takes width 8"),
        (0, {"boundary_in": 16}, BoundaryMismatch, "token IDs"),
        (2, {"boundary_out": 16}, BoundaryMismatch, "logits"),
        (1, {"lane": fixture_lane(certified=False)}, DarkLane, "dark"),
        (
            2,
            {"lane": attrs.evolve(fixture_lane(), llama_cpp_commit="1" * 40)},
            RouteIncompatible,
            "runs llama.cpp 111111111111",
        ),
        (
            1,
            {"lane": attrs.evolve(fixture_lane(), patch_stack_hash=b"\x01" * 8)},
            RouteIncompatible,
            "patches 010101",
        ),
        (
            1,
            {"lane": attrs.evolve(fixture_lane(), patch_stack_hash=b"")},
            RouteIncompatible,
            "unknown",
        ),
        (
            2,
            {"lane": attrs.evolve(fixture_lane(), family_patch_hash=b"\x03" * 32)},
            RouteIncompatible,
            "family patch 030303030303, stage 0 runs none",
        ),
    ],
)
def test_each_violation_names_its_stage(
    index: int, changes: dict[str, object], error: type[RouteInvalid], text: str
) -> None:
    route = with_stage(good_route(), index, **changes)
    with pytest.raises(error, match=text) as caught:
        check(route)
    assert caught.value.stage_index == index
    assert caught.value.endpoint == route.stages[index].endpoint
    assert f"stage {index} ({route.stages[index].endpoint})" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_stage_order_matters() -> None:
    route = good_route()
    swapped = Route([route.stages[1], route.stages[0], route.stages[2]])
    with pytest.raises(RouteInvalid) as caught:
        check(swapped)
    assert caught.value.stage_index == 0


def test_pinned_identity_recipe_and_context_are_required_of_stage_zero_too() -> None:
    with pytest.raises(RouteIncompatible) as caught:
        check(good_route(), identity=fixture_identity(6 + 1))
    assert caught.value.stage_index == 0
    with pytest.raises(RouteIncompatible):
        check(good_route(), recipe=fixture_recipe(context=8))
    with pytest.raises(RouteIncompatible, match="context"):
        check(good_route(), min_context=4097)
    assert check(good_route(), min_context=4096)


def test_evidence_classes_are_ordered_and_the_refusal_is_a_dark_lane() -> None:
    assert [e.value for e in sorted(EvidenceClass, key=lambda e: e.rank)] == list(ORDER)
    assert issubclass(InsufficientEvidence, DarkLane) and issubclass(DarkLane, RouteInvalid)


@pytest.mark.parametrize(("have", "need"), list(itertools.product(ORDER, repeat=2)))
def test_satisfies_is_exactly_the_rank_order(have: str, need: str) -> None:
    assert EvidenceClass(have).satisfies(EvidenceClass(need)) is (
        ORDER.index(have) >= ORDER.index(need)
    )


@pytest.mark.parametrize("required", list(EvidenceClass))
@pytest.mark.parametrize("index", [0, 2])
def test_dark_lane_is_refused_whatever_the_required_class(
    index: int, required: EvidenceClass
) -> None:
    evidence: list[EvidenceClass | None] = [EvidenceClass.RELEASE] * 3
    evidence[index] = None
    route = on_lanes(*evidence)
    assert validate_route(on_lanes(*[EvidenceClass.RELEASE] * 3), required_evidence=required)
    with pytest.raises(DarkLane, match="is dark") as caught:
        validate_route(route, required_evidence=required)
    assert type(caught.value) is DarkLane  # not a matter of evidence: no record at all
    assert caught.value.stage_index == index
    assert caught.value.endpoint == route.stages[index].endpoint
    assert f"stage {index} ({route.stages[index].endpoint})" in str(caught.value)


@pytest.mark.parametrize(
    "required", [EvidenceClass.REAL_MODEL, EvidenceClass.REAL_HARDWARE, EvidenceClass.RELEASE]
)
def test_fixture_lane_is_refused_when_more_is_required(required: EvidenceClass) -> None:
    # stages 0 and 2 hold release records: stage 1 is the first (and only) one short
    route = on_lanes(EvidenceClass.RELEASE, EvidenceClass.FIXTURE, EvidenceClass.RELEASE)
    with pytest.raises(InsufficientEvidence) as caught:
        validate_route(route, required_evidence=required)
    error = caught.value
    assert (error.stage_index, error.endpoint) == (1, "b")
    message = str(error)
    assert message.startswith("stage 1 (b) layers [2,4): ")
    assert "fixture" in message and required.value in message
    assert "1a2b3c4d5e6f" in message and "9f8e7d6c5b4a" in message  # names lane and record
    assert validate_route(route, required_evidence=EvidenceClass.FIXTURE) is route


def test_by_default_real_hardware_is_required_so_fixture_lanes_are_refused() -> None:
    with pytest.raises(InsufficientEvidence, match="real-hardware") as caught:
        validate_route(good_route())
    assert (caught.value.stage_index, caught.value.endpoint) == (0, "a")
    assert "fixture" in str(caught.value)
    with pytest.raises(InsufficientEvidence, match="real-model"):
        validate_route(on_lanes(*[EvidenceClass.REAL_MODEL] * 3))
    hardware = on_lanes(*[EvidenceClass.REAL_HARDWARE] * 3)
    assert validate_route(hardware) is hardware


@pytest.mark.parametrize(
    ("required", "passes"),
    [
        (EvidenceClass.FIXTURE, True),
        (EvidenceClass.REAL_MODEL, True),
        (EvidenceClass.REAL_HARDWARE, True),
        (EvidenceClass.RELEASE, False),
    ],
)
def test_real_hardware_lanes_route_up_to_real_hardware(
    required: EvidenceClass, passes: bool
) -> None:
    route = on_lanes(*[EvidenceClass.REAL_HARDWARE] * 3)
    if passes:
        assert validate_route(route, required_evidence=required) is route
        return
    with pytest.raises(InsufficientEvidence) as caught:
        validate_route(route, required_evidence=required)
    assert (caught.value.stage_index, caught.value.endpoint) == (0, "a")
    assert "real-hardware evidence" in str(caught.value) and "requires release" in str(caught.value)


def test_stage_spec_keeps_what_it_was_given() -> None:
    stage = StageSpec(
        "host:1", 0, 3, IDENTITY, fixture_recipe(), fixture_lane(), boundary_in=0, boundary_out=16
    )
    assert (stage.endpoint, stage.layer_begin, stage.layer_end, stage.n_layers) == (
        "host:1",
        0,
        3,
        3,
    )


# --- a refusal says why: the parts that differ, the command that certifies -------------------

CTX_512 = LaneDifference("context_per_session", "512", "256")
COMMAND = "dgr certify --model smollm2-135m-instruct --ctx 512"
HARDWARE = on_lanes(*[EvidenceClass.REAL_HARDWARE] * 3)


def advised(evidence: EvidenceClass | None, *nearest: NearestRecord, command: str = "") -> Lane:
    """:func:`lane` with the advice a worker's advert adds."""
    return attrs.evolve(lane(evidence), nearest=nearest, certify_command=command)


def test_a_dark_lanes_refusal_names_the_stage_the_differing_parts_and_the_certify_command() -> None:
    near = NearestRecord("dc7ccceca48b" + "0" * 52, EvidenceClass.REAL_HARDWARE, [CTX_512])
    route = with_stage(HARDWARE, 1, lane=advised(None, near, command=COMMAND))
    with pytest.raises(DarkLane) as caught:
        validate_route(route)
    error = caught.value
    assert type(error) is DarkLane
    assert (error.stage_index, error.endpoint, error.layers) == (1, "b", (2, 4))
    assert error.nearest == near and error.certify_command == COMMAND
    message = str(error)
    assert message.startswith("stage 1 (b) layers [2,4): lane 1a2b3c4d5e6f")
    assert "nearest real-hardware record dc7ccceca48b differs in" in message
    assert "context_per_session 512 (nearest record: 256)" in message
    assert f"run on the worker's machine: {COMMAND} (then restart the worker)" in message
    assert "\n" not in message


def test_the_nearest_record_named_is_one_of_the_required_class() -> None:
    fixture = NearestRecord("f" * 64, EvidenceClass.FIXTURE, [])
    hardware = NearestRecord("e" * 64, EvidenceClass.REAL_HARDWARE, [CTX_512, CTX_512])
    route = with_stage(good_route(), 0, lane=advised(None, fixture, hardware, command=COMMAND))
    with pytest.raises(DarkLane) as caught:
        validate_route(route, required_evidence=EvidenceClass.REAL_MODEL)
    assert caught.value.nearest == hardware  # the fixture record would not route this session
    with pytest.raises(DarkLane) as caught:
        validate_route(route, required_evidence=EvidenceClass.FIXTURE)
    assert caught.value.nearest == fixture  # the nearest that would
    with pytest.raises(DarkLane) as caught:
        validate_route(route, required_evidence=EvidenceClass.RELEASE)
    assert caught.value.nearest is None
    assert "the worker has no release record of any lane" in str(caught.value)
    assert COMMAND in str(caught.value)


def test_a_lane_certified_below_the_requirement_is_not_told_to_certify_again() -> None:
    near = NearestRecord("e" * 64, EvidenceClass.REAL_HARDWARE, [CTX_512])
    route = with_stage(HARDWARE, 2, lane=advised(EvidenceClass.FIXTURE, near, command=COMMAND))
    with pytest.raises(InsufficientEvidence) as caught:
        validate_route(route, required_evidence=EvidenceClass.REAL_HARDWARE)
    message = str(caught.value)
    assert "context_per_session 512 (nearest record: 256)" in message
    assert "dgr certify" not in message  # it would make fixture evidence again


def test_a_worker_that_gives_no_advice_is_refused_as_before() -> None:
    route = with_stage(good_route(), 1, lane=fixture_lane(certified=False))
    with pytest.raises(DarkLane, match="is dark: no certification record matches it$") as caught:
        check(route)
    assert caught.value.nearest is None and caught.value.certify_command == ""


def test_advice_is_not_part_of_a_lanes_equality() -> None:
    near = NearestRecord("e" * 64, EvidenceClass.REAL_HARDWARE, [CTX_512])
    assert advised(None, near, command=COMMAND) == lane(None)


def test_a_context_too_small_says_what_to_change_and_not_to_certify() -> None:
    with pytest.raises(RouteIncompatible) as caught:
        check(good_route(), min_context=4097)
    message = str(caught.value)
    assert "context 4096 < 4097 positions needed" in message
    assert "bigger --ctx" in message and "shorter prompt" in message
    assert "dgr certify" not in message and not isinstance(caught.value, DarkLane)
