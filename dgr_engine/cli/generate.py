"""Generate tokens over a route of shard workers.

--endpoints: workers already running, in route order (each serving the next range).
--spawn N: N workers started on 127.0.0.1 over even layer ranges of --model or --fixture
(stopped at the end, also on Ctrl-C); a lost worker is replaced by a new one. --model is a GGUF
file or a real model of the catalog by name ('dgr models list'), fetched and verified first if
it is not yet. Sampling is
greedy. --transport chain or ring sends each stage's output straight to the next stage (the
workers dial each other; docs/chain.md). --prompt TEXT is tokenized with the model's own
tokenizer (llama.cpp's, from the GGUF; --vocab GGUF with --endpoints), --chat applies its chat
template, the text is printed as it is generated and generation stops at the model's
end-of-generation tokens (--no-stop: it does not); --ids takes and prints token ids instead (the
generated fixtures have no tokenizer; with no --prompt, 8 fixed ids). --check compares with the
whole model run in-process (same engine options) and exits 1 on a difference. Every stage's
lane must be certified at --require (default real-hardware); dark lanes are never routed. For
the fixtures: 'dgr certify --fixture NAME' first, then --require fixture (spawned workers read
--evidence, default the checkout's evidence/, and --lock, default the checkout's; the client
checks every stage's record against --lock too). On a real model, e.g.:

    dgr generate --model smollm2-135m-instruct --spawn 3 --chat --prompt "Who wrote Hamlet?"

Prints the text (or the token ids) on stdout, then per-stage counters on stderr; --json prints
one JSON object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from dgr_engine.cli._route import (
    RoutePlan,
    RouteRefused,
    RouteStartFailed,
    add_route_arguments,
    open_route,
    plan_route,
)
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import StageStats
from dgr_engine.client.text import prompt_ids, start_text
from dgr_engine.errors import EngineError
from dgr_engine.reference import whole_model_greedy
from dgr_engine.tokenizer import Tokenizer
from dgr_session import FaultKind, SessionResult

DEFAULT_PROMPT = (1, 17, 42, 99, 7, 64, 128, 3)
"""The prompt when none is given."""
DEFAULT_NEW_TOKENS, DEFAULT_TEXT_TOKENS = 16, 64
"""``-n``'s default for token ids, and for a text prompt (a chat answer needs room)."""


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"with --ids the prompt is token ids, got {text!r}") from None
    if not ids:
        raise ValueError("the prompt needs at least one token id")
    return ids


