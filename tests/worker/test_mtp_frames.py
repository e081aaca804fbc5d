"""A worker's side of MTP drafts through a route (``docs/speculative.md``): ``dgr worker``'s
last stage of a V4 model with an MTP block loads it and says so in its advert; a frame with
``mtp_draft_max`` gets the block's drafts for the token the session goes on from (after a
verification pass: the token after the kept drafts), the drafts the engine gives after the
truncation; a last stage without the block refuses the frame, typed and with nothing changed;
an earlier stage passes the ask on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.errors import FrameRejected, UnsupportedFeature
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.options import EngineOptions
from dgr_engine.worker import ShardWorker, WorkerConfig
from tests.harness import run

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=128, n_batch=64, max_sessions=2)
PROMPT = [17, 4, 99, 230, 5, 61, 17, 4, 99, 12]


@pytest.fixture(scope="module")
def v4_mtp() -> Path:
    return ensure_fixture("tiny-v4-mtp")


def reference(path: Path, wrong: int) -> tuple[int, list[int], list[int], int, list[int]]:
    """A whole engine with the block: the prompt's greedy token and its drafts, then a pass of
    the token and ``wrong`` draft: its greedy token and the drafts after the truncation."""
    with ShardEngine(path, load_mtp=True, **OPTIONS.engine_kwargs()) as engine:
        engine.open_session(1, 0)
        n = len(PROMPT)
        token = int(np.argmax(engine.forward(1, 0, np.arange(n), tokens=PROMPT)[-1]))
        drafts = engine.mtp_draft(1, 0, token, 3)
        out = engine.forward(1, 0, [n, n + 1], tokens=[token, wrong], want=np.ones(2))
        greedy = [int(t) for t in np.argmax(out, axis=1)]
        engine.truncate(1, 0, n + 1)
        return token, drafts, greedy, greedy[0], engine.mtp_draft(1, 0, greedy[0], 3)


def test_the_last_stage_loads_the_block_and_answers_mtp_drafts(v4_mtp: Path) -> None:
    token, _, greedy, _, _ = reference(v4_mtp, wrong=0)
    wrong = next(t for t in range(1, 256) if t != greedy[0])  # a draft greedy does not keep
    token, drafts, greedy, nxt, after = reference(v4_mtp, wrong)
    assert wrong != greedy[0]
    worker = ShardWorker.load(v4_mtp, (0, -1), **OPTIONS.engine_kwargs(), config=WorkerConfig())
    assert getattr(worker.engine, "mtp_loaded", False)
    n = len(PROMPT)

    async def scenario() -> None:
        address = await worker.start()
        try:
            assert worker.advert().span.mtp
            async with ShardClient(address, timeout=20.0) as client:
                advert = await client.describe()
                assert advert.span.mtp
                expect = expectations_of(advert)
                await client.open("s", 1, expect)

                async def forward(step: int, pos: int, tokens: list[int], **kw: Any) -> Any:
                    rows = range(len(tokens)) if kw.get("drafts") else None
                    return await client.forward(
                        "s",
                        1,
                        step,
                        expect,
                        range(pos, pos + len(tokens)),
                        tokens=tokens,
                        logit_rows=rows,
                        **kw,
                    )

                out = await forward(0, 0, PROMPT, mtp_draft_max=3)
                assert out.mtp_drafts == (n, tuple(drafts))
                # a pass whose draft is wrong: the drafts follow the token after it, at n + 1
                out = await forward(1, n, [token, wrong], drafts=1, mtp_draft_max=3)
                assert [int(t) for t in np.argmax(out.output, axis=1)] == greedy
                assert out.mtp_drafts == (n + 1, tuple(after))
                out = await forward(2, n + 1, [nxt], kept_drafts=0)  # no drafts asked: none
                assert out.mtp_drafts is None and out.next_pos == n + 2
                await client.close("s", 1)
        finally:
            await worker.stop()

    run(scenario(), 60.0)


def test_a_last_stage_without_the_block_refuses_and_changes_nothing(v4_mtp: Path) -> None:
    kw = OPTIONS.engine_kwargs()
    plain = ShardWorker.load(v4_mtp, (0, -1), **kw, config=WorkerConfig(), load_mtp=False)
    first = ShardWorker.load(v4_mtp, (0, 3), **kw, config=WorkerConfig())
    assert not getattr(first.engine, "mtp_loaded", True)  # only the last stage owns it
    n = len(PROMPT)

    async def scenario() -> None:
        for worker in (plain, first):
            address = await worker.start()
            try:
                assert not worker.advert().span.mtp
                async with ShardClient(address, timeout=20.0) as client:
                    expect = expectations_of(await client.describe())
                    await client.open("s", 1, expect)
                    positions = range(n)
                    if worker is plain:
                        with pytest.raises(UnsupportedFeature, match="did not load"):
                            await client.forward(
                                "s", 1, 0, expect, positions, tokens=PROMPT, mtp_draft_max=2
                            )
                        with pytest.raises(FrameRejected, match="mtp_draft_max 17"):
                            await client.forward(
                                "s", 1, 0, expect, positions, tokens=PROMPT, mtp_draft_max=17
                            )
                        out = await client.forward("s", 1, 0, expect, positions, tokens=PROMPT)
                    else:  # an earlier stage of a chain passes the ask on
                        out = await client.forward(
                            "s", 1, 0, expect, positions, tokens=PROMPT, mtp_draft_max=2
                        )
                    assert out.next_pos == n and out.mtp_drafts is None
                    await client.close("s", 1)
            finally:
                await worker.stop()

    run(scenario(), 60.0)
