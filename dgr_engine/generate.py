"""``dgr generate``: generate tokens over a route of shard workers.

::

    dgr generate --endpoints 127.0.0.1:50051,127.0.0.1:50052 --prompt "1 2 3" -n 16
    dgr generate --spawn 3 --fixture tiny-llama --prompt "1 2 3" -n 16 --check

``--endpoints``: workers already running, in route order (each serving the next range).
``--spawn N``: N workers spawned on 127.0.0.1 over even layer ranges of ``--model`` or
``--fixture`` (stopped at the end, also on Ctrl-C); a lost worker is replaced by a new one.
The route session runs in :class:`dgr_session.SessionManager` over
:class:`~dgr_engine.grpc_transport.GrpcStageTransport`; sampling is greedy. Prompts are token
ids (the fixtures have no tokenizer). ``--check`` compares with the whole model run
in-process (same engine options) and exits 1 on a difference. Fixture lanes are dark: routing
over them is an explicit opt-in (``--allow-dark-lanes``, implied by ``--spawn``).

Prints the tokens, one line, then per-stage counters; ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dgr_engine.grpc_transport import GrpcStageTransport, StageStats
from dgr_engine.route_provider import EndpointRouteProvider, LoopbackRouteProvider
from dgr_session import DarkLaneWarning, FailurePolicy, SessionManager, SessionResult
from dgr_session.transport import RouteProvider

DEFAULT_PROMPT = (1, 17, 42, 99, 7, 64, 128, 3)


def engine_options(threads: int, ctx: int, batch: int, sessions: int) -> dict[str, Any]:
    """``ShardEngine`` keyword arguments matching ``worker_args`` with the same values."""
    return {
        "max_sessions": sessions,
        "n_ctx_per_session": ctx,
        "n_threads": threads,
        "n_batch": batch,
        "n_ubatch": batch,
    }


def worker_args(threads: int, ctx: int, batch: int, sessions: int) -> list[str]:
    """``dgr worker`` arguments for the same engine options as :func:`engine_options`."""
    return [
        "--threads",
        str(threads),
        "--ctx",
        str(ctx),
        "--batch",
        str(batch),
        "--max-sessions",
        str(sessions),
        "--log-level",
        "WARNING",
    ]


def whole_model_greedy(
    model: Path, prompts: Sequence[Sequence[int]], n_tokens: int, options: dict[str, Any]
) -> list[list[int]]:
    """Whole-model greedy tokens per prompt, in-process (prompt in one call, then one token
    per call, as a route session decodes)."""
    return [tokens for tokens, _ in whole_model_reference(model, prompts, n_tokens, options)]


def whole_model_reference(
    model: Path, prompts: Sequence[Sequence[int]], n_tokens: int, options: dict[str, Any]
) -> list[tuple[list[int], list[npt.NDArray[np.float32]]]]:
    """Per prompt: the whole model's greedy tokens and, for each step, the logits row the
    token was chosen from (step 0: the prompt's last row).

    Fed as a route session feeds its stages: the prompt in one call asking for the last row's
    logits only (asking for every row's changes the output matmul's batching, hence the last
    bits), then one token per call."""
    from dgr_engine.chain import LocalChain
    from dgr_engine.engine import ShardEngine

    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    out = []
    with ShardEngine(model, **options) as whole:
        chain = LocalChain([whole])
        for index, prompt in enumerate(prompts):
            chain.open(index, 0)
            tokens, logits = chain.greedy(index, 0, prompt, n_tokens - 1, all_prefill_logits=False)
            # the last token is chosen from the last step's logits: no forward needed after it
            tokens.append(int(np.argmax(logits[-1][-1])))
            chain.close(index, 0)
            out.append((tokens, [step[-1] for step in logits]))
    return out


def even_layout(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    from dgr_engine.chain import split_points

    return split_points(n_layer, n_stages)


def n_layer_of(model: Path) -> int:
    """Main layers of a GGUF (from its metadata, without loading tensors): ``block_count``
    less the MTP/nextn layers, which are never routed (as the C engine counts them)."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    nextn = reader.fields.get(f"{arch}.nextn_predict_layers")
    n_nextn = int(nextn.parts[-1][0]) if nextn is not None else 0
    return int(reader.fields[f"{arch}.block_count"].parts[-1][0]) - n_nextn


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` (like Ctrl-C) while inside; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _parse_prompt(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a prompt is token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("the prompt needs at least one token id")
    return ids


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgr generate", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", help="H:P,H:P,... workers in route order")
    where.add_argument("--spawn", type=int, metavar="N", help="spawn N workers on 127.0.0.1")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, help="GGUF file (--spawn, --check)")
    model.add_argument("--fixture", help="a generated fixture by name (built if missing)")
    p.add_argument("--prompt", type=_parse_prompt, default=list(DEFAULT_PROMPT))
    p.add_argument("-n", "--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="engine threads per worker")
    p.add_argument("--ctx", type=int, default=256, help="KV positions per session")
    p.add_argument("--batch", type=int, default=64, help="most rows per forward")
    p.add_argument("--step-deadline", type=float, default=10.0, help="seconds")
    p.add_argument("--check", action="store_true", help="compare with the whole model")
    p.add_argument("--allow-dark-lanes", action="store_true", help="route over dark lanes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    model: Path | None = args.model
    if args.fixture is not None:
        from dgr_engine.fixtures import ensure_fixture

        model = ensure_fixture(args.fixture)
    if (args.spawn is not None or args.check) and model is None:
        print("dgr generate: --spawn and --check need --model or --fixture", file=sys.stderr)
        return 2
    providers: list[LoopbackRouteProvider] = []
    try:
        with sigterm_as_interrupt():
            outcome = asyncio.run(_run(args, model, providers))
    except KeyboardInterrupt:
        print("dgr generate: interrupted", file=sys.stderr)
        return 130
    finally:
        for provider in providers:
            provider.kill_all()  # idempotent: a no-op once aclose stopped them
    result, stats, seconds = outcome
    expected = None
    if args.check:
        assert model is not None
        options = engine_options(args.threads, args.ctx, args.batch, 4)
        expected = whole_model_greedy(model, [args.prompt], args.max_new_tokens, options)[0]
    tokens = list(result.tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "state": result.state.value,
                    "tokens": tokens,
                    "epoch": result.epoch,
                    "route_changes": result.route_changes,
                    "error": None if result.error is None else str(result.error),
                    "seconds": seconds,
                    "whole_model_equal": None if expected is None else tokens == expected,
                    "stages": [_stats_dict(s) for s in stats.values()],
                }
            )
        )
    else:
        print(" ".join(map(str, tokens)))
        print(
            f"state {result.state.value}  epoch {result.epoch}  route changes "
            f"{result.route_changes}  {len(tokens)} tokens in {seconds:.3f} s",
            file=sys.stderr,
        )
        for s in stats.values():
            print(
                f"  {s.endpoint} [{s.layers[0]},{s.layers[1]})  forwards {s.forwards}  rows "
                f"{s.rows}  engine {s.compute_us / 1000:.1f} ms  rtt {s.rtt_us / 1000:.1f} ms  "
                f"bytes in {s.bytes_sent}  out {s.bytes_received}",
                file=sys.stderr,
            )
        if result.error is not None:
            print(f"failed: {result.error}", file=sys.stderr)
        if expected is not None:
            print(f"whole-model equal: {tokens == expected}", file=sys.stderr)
    if result.error is not None:
        return 1
    return 1 if expected is not None and tokens != expected else 0


def _stats_dict(s: StageStats) -> dict[str, Any]:
    return {
        "endpoint": s.endpoint,
        "layers": list(s.layers),
        "forwards": s.forwards,
        "rows": s.rows,
        "bytes_sent": s.bytes_sent,
        "bytes_received": s.bytes_received,
        "rtt_us": s.rtt_us,
        "compute_us": s.compute_us,
    }


async def _run(
    args: argparse.Namespace, model: Path | None, providers: list[LoopbackRouteProvider]
) -> tuple[SessionResult, dict[str, StageStats], float]:
    provider: RouteProvider
    allow_dark = bool(args.allow_dark_lanes)
    local: LoopbackRouteProvider | None = None
    if args.spawn is not None:
        assert model is not None
        layout = even_layout(n_layer_of(model), args.spawn)
        wargs = worker_args(args.threads, args.ctx, args.batch, 4)
        local = LoopbackRouteProvider(model, layout, spawn_on_demand=True, worker_args=wargs)
        providers.append(local)
        provider = local
        allow_dark = True  # our own fixture/dev workers
    else:
        provider = EndpointRouteProvider([e.strip() for e in args.endpoints.split(",") if e])
    policy = FailurePolicy(step_deadline=args.step_deadline)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DarkLaneWarning)
        try:
            if local is not None:
                await local.start()
            async with GrpcStageTransport(timeout=args.step_deadline) as transport:
                manager = SessionManager(
                    transport, provider, policy=policy, allow_dark_lanes=allow_dark
                )
                began = time.perf_counter()
                result = await manager.start(args.prompt, max_new_tokens=args.max_new_tokens).wait()
                seconds = time.perf_counter() - began
                await manager.aclose()
                return result, transport.stats(), seconds
        finally:
            if local is not None:
                await local.aclose()
