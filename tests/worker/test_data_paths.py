"""Which data paths a worker offers, and how a chained route chooses among them
(``docs/data-paths.md``): the advert names the frame link's port; a worker told to offer none
advertises none; a transport set to ``auto`` then carries the frames over gRPC, and one that
requires the frame link fails the epoch naming the stage that does not offer it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dgr_engine import cli
from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.errors import ShardRpcError
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_session.testing import forward_call
from dgr_session.transport import Boundary, Logits
from tests import harness

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
PROMPT = [5, 9, 31, 2, 77]


def test_dgr_worker_offers_the_frame_link_unless_told_not_to() -> None:
    args = cli.parser().parse_args(["worker", "--fixture", "tiny-llama", "--layers", "0:2"])
    assert (args.frame_link_port, args.no_frame_link) == (0, False)
    args = cli.parser().parse_args(
        ["worker", "--fixture", "tiny-llama", "--layers", "0:2", "--no-frame-link"]
    )
    assert args.no_frame_link


def test_the_advert_names_the_frame_link_port_or_none(tiny_llama: Path) -> None:
    kw = OPTIONS.engine_kwargs()
    offering = ShardWorker.load(tiny_llama, (0, 2), **kw)
    silent = ShardWorker.load(tiny_llama, (2, 4), **kw, config=WorkerConfig(frame_link_port=None))

    async def scenario() -> tuple[int, int, int]:
        await offering.start()
        await silent.start()
        try:
            return (
                offering.advert().data_paths.frame_link_port,
                offering.frame_link_port,
                silent.advert().data_paths.frame_link_port,
            )
        finally:
            await offering.stop()
            await silent.stop()

    advertised, served, none = harness.run(scenario(), 60.0)
    assert advertised == served != 0
    assert none == 0


@pytest.mark.parametrize(
    ("second_offers", "data_path"),
    [(True, "auto"), (False, "auto"), (False, "frame")],
    ids=["both-offer", "fallback-to-grpc", "required-but-missing"],
)
def test_a_chained_route_takes_the_path_every_stage_offers(
    tiny_llama: Path, second_offers: bool, data_path: str
) -> None:
    """Both stages offer the frame link: the frames take it, tokens and logits those of the
    whole model. One does not: ``auto`` falls back to gRPC (the same tokens and logits), and
    ``frame`` fails the epoch's first frame, filed against the stage that does not offer
    it. (In-process workers: ``scripts/sanitize.sh`` runs this under the sanitizers.)"""
    kw = OPTIONS.engine_kwargs()
    first = ShardWorker.load(tiny_llama, (0, 2), **kw)
    port = 0 if second_offers else None
    second = ShardWorker.load(tiny_llama, (2, 4), **kw, config=WorkerConfig(frame_link_port=port))
    ((want, want_logits),) = whole_model_reference(tiny_llama, [PROMPT], 4, OPTIONS)

    async def scenario() -> None:
        addresses = [await w.start() for w in (first, second)]
        try:
            async with ChainStageTransport(timeout=10.0, data_path=data_path) as transport:
                route = await EndpointRouteProvider(addresses).assign("d", None)
                assert route is not None
                for stage in route.stages:
                    await transport.open(stage, "d", 0)
                ids, pos, tokens = list(PROMPT), 0, []
                for step in range(4):
                    call = forward_call(
                        route.stages[0], "d", 0, step, range(pos, pos + len(ids)), ids, None
                    )
                    out = await transport.forward(call)
                    assert isinstance(out, Boundary)
                    onward = forward_call(
                        route.stages[1], "d", 0, step, range(pos, pos + len(ids)), ids, out.rows
                    )
                    if not second_offers and data_path == "frame":  # raised at stage 1
                        with pytest.raises(ShardRpcError, match="offers no frame link"):
                            await transport.forward(onward)
                        break
                    logits = await transport.forward(onward)
                    assert isinstance(logits, Logits)
                    assert np.array_equal(np.asarray(logits.values), want_logits[step])
                    tokens.append(int(np.argmax(logits.values)))
                    pos, ids = pos + len(ids), [tokens[-1]]
                if data_path == "auto":
                    assert tokens == want
                    assert transport.chain_stats.frame_link_epochs == int(second_offers)
                    assert transport.chain_stats.frames == 4
                for stage in route.stages:
                    await transport.close(stage, "d", 0)
        finally:
            for w in (first, second):
                await w.stop()

    harness.run(scenario(), 90.0)