def configure(p: argparse.ArgumentParser) -> None:
    add_route_arguments(p)
    p.add_argument(
        "--prompt",
        default=None,
        help="the prompt: text, tokenized with the model's own tokenizer (with --ids: token "
        "ids separated by spaces or commas); default: 8 fixed token ids",
    )
    p.add_argument(
        "--ids", action="store_true", help="token ids in (--prompt) and out, no tokenizer"
    )
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument(
        "--no-stop",
        action="store_true",
        help="do not stop at the model's end-of-generation tokens",
    )
    p.add_argument(
        "-n",
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"tokens to generate at most (default {DEFAULT_NEW_TOKENS}; {DEFAULT_TEXT_TOKENS} "
        "with a text prompt, which stops at the model's end-of-generation tokens first)",
    )
    p.add_argument(
        "--check", action="store_true", help="compare with the whole model; exit 1 if unequal"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_route(args, notice=_notice)
    except RouteRefused as exc:
        print(f"dgr generate: {exc}", file=sys.stderr)
        return 2
    try:
        if args.check and plan.model is None:
            raise ValueError("--check needs --model or --fixture")
        args.text = _prompt(args, plan.tokenizer)
        if args.max_new_tokens is None:
            has_text = args.text is not None
            args.max_new_tokens = DEFAULT_TEXT_TOKENS if has_text else DEFAULT_NEW_TOKENS
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
    except (ValueError, EngineError) as exc:
        plan.close()
        print(f"dgr generate: {exc}", file=sys.stderr)
        return 2
    args.chain_frames_sent = None  # frames this client sent into a chain (set by _run)
    has_text = args.text is not None
    try:
        with sigterm_as_interrupt():
            outcome = asyncio.run(_run(args, plan))
    except KeyboardInterrupt:
        print("dgr generate: interrupted", file=sys.stderr)
        return 130
    except RouteStartFailed as exc:
        print(f"dgr generate: {exc}", file=sys.stderr)
        return 2
    result, stats, seconds, tail = outcome
    expected = None
    if args.check:
        assert plan.model is not None
        expected = whole_model_greedy(plan.model, [args.prompt], args.max_new_tokens, plan.options)[
            0
        ]
        expected = expected[: len(result.tokens)]  # a stop token may have ended the session
    tokens = list(result.tokens)
    text = args.generated + tail if has_text else None
    if args.json:
        print(
            json.dumps(
                {
                    "state": result.state.value,
                    "tokens": tokens,
                    "text": text,
                    "epoch": result.epoch,
                    "route_changes": result.route_changes,
                    "error": None if result.error is None else str(result.error),
                    "seconds": seconds,
                    "whole_model_equal": None if expected is None else tokens == expected,
                    "stages": [_stats_dict(s) for s in stats.values()],
                    "transport": args.transport,
                    "chain_frames_sent": args.chain_frames_sent,
                }
            )
        )
    else:
        if text is None:
            print(" ".join(map(str, tokens)))
        else:
            print(tail, flush=True)  # the text went out as it came
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
            if any(r.fault is FaultKind.ROUTE_INVALID for r in result.reports):
                print(
                    "the route was refused (see above); if a lane is not certified at the "
                    "required class: certify it ('dgr certify') or state the class the route "
                    "needs (--require)",
                    file=sys.stderr,
                )
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
    args: argparse.Namespace, plan: RoutePlan
) -> tuple[SessionResult, dict[str, StageStats], float, str]:
    async with open_route(plan, notice=_notice) as route:
        began = time.perf_counter()
        tail = ""
        if route.tokenizer is None or args.text is None:
            handle = route.manager.start(args.prompt, max_new_tokens=args.max_new_tokens)
            result = await handle.wait()
        else:
            handle, stream = start_text(
                route.manager,
                route.tokenizer,
                args.text,
                max_new_tokens=args.max_new_tokens,
                on_text=lambda piece: _emit(args, piece),
                chat=args.chat,
                stop_at_eog=not args.no_stop,
            )
            result = await handle.wait()
            tail = stream.flush()  # bytes of a character the last piece left incomplete
        seconds = time.perf_counter() - began
        await route.manager.aclose()
        transport = route.stage_transport
        if isinstance(transport, ChainStageTransport):
            args.chain_frames_sent = transport.chain_stats.sent
        return result, transport.stats(), seconds, tail


def _notice(text: str) -> None:
    print(f"dgr generate: {text}", file=sys.stderr, flush=True)


def _emit(args: argparse.Namespace, piece: str) -> None:
    """Generated text as it comes (on stdout unless --json gathers it)."""
    args.generated += piece
    if not args.json:
        print(piece, end="", flush=True)


def _prompt(args: argparse.Namespace, tokenizer: Tokenizer | None) -> str | None:
    """Sets ``args.prompt`` to token ids; returns the text of a text prompt (``None`` for
    token ids: --ids, or no --prompt)."""
    args.generated = ""
    if args.prompt is None or args.ids:
        args.prompt = list(DEFAULT_PROMPT) if args.prompt is None else _parse_ids(args.prompt)
        if args.chat:
            raise ValueError("--chat needs a text prompt (not --ids)")
        return None
    if tokenizer is None:
        if args.vocab is None and args.model is None and args.fixture is None:
            raise ValueError(
                "a text prompt needs a tokenizer: --model, --fixture or --vocab GGUF (or --ids)"
            )
        raise ValueError(
            "the model has no tokenizer (token ids only, like the generated fixtures): give "
            "token ids with --ids"
        )
    text = str(args.prompt)
    args.prompt = prompt_ids(tokenizer, text, chat=args.chat)
    return text
