"""A last stage asked for the session's tokens (``ForwardRequest.sampled_tokens``,
``docs/sampling.md``) answers, for each wanted row, the token its session's sampler (the open's)
takes instead of the row's logits: for three sessions fed the same frames, one asking for
logits, one greedy and one opened with a seeded, penalised sampler, the tokens are the logits'
argmax and what ``dgr_engine.engine.sampling.SeededSampler`` takes of the same logits at the same
positions after the same tokens, on every kind of frame (a prefill wanting every row, a decode
step, a verification pass and the frame after it), and the replies carry no logits bytes.
Asking for tokens and no logits at once is refused and changes nothing; an open with a sampler
out of range is refused; a middle stage ignores the flag and answers its boundary rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from dgr_engine.client.shard_client import ForwardResult, ShardClient, expectations_of
from dgr_engine.engine.sampling import sample_rows
from dgr_engine.errors import FrameRejected
from dgr_engine.options import EngineOptions
from dgr_engine.wire import frames
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_session.sampling import Sampling, greedy
from dgr_session.speculation import kept_drafts
from tests.harness import run

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=128, n_batch=64, max_sessions=4)
PROMPT = [5, 9, 31, 2, 77, 5, 9]
HOT = Sampling(seed=77, temperature=1.5, top_k=40, top_p=0.95, frequency_penalty=0.4)


def test_the_last_stage_answers_its_samplers_tokens_of_the_logits_it_would_answer(
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
                await client.open("s", 1, expect, sampling=HOT)
                fed: list[int] = []  # the token at every position the sessions ran

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
                    """The frame on all three sessions: the greedy tokens equal the logits'
                    argmax, the seeded session's its sampler's of the same logits."""
                    logits: ForwardResult = await one("l", step, pos, tokens, **kw)
                    answered: ForwardResult = await one(
                        "g", step, pos, tokens, sampled_tokens=True, **kw
                    )
                    seeded: ForwardResult = await one(
                        "s", step, pos, tokens, sampled_tokens=True, **kw
                    )
                    del fed[pos:]
                    fed.extend(tokens)
                    assert logits.sampled is None and logits.output.shape[1] == 256
                    assert answered.is_logits and answered.output.size == 0  # no logits bytes
                    assert answered.sampled == tuple(greedy(row) for row in logits.output)
                    rows = logits.output.shape[0]
                    after = [pos + len(tokens)] if rows == 1 else range(pos + 1, pos + rows + 1)
                    assert seeded.sampled == tuple(sample_rows(HOT, logits.output, after, fed))
                    assert answered.next_pos == logits.next_pos == seeded.next_pos
                    return list(answered.sampled)

                tokens = await both(0, 0, PROMPT, logit_rows=range(n))  # every prompt row
                assert len(tokens) == n
                (t0,) = await both(1, n, [tokens[-1]])  # a decode step: the last row
                (t1,) = await both(2, n + 1, [t0])
                (t2,) = await both(3, n + 2, [t1])
                (t3,) = await both(4, n + 3, [t2])
                with pytest.raises(FrameRejected, match="sampled_tokens"):  # changes nothing
                    await one("g", 5, n + 4, [t3], logits=False, sampled_tokens=True)
                # a verification pass: the newest token and two drafts; then the frame after it
                passed = await both(5, n + 4, [t3, t0, 7], drafts=2)
                assert len(passed) == 3
                kept = kept_drafts(passed, [t0, 7])
                await both(6, n + 5 + kept, [passed[kept]], kept_drafts=kept)
                usage = [(await client.usage(sid))[0] for sid in ("l", "g")]
                bad = pb.OpenSessionRequest(session_id="x", epoch=1)
                bad.expect.CopyFrom(frames.expectations_to_proto(expect))
                bad.sampling.top_p = 0.0  # out of (0, 1]: refused, nothing opened
                async with grpc.aio.insecure_channel(address) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await shard_pb2_grpc.ShardStub(channel).OpenSession(bad)
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "top_p" in str(refused.value.details())
            async with ShardClient(middle_address, timeout=20.0) as first:
                m_expect = expectations_of(await first.describe())
                outs = []
                for sid, flag in (("l", False), ("g", True)):  # a middle stage ignores it
                    await first.open(sid, 1, m_expect)
                    outs.append(
                        await first.forward(
                            sid, 1, 0, m_expect, range(n), tokens=PROMPT, sampled_tokens=flag
                        )
                    )
                for out in outs:
                    assert not out.is_logits and out.sampled is None and out.output.shape == (n, 64)
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
