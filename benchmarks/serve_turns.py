"""A conversation's turns over ``dgr serve``: the time to each turn's first token with prompt
prefixes kept across sessions (``docs/prefix-cache.md``) against the same server without them
(``--no-prefix-cache``), and ``llama-server`` with its own prompt cache (its default), side by
side in one run on the same cores.

Each server holds its own conversation of ``--turns`` user messages (fixed questions), greedy,
each answer at most ``--max-tokens`` tokens, through ``POST /v1/chat/completions`` streamed;
every turn sends the whole history, as a chat client does. Turns are interleaved (turn t asks
every server, in a rotated order, before turn t + 1). Both ``dgr serve`` routes run ``--stages``
spawned workers with context ``--ctx`` (a lane of its own: certified first under your operator
lock, ``--certify``, unless ``--serve-arg`` names a lock and evidence); dgr's two conversations
are the same tokens (prefix reuse is exact), which the result checks. The issue's target: the
10th turn's first token with prefixes kept <= 0.3 x without. Prints a table, writes
``<out>/serve_turns.json`` and ``.md``.

    python -m benchmarks.serve_turns [--model smollm2-135m-instruct] [--stages 2] [--turns 10]
        [--max-tokens 24] [--ctx 2048] [--threads 1] [--out benchmarks/out] [--serve-arg ARG]...
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx2 as httpx

from benchmarks.serve_latency import (
    BENCH_OPTIONS,
    REQUEST_TIMEOUT_S,
    ServerFailed,
    ServerProcess,
    stream_chunks,
    write_result,
)

QUESTIONS = (
    "Name a planet in our solar system.",
    "How far is it from the sun, roughly?",
    "What is its largest moon?",
    "Who discovered that moon?",
    "In which century was that?",
    "What instrument did he use?",
    "How did that instrument change astronomy?",
    "Name another astronomer of that time.",
    "What is that astronomer known for?",
    "Summarise our conversation in one sentence.",
    "Thank you. What should I read next?",
    "Why that book?",
)
"""The user's messages, in order (``--turns`` of them, at most this many)."""


@attrs.frozen
class Turn:
    first_token_s: float
    text: str


def timed_chat(
    client: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int
) -> Turn:
    """One streamed greedy chat completion of ``messages``: the time to its first text."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    began = time.perf_counter()
    first = None
    text: list[str] = []
    for chunk in stream_chunks(client, url, "/v1/chat/completions", body):
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece:
                first = time.perf_counter() if first is None else first
                text.append(piece)
    if first is None:
        raise ServerFailed(f"{url}: no text came back")
    return Turn(first - began, "".join(text))


def run_benchmark(
    *,
    model: str,
    stages: int,
    turns: int,
    max_tokens: int,
    ctx: int,
    threads: int,
    serve_args: Sequence[str] = (),
    log: Any = print,
) -> dict[str, Any]:
    """Starts the servers, runs the conversations, stops every server; the result."""
    from dgr_engine.models.resolve import resolve_model
    from dgr_engine.tooling.peer_build import tool

    path = resolve_model(model, notice=lambda text: log(f"model: {text}"))
    binary = tool("llama-server", log=lambda text: log(text))
    options = attrs.evolve(BENCH_OPTIONS, n_threads=threads, n_ctx_per_session=ctx)
    kept = [*serve_args, "--certify"]
    servers: list[ServerProcess] = []
    try:
        log(f"starting dgr serve --spawn {stages} (certifying the lane first if needed) ...")
        servers.append(ServerProcess.dgr(model, stages, options=options, extra=kept))
        servers.append(
            ServerProcess.dgr(model, stages, options=options, extra=[*kept, "--no-prefix-cache"])
        )
        log("starting llama-server ...")
        servers.append(ServerProcess.llama_server(binary, path, options=options, cache=True))
        names = ["dgr serve, prefixes kept", "dgr serve, --no-prefix-cache", "llama-server"]
        history: list[list[dict[str, str]]] = [[] for _ in servers]
        firsts: list[list[float]] = [[] for _ in servers]
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            for turn in range(turns):
                order = list(range(len(servers)))
                order = order[turn % len(order) :] + order[: turn % len(order)]
                for index in order:
                    messages = [*history[index], {"role": "user", "content": QUESTIONS[turn]}]
                    answer = timed_chat(client, servers[index].url, messages, max_tokens)
                    history[index] = [*messages, {"role": "assistant", "content": answer.text}]
                    firsts[index].append(answer.first_token_s)
                log(f"turn {turn + 1}/{turns} done")
    finally:
        for server in servers:
            server.stop()
    return {
        "model": model,
        "stages": stages,
        "turns": turns,
        "max_tokens": max_tokens,
        "ctx": ctx,
        "threads": threads,
        "servers": names,
        "first_token_s": firsts,
        "same_conversation": history[0] == history[1],
        "last_turn_ratio": firsts[0][-1] / firsts[1][-1],
    }


def table(result: dict[str, Any]) -> str:
    names, firsts = result["servers"], result["first_token_s"]
    head = (
        f"A conversation over `dgr serve` ({result['model']}, {result['stages']} stages, context "
        f"{result['ctx']}, greedy, answers of at most {result['max_tokens']} tokens): first token "
        f"(ms) per turn\n\n| turn | {' | '.join(names)} | kept / not kept |\n"
        f"| ---: |{' ---: |' * len(names)} ---: |\n"
    )
    lines = []
    for turn in range(result["turns"]):
        cells = " | ".join(f"{f[turn] * 1000:.1f}" for f in firsts)
        lines.append(f"| {turn + 1} | {cells} | {firsts[0][turn] / firsts[1][turn]:.2f} |")
    same = "the same" if result["same_conversation"] else "NOT the same"
    tail = f"\n\ndgr's two conversations were {same} text.\n"
    return head + "\n".join(lines) + tail


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or GGUF")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="threads per engine")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="a further dgr serve argument"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.turns <= len(QUESTIONS) or args.stages < 1 or args.max_tokens < 1:
        print(
            f"serve_turns: --turns 1..{len(QUESTIONS)}, --stages and --max-tokens >= 1",
            file=sys.stderr,
        )
        return 2

    def log(text: str) -> None:
        print(f"serve_turns: {text}", file=sys.stderr, flush=True)

    try:
        result = run_benchmark(
            model=args.model,
            stages=args.stages,
            turns=args.turns,
            max_tokens=args.max_tokens,
            ctx=args.ctx,
            threads=args.threads,
            serve_args=args.serve_arg,
            log=log,
        )
    except ServerFailed as exc:
        print(f"serve_turns: a server failed: {exc}", file=sys.stderr)
        return 1
    write_result(args.out, "serve_turns", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
