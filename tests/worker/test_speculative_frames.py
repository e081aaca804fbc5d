"""A worker's side of speculative decoding (``docs/speculative.md``): a verification pass's
frame and the frame after it, checked before anything changes.

A frame that does not match what the stage holds (kept drafts without a pass, a pass left
unanswered, more kept than drafted, rows that do not start after the kept drafts, more drafts
than rows or than the limit, a pass without every row's logits, a draft outside the vocabulary,
a pass of a stale epoch)
is refused with a typed error and the session lives on: the right frame then gives the logits
plain decoding gives, bit for bit. The usage record counts drafted and rejected rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.errors import EngineError, FrameRejected, StaleEpoch
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.wire.frames import MAX_DRAFT_ROWS
from dgr_engine.worker import ShardWorker, WorkerConfig
from tests.harness import run

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=128, n_batch=64, max_sessions=2)
PROMPT = [5, 9, 31, 2, 77, 5, 9]
N = 8


def test_bad_verification_frames_are_refused_and_change_nothing(tiny_llama: Path) -> None:
    ((greedy, logits),) = whole_model_reference(tiny_llama, [PROMPT], N, OPTIONS)
    worker = ShardWorker.load(tiny_llama, (0, 4), **OPTIONS.engine_kwargs(), config=WorkerConfig())
    n = len(PROMPT)

    async def scenario() -> list[Any]:
        address = await worker.start()
        try:
            async with ShardClient(address, timeout=20.0) as client:
                expect = expectations_of(await client.describe())
                await client.open("s", 1, expect)

                async def forward(step: int, pos: int, tokens: list[int], **kw: Any) -> Any:
                    rows = range(len(tokens))
                    wanted = kw.pop("logit_rows", rows if kw.get("drafts") else None)
                    return await client.forward(
                        "s",
                        1,
                        step,
                        expect,
                        range(pos, pos + len(tokens)),
                        tokens=tokens,
                        logit_rows=wanted,
                        **kw,
                    )

                out = await forward(0, 0, PROMPT)
                assert np.array_equal(out.output[-1], logits[0])
                with pytest.raises(FrameRejected, match="no verification pass"):
                    await forward(1, n, [greedy[0]], kept_drafts=0)
                with pytest.raises(FrameRejected, match="draft_rows"):
                    await forward(1, n, [greedy[0], 1], drafts=2)  # more drafts than rows - 1
                too_many = [greedy[0]] + [1] * (MAX_DRAFT_ROWS + 1)
                with pytest.raises(FrameRejected, match="draft_rows"):
                    await forward(1, n, too_many, drafts=MAX_DRAFT_ROWS + 1)
                with pytest.raises(FrameRejected, match="every row"):
                    await forward(1, n, [greedy[0], 1], drafts=1, logit_rows=[1])
                with pytest.raises(EngineError, match="outside the vocabulary"):
                    await forward(1, n, [greedy[0], 10**6], drafts=1)
                # a pass: the newest token, two right drafts and a wrong one
                pass_tokens = [greedy[0], greedy[1], greedy[2], (greedy[3] + 1) % 256]
                out = await forward(1, n, pass_tokens, drafts=3)
                for i in range(3):  # every row the logits plain decoding gives
                    assert np.array_equal(out.output[i], logits[1 + i])
                after = n + 3  # kept 2 drafts: the newest token, two drafts, then greedy[3]
                with pytest.raises(FrameRejected, match="must say how many it kept"):
                    await forward(4, after, [greedy[3]])
                with pytest.raises(FrameRejected, match="the verification pass held 3"):
                    await forward(4, after, [greedy[3]], kept_drafts=4)
                with pytest.raises(FrameRejected, match="continues at position"):
                    await forward(4, after + 1, [greedy[3]], kept_drafts=2)
                out = await forward(4, after, [greedy[3]], kept_drafts=2)
                assert out.next_pos == after + 1
                assert np.array_equal(out.output[-1], logits[4])
                out = await forward(5, after + 1, [greedy[4]])  # a plain frame after it
                assert np.array_equal(out.output[-1], logits[5])
                records = await client.usage("s")
                await client.open("s", 2, expect)  # a newer epoch: a pass of the old is stale
                with pytest.raises(StaleEpoch):
                    await forward(6, after + 2, [greedy[5], 1], drafts=1)
                await client.close("s", 2)
                return records
        finally:
            await worker.stop()

    (record,) = run(scenario())
    assert (record.rows_draft, record.rows_rejected) == (3, 1)
