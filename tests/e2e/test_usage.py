"""Usage records (issue 17, part 4): per (session, epoch, stage) the manager's records say what
the session used, with the fault that made an epoch replay; each worker serves its own records
by session id, and the two views agree row for row."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.shard_client import ShardClient
from dgr_engine.errors import GrantUnauthenticated
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import (
    FaultKind,
    SessionState,
    UsageRecord,
    layer_rows,
)
from tests.harness import lose_last_stage_at, run_session

pytestmark = pytest.mark.usefixtures("certified_fixtures")

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
PROMPT = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]
N_NEW, LOSE_AT = 8, 4


def rows(record: UsageRecord) -> tuple[int, int, int]:
    return record.rows_prefill, record.rows_decode, record.rows_replay


def test_client_and_worker_usage_records_agree_row_for_row(tiny_llama: Path) -> None:
    provider = LoopbackRouteProvider(tiny_llama, [(0, 2), (2, 4)], spares=[(2, 4)], options=OPTIONS)
    seen: dict[str, list[UsageRecord]] = {}
    transports: list[GrpcStageTransport] = []

    async def ask_the_workers(provider: LoopbackRouteProvider) -> None:
        for worker in provider.workers:  # what each living worker says it did
            if worker.process.proc.poll() is None:
                # the session's own client holds its secret (kept after the close)
                holder = transports[0].client(worker.endpoint)
                seen[worker.endpoint] = await holder.usage("bill")
                async with ShardClient(worker.endpoint, timeout=10.0) as client:
                    assert await client.usage("nobody") == []  # unknown here: no records
                    with pytest.raises(GrantUnauthenticated):  # another client: no secret
                        await client.usage("bill")

    result = run_session(
        provider,
        PROMPT,
        N_NEW,
        session_id="bill",
        on_token=lose_last_stage_at(provider, LOSE_AT),
        after=ask_the_workers,
        seen=transports.append,
    )
    assert result.state is SessionState.DONE and result.epoch == 2
    by_key = {(r.epoch, r.stage_index): r for r in result.usage}
    assert set(by_key) == {(1, 0), (1, 1), (2, 0), (2, 1)}
    # epoch 1: the prompt, then decode steps; the last one reached stage 0 only (stage 1 died)
    assert rows(by_key[1, 0]) == (len(PROMPT), LOSE_AT, 0)
    assert rows(by_key[1, 1]) == (len(PROMPT), LOSE_AT - 1, 0)
    # epoch 2: prompt + accepted tokens replayed on both stages, because stage 1 was dead
    for stage in (0, 1):
        record = by_key[2, stage]
        assert rows(record) == (0, N_NEW - LOSE_AT - 1, len(PROMPT) + LOSE_AT)
        assert record.replay_cause is FaultKind.DEAD
    assert by_key[1, 0].replay_cause is None
    assert all(r.bytes_in > 0 and r.bytes_out > 0 and r.engine_seconds > 0 for r in result.usage)
    assert layer_rows(result.usage) == sum(r.rows * 2 for r in result.usage)  # 2 layers each
    # the workers' own records: the same rows, epoch by epoch (the dead worker cannot answer)
    for endpoint, records in seen.items():
        client_side = {r.epoch: rows(r) for r in result.usage if r.endpoint == endpoint}
        assert {r.epoch: rows(r) for r in records} == client_side, endpoint
        assert all(r.bytes_in > 0 and r.forwards > 0 for r in records)
    assert len(seen) == 2  # the first stage and the spare
