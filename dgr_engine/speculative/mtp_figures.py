"""The MTP records' figures (DGR-070, ``docs/speculative.md``): DeepSeek V4's MTP block drafting
through a route of workers, measured.

:func:`measure_mtp` serves a V4 model with an MTP block (``tiny-v4-mtp`` or a real one) as
in-process ``ShardWorker`` routes of each stage count, runs one greedy session with MTP drafts
over the relay, a chain and a ring on each, and reports whether the tokens equal the whole
model's plain greedy tokens, the passes, drafts and accepted drafts, the cost of a draft on the
last stage (its ``mtp_draft`` calls, timed there) and the ownership contract as served (which
stage loaded the block and advertised it). On random-weight fixtures acceptance says nothing
about a real model's: the figures of such a model are the mechanism's, not a speed-up.
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.route_modes import RouteMode
from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.options import EngineOptions
from dgr_engine.reference import n_layer_of, whole_model_greedy
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_session import EvidenceClass, FailurePolicy, SessionManager, SessionState
from dgr_session.mtp_drafts import MtpDraftRequest
from dgr_session.speculation import AnyLength, Speculation

__all__ = ["TRANSPORTS", "layout_of", "measure_mtp"]

TRANSPORTS = tuple(str(m) for m in (RouteMode.RELAY, RouteMode.CHAIN, RouteMode.RING))
"""How the sessions reach the route."""
PROMPT = (17, 4, 99, 230, 5, 61, 17, 4, 99, 12, 33, 7)
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=2)


def layout_of(n_layer: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous ranges over ``n_layer`` layers, as even as they go."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"{stages} stages over {n_layer} layers")
    cuts = [round(i * n_layer / stages) for i in range(stages + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


class _DraftClock:
    """Times an engine's ``mtp_draft`` calls (the last stage's cost of its drafts)."""

    def __init__(self, engine: Any) -> None:
        self.ns = self.tokens = self.calls = 0
        inner: Callable[..., list[int]] = engine.mtp_draft

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> list[int]:
            began = time.perf_counter_ns()
            drafts = inner(*args, **kwargs)
            self.ns += time.perf_counter_ns() - began
            self.tokens += len(drafts)
            self.calls += 1
            return drafts

        engine.mtp_draft = timed


def _certify(model: Path, evidence: Path, fixture: str | None) -> None:
    """``dgr certify`` of the model's lanes into ``evidence`` (routes take certified lanes)."""
    source = ["--fixture", fixture] if fixture else ["--model", str(model)]
    done = subprocess.run(
        [sys.executable, "-m", "dgr_engine.cli", "certify", *source]
        + ["--evidence", str(evidence), "--rpc", "off"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"dgr certify failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


async def _one_route(
    model: Path,
    layout: Sequence[tuple[int, int]],
    evidence: Path,
    n_tokens: int,
    k_max: int,
) -> dict[str, Any]:
    config = WorkerConfig(evidence_dir=evidence)
    workers = [
        ShardWorker.load(model, span, config=config, **OPTIONS.engine_kwargs()) for span in layout
    ]
    clock = _DraftClock(workers[-1].engine)
    out: dict[str, Any] = {
        "layout": [list(span) for span in layout],
        "mtp_loaded": [bool(getattr(w.engine, "mtp_loaded", False)) for w in workers],
    }
    try:
        for worker in workers:
            await worker.start()
        out["mtp_advertised"] = [w.advert().span.mtp for w in workers]
        provider = EndpointRouteProvider([w.address for w in workers])
        for kind in TRANSPORTS:
            transport: GrpcStageTransport = (
                GrpcStageTransport(timeout=30.0)
                if kind == "relay"
                else ChainStageTransport(timeout=30.0, ring=kind == "ring")
            )
            spec = Speculation(MtpDraftRequest(k_max=k_max), AnyLength())
            before = (clock.ns, clock.tokens)
            async with transport:
                manager = SessionManager(
                    transport,
                    provider,
                    policy=FailurePolicy(step_deadline=30.0, backoff=(0.0,)),
                    required_evidence=EvidenceClass.FIXTURE,
                )
                handle = manager.start(
                    PROMPT, max_new_tokens=n_tokens, session_id=f"mtp-{kind}", speculation=spec
                )
                result = await handle.wait()
                await manager.aclose()
            ran = handle.core.speculation  # the transport's in place of spec: its drafter
            assert ran is not None
            ns, tokens = clock.ns - before[0], clock.tokens - before[1]
            out[kind] = {
                "done": result.state is SessionState.DONE,
                "error": None if result.error is None else str(result.error),
                "tokens": list(result.tokens),
                "drafter": ran.drafter.name,
                "passes": spec.passes,
                "drafted": spec.drafted,
                "accepted": spec.accepted,
                "mtp_drafts_made": tokens,
                "draft_ms": ns / 1e6,
                "draft_ms_per_token": ns / 1e6 / tokens if tokens else None,
            }
    finally:
        for worker in workers:
            await worker.stop()
    return out


def measure_mtp(
    model_path: str | os.PathLike[str],
    stage_counts: Sequence[int] = (2, 3, 6),
    *,
    n_tokens: int = 24,
    k_max: int = 4,
    evidence: str | os.PathLike[str] | None = None,
    fixture: str | None = "tiny-v4-mtp",
) -> dict[int, dict[str, Any]]:
    """Per stage count: ``tokens_equal`` (every transport's tokens are the whole model's plain
    greedy tokens), ``passes``, ``drafted``, ``accepted`` (summed over the transports, and per
    transport under its name), ``draft_ms_per_token`` (the last stage's ``mtp_draft`` time per
    draft made), ``contract_ok`` with ``mtp_loaded`` / ``mtp_advertised`` (per stage: only the
    last loaded and advertised the block). ``evidence``: a directory with the model's
    certification records (``None``: ``dgr certify`` makes them in a temporary one, of
    ``fixture`` when given, else of the model file)."""
    model = Path(model_path)
    n_layer = n_layer_of(model)
    expected = whole_model_greedy(model, [PROMPT], n_tokens, OPTIONS)[0]
    with tempfile.TemporaryDirectory(prefix="dgr-mtp-figures-") as tmp:
        if evidence is None:
            evidence = Path(tmp) / "evidence"
            evidence.mkdir()
            _certify(model, evidence, fixture)
        figures: dict[int, dict[str, Any]] = {}
        for stages in stage_counts:
            layout = layout_of(n_layer, stages)
            run = asyncio.run(_one_route(model, layout, Path(evidence), n_tokens, k_max))
            per = {kind: run[kind] for kind in TRANSPORTS}
            made = sum(p["mtp_drafts_made"] for p in per.values())
            ms = sum(p["draft_ms"] for p in per.values())
            only_last = [False] * (stages - 1) + [True]
            figures[stages] = {
                "tokens_equal": all(p["done"] and p["tokens"] == expected for p in per.values()),
                "passes": sum(p["passes"] for p in per.values()),
                "drafted": sum(p["drafted"] for p in per.values()),
                "accepted": sum(p["accepted"] for p in per.values()),
                "draft_ms_per_token": ms / made if made else None,
                "mtp_loaded": run["mtp_loaded"],
                "mtp_advertised": run["mtp_advertised"],
                "contract_ok": run["mtp_loaded"] == only_last == run["mtp_advertised"],
                "expected_tokens": expected,
                **per,
            }
    return figures


if __name__ == "__main__":  # pragma: no cover - a manual run
    import json

    from dgr_engine.fixtures import ensure_fixture

    counts = tuple(int(a) for a in sys.argv[1:]) or (2, 3, 6)
    print(json.dumps(measure_mtp(ensure_fixture("tiny-v4-mtp"), counts), indent=1))
