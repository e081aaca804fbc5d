"""A last stage asked for greedy tokens (``ForwardRequest.greedy_tokens``, ``docs/wire.md``)
answers the greedy token of each wanted row instead of its logits: for two sessions fed the
same frames, one asking for logits and one for greedy tokens, the tokens are the argmax of
the logits (``dgr_session.sampling.greedy``'s choice) on every kind of frame (a prefill wanting
every row, a decode step, a verification pass and the frame after it), and the greedy replies
carry no logits bytes. Asking for greedy tokens and no logits at once is refused and changes
nothing; a middle stage ignores the flag and answers its boundary rows as ever."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgr_engine.client.shard_client import ForwardResult, ShardClient, expectations_of
from dgr_engine.errors import FrameRejected
from dgr_engine.options import EngineOptions
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_session.sampling import greedy
from dgr_session.speculation import kept_drafts
from tests.harness import run

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=128, n_batch=64, max_sessions=4)
PROMPT = [5, 9, 31, 2, 77, 5, 9]


def test_the_last_stage_answers_the_greedy_tokens_of_the_logits_it_would_answer(
    tiny_llama: Path,
) -> None:
    kw = OPTIONS.engine_kwargs()
    worker = ShardWorker.load(tiny_llama, (0, 4), **kw, config=WorkerConfig())
    middle = ShardWorker.load(tiny_llama, (0, 2), **kw, config=WorkerConfig())
    n = len(PROMPT)

    async def scenario() -> list[Any]:
        address, middle_address = await worker.start(), await middle.start()
        try:
            async with ShardClient(address, timeout=20.0) as client:
                expect = expectations_of(await client.describe())
                for sid in ("l", "g"):
                    await client.open(sid, 1, expect)

                async def one(sid: str, step: int, pos: int, tokens: list[int], **kw: Any) -> Any:
                    wanted = range(len(tokens)) if kw.get("drafts") else kw.pop("logit_rows", None)
                    return await client.forward(
                        sid,
                        1,
                        step,
                        expect,
                        range(pos, pos + len(tokens)),
                        tokens=tokens,
                        logit_rows=wanted,
                        **kw,
                    )

                async def both(step: int, pos: int, tokens: list[int], **kw: Any) -> list[int]:
                    """The frame on both sessions: the greedy tokens equal the logits' argmax."""
                    logits: ForwardResult = await one("l", step, pos, tokens, **kw)
                    answered: ForwardResult = await one(
                        "g", step, pos, tokens, greedy_tokens=True, **kw
                    )
                    assert logits.greedy is None and logits.output.shape[1] == 256
                    assert answered.is_logits and answered.output.size == 0  # no logits bytes
                    assert answered.greedy == tuple(greedy(row) for row in logits.output)
                    assert answered.next_pos == logits.next_pos
                    return list(answered.greedy)

                tokens = await both(0, 0, PROMPT, logit_rows=range(n))  # every prompt row
                assert len(tokens) == n
                (t0,) = await both(1, n, [tokens[-1]])  # a decode step: the last row
                (t1,) = await both(2, n + 1, [t0])
                (t2,) = await both(3, n + 2, [t1])
                (t3,) = await both(4, n + 3, [t2])
                with pytest.raises(FrameRejected, match="greedy_tokens"):  # changes nothing
                    await one("g", 5, n + 4, [t3], logits=False, greedy_tokens=True)
                # a verification pass: the newest token and two drafts; then the frame after it
                passed = await both(5, n + 4, [t3, t0, 7], drafts=2)
                assert len(passed) == 3
                kept = kept_drafts(passed, [t0, 7])
                await both(6, n + 5 + kept, [passed[kept]], kept_drafts=kept)
                usage = [(await client.usage(sid))[0] for sid in ("l", "g")]
            async with ShardClient(middle_address, timeout=20.0) as first:
                m_expect = expectations_of(await first.describe())
                outs = []
                for sid, flag in (("l", False), ("g", True)):  # a middle stage ignores it
                    await first.open(sid, 1, m_expect)
                    outs.append(
                        await first.forward(
                            sid, 1, 0, m_expect, range(n), tokens=PROMPT, greedy_tokens=flag
                        )
                    )
                for out in outs:
                    assert not out.is_logits and out.greedy is None and out.output.shape == (n, 64)
                assert np.array_equal(outs[0].output, outs[1].output)
            return usage
        finally:
            await worker.stop()
            await middle.stop()

    logits_record, greedy_record = run(scenario())
    assert logits_record.forwards == greedy_record.forwards == 7
    # 7 + 4 + 3 + 1 logits rows of 1 KB each, against a varint or two per row
    assert logits_record.bytes_out > 15 * 256 * 4
    assert greedy_record.bytes_out < logits_record.bytes_out / 20
