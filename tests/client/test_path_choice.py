"""The default route mode and data path (``client/path_choice.py``): a ring over the fastest
path every stage offers, a relay where a TLS route cannot chain, what was asked otherwise, and
one line that says which and why."""

from __future__ import annotations

import pytest

from dgr_engine.client.path_choice import StageOffer, choose_path
from dgr_engine.client.route_modes import DataPath, RouteMode
from dgr_engine.wire.advert import DataPaths, Security

NATIVE = DataPaths(frame_link_port=2, native_link_port=3)
SEALED = DataPaths(frame_link_port=2, native_link_port=3, native_link_sealed=True)
FRAME = DataPaths(frame_link_port=2)
GRPC = DataPaths()
TLS = Security(tls=True, client_certificates=True, chain_tls=True)
TLS_NO_CHAIN = Security(tls=True, client_certificates=True)


@pytest.mark.parametrize(
    ("offers", "tls", "mode", "path", "says"),
    [
        ([NATIVE, NATIVE], False, "ring", "native", "every stage offers native links"),
        ([NATIVE, FRAME], False, "ring", "frame", "every stage offers frame links"),
        ([FRAME, GRPC], False, "ring", "grpc", "not every stage offers a faster path"),
        ([NATIVE, NATIVE], True, "ring", "frame", "every stage offers frame links"),  # unsealed
    ],
)
def test_auto_is_a_ring_over_the_fastest_path_every_stage_offers(
    offers: list[DataPaths], tls: bool, mode: str, path: str, says: str
) -> None:
    choice = choose_path(RouteMode.AUTO, DataPath.AUTO, [StageOffer(o) for o in offers], tls=tls)
    assert (choice.mode, choice.path) == (mode, path)
    assert says in choice.why and choice.line().startswith(f"{mode} over ")


def test_sealed_native_links_over_tls_and_a_route_that_cannot_chain_over_tls() -> None:
    sealed = [StageOffer(SEALED, TLS), StageOffer(SEALED, TLS)]
    choice = choose_path(RouteMode.AUTO, DataPath.AUTO, sealed, tls=True)
    assert (choice.mode, choice.path) == ("ring", "native")
    stuck = [StageOffer(SEALED, TLS), StageOffer(SEALED, TLS_NO_CHAIN)]
    choice = choose_path(RouteMode.AUTO, DataPath.AUTO, stuck, tls=True)
    assert (choice.mode, choice.path) == ("relay", "grpc")
    assert "--chain-tls-*" in choice.line() and choice.line().startswith("relay: ")


def test_what_was_asked_is_kept() -> None:
    stages = [StageOffer(NATIVE), StageOffer(NATIVE)]
    assert choose_path(RouteMode.RELAY, DataPath.AUTO, stages, tls=False).mode == "relay"
    chain = choose_path(RouteMode.CHAIN, DataPath.AUTO, stages, tls=False)
    assert (chain.mode, chain.path) == ("chain", "frame")  # native links carry rings only
    given = choose_path(RouteMode.AUTO, DataPath.GRPC, stages, tls=False)
    assert (given.mode, given.path) == ("ring", "grpc") and "--data-path grpc" in given.why
