"""Route validation: every violation is a typed error naming the stage."""

from __future__ import annotations

import attrs
import pytest
from loguru import logger

from dgr_session import (
    BoundaryMismatch,
    DarkLane,
    DarkLaneWarning,
    Recipe,
    Route,
    RouteIncompatible,
    RouteInvalid,
    StageSpec,
    validate_route,
)
from dgr_session.testing import fixture_identity, fixture_lane, fixture_recipe, make_route

IDENTITY = fixture_identity(6)


def good_route() -> Route:
    return make_route(["a", "b", "c"], [2, 4], identity=IDENTITY)


def with_stage(route: Route, index: int, **changes: object) -> Route:
    stages = list(route.stages)
    stages[index] = attrs.evolve(stages[index], **changes)  # type: ignore[arg-type]
    return Route(stages)


def test_valid_route_passes_and_is_returned() -> None:
    route = good_route()
    assert validate_route(route) is route
    assert route.endpoints == ("a", "b", "c")
    assert route.identity == IDENTITY
    single = make_route(["solo"], [], identity=IDENTITY)
    assert validate_route(single) is single


@pytest.mark.parametrize(
    ("index", "changes", "error", "text"),
    [
        (1, {"layer_begin": 3}, RouteInvalid, "gap"),
        (1, {"layer_begin": 1}, RouteInvalid, "overlap"),
        (2, {"layer_end": 5}, RouteInvalid, "not n_layer"),
        (2, {"layer_end": 7}, RouteInvalid, "> n_layer"),
        (1, {"identity": fixture_identity(7)}, RouteIncompatible, "serves"),
        (2, {"recipe": Recipe(("Q8_0",), 4096)}, RouteIncompatible, "runs"),
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
    ],
)
def test_each_violation_names_its_stage(
    index: int, changes: dict[str, object], error: type[RouteInvalid], text: str
) -> None:
    route = with_stage(good_route(), index, **changes)
    with pytest.raises(error, match=text) as caught:
        validate_route(route)
    assert caught.value.stage_index == index
    assert caught.value.endpoint == route.stages[index].endpoint
    assert f"stage {index} ({route.stages[index].endpoint})" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_stage_order_matters() -> None:
    route = good_route()
    swapped = Route([route.stages[1], route.stages[0], route.stages[2]])
    with pytest.raises(RouteInvalid) as caught:
        validate_route(swapped)
    assert caught.value.stage_index == 0


def test_pinned_identity_recipe_and_context_are_required_of_stage_zero_too() -> None:
    with pytest.raises(RouteIncompatible) as caught:
        validate_route(good_route(), identity=fixture_identity(6 + 1))
    assert caught.value.stage_index == 0
    with pytest.raises(RouteIncompatible):
        validate_route(good_route(), recipe=fixture_recipe(context=8))
    with pytest.raises(RouteIncompatible, match="context"):
        validate_route(good_route(), min_context=4097)
    assert validate_route(good_route(), min_context=4096)


def test_dark_lane_opt_in_is_loud() -> None:
    route = with_stage(good_route(), 2, lane=fixture_lane(certified=False))
    lines: list[str] = []
    logger.enable("dgr_session")
    sink = logger.add(lambda message: lines.append(str(message)), level="WARNING")
    try:
        with pytest.warns(DarkLaneWarning, match="stage 2"):
            assert validate_route(route, allow_dark_lanes=True) is route
    finally:
        logger.remove(sink)
        logger.disable("dgr_session")
    assert len(lines) == 1 and "DARK lane" in lines[0] and "WARNING" in lines[0]


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
