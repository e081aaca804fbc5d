"""Concurrent chat clients against ``dgr serve`` and ``llama-server -np N``, side by side in one
run on the same cores: aggregate tok/s and the median time to first token.

For each ``--clients N``: ``llama-server`` with N slots (context ``--ctx`` each, its own
prompt cache) is started, and ``dgr serve --spawn --stages`` (started once, with at least as
many session slots as the most clients; ``--no-peer-cache``: llama-server without its prompt
cache); N client threads each ask ``--requests`` chat
questions back to back (streamed ``POST /v1/chat/completions``, at most ``--max-tokens``
tokens), greedy and then sampled as chat clients ask (T 0.7, top-p 0.9, a seed per request),
the servers in turn. Aggregate tok/s: every completion token over the wall time from the first
request to the last answer; first token: from sending a request to its first streamed text,
the median over every request. The issue's targets (8 and 16 clients, greedy and sampled):
dgr's tok/s >= 1.2 x llama-server's, and its median first token <= llama-server's. Prints a
table, writes ``<out>/serve_load.json`` and ``.md``.

    python -m benchmarks.serve_load [--model smollm2-135m-instruct] [--stages 2]
        [--clients 8 16] [--requests 4] [--max-tokens 32] [--out benchmarks/out]
        [--serve-arg ARG]...
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx2 as httpx

from benchmarks.serve_latency import (
    BENCH_OPTIONS,
    REQUEST_TIMEOUT_S,
    SAMPLED,
    ServerFailed,
    ServerProcess,
    stream_chunks,
    write_result,
)

QUESTIONS = (
    "Why is the sky blue?",
    "Name three rivers in Europe.",
    "What is a prime number?",
    "How do bees make honey?",
    "Explain gravity to a child.",
    "What is the capital of Japan?",
    "Give me a tip for sleeping well.",
    "What does a compiler do?",
)


@attrs.frozen
class Answer:
    first_token_s: float
    tokens: int


def ask(
    client: httpx.Client, url: str, question: str, max_tokens: int, sampling: dict[str, Any]
) -> Answer:
    """One streamed chat completion: the time to its first text and its completion tokens."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **sampling,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    first, pieces, usage = None, 0, None
    for chunk in stream_chunks(client, url, "/v1/chat/completions", body):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                first = time.perf_counter() if first is None else first
                pieces += 1
    if first is None:
        raise ServerFailed(f"{url}: no text came back")
    return Answer(first - began, int(usage["completion_tokens"]) if usage else pieces)


def load(url: str, clients: int, requests: int, max_tokens: int, sampled: bool) -> dict[str, Any]:
    """``clients`` threads asking ``requests`` questions each at once: the aggregate figures."""
    answers: list[Answer] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def client_thread(index: int) -> None:
        try:
            with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
                for r in range(requests):
                    question = QUESTIONS[(index + r) % len(QUESTIONS)]
                    sampling = {**SAMPLED, "seed": index * 1000 + r} if sampled else {}
                    answer = ask(client, url, question, max_tokens, sampling)
                    with lock:
                        answers.append(answer)
        except BaseException as exc:  # noqa: BLE001 - reported after the join
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S * requests)
    wall = time.perf_counter() - began
    if failures:
        raise ServerFailed(f"{url}: {failures[0]!r}")
    tokens = sum(a.tokens for a in answers)
    return {
        "requests": len(answers),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "first_token_p50_s": statistics.median(a.first_token_s for a in answers),
    }


def run_benchmark(
    *,
    model: str,
    stages: int,
    clients: Sequence[int],
    requests: int,
    max_tokens: int,
    threads: int,
    serve_args: Sequence[str] = (),
    log: Any = print,
    peer_cache: bool = True,
) -> dict[str, Any]:
    from dgr_engine.models.resolve import resolve_model
    from dgr_engine.tooling.peer_build import tool

    path = resolve_model(model, notice=lambda text: log(f"model: {text}"))
    binary = tool("llama-server", log=lambda text: log(text))
    options = attrs.evolve(BENCH_OPTIONS, n_threads=threads, max_sessions=max(clients))
    rows: list[dict[str, Any]] = []
    log(f"starting dgr serve --spawn {stages} ...")
    dgr = ServerProcess.dgr(model, stages, options=options, extra=serve_args)
    try:
        for n in clients:
            log(f"starting llama-server -np {n} ...")
            peer = ServerProcess.llama_server(
                binary, path, options=options, cache=peer_cache, slots=n
            )
            try:
                for sampled in (False, True):
                    mode = "sampled" if sampled else "greedy"
                    figures = {}
                    for server in (peer, dgr) if len(rows) % 2 == 0 else (dgr, peer):
                        load(server.url, min(n, 2), 1, 4, sampled)  # warm-up: not counted
                        figures[server.name] = load(server.url, n, requests, max_tokens, sampled)
                        log(f"{n} clients {mode}: {server.name} done")
                    ours, theirs = figures[dgr.name], figures[peer.name]
                    rows.append(
                        {
                            "clients": n,
                            "sampling": mode,
                            "dgr": ours,
                            "llama_server": theirs,
                            "ratio_tok_s": ours["tok_s"] / theirs["tok_s"],
                            "ratio_first_token": ours["first_token_p50_s"]
                            / theirs["first_token_p50_s"],
                        }
                    )
            finally:
                peer.stop()
    finally:
        dgr.stop()
    return {
        "model": model,
        "stages": stages,
        "requests_per_client": requests,
        "max_tokens": max_tokens,
        "threads": threads,
        "llama_server_prompt_cache": peer_cache,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    head = (
        f"Concurrent chat clients: `dgr serve --spawn {result['stages']}` against "
        f"`llama-server -np N` ({result['model']}, {result['requests_per_client']} requests per "
        f"client, at most {result['max_tokens']} tokens)\n\n"
        "| clients | sampling | dgr tok/s | llama-server tok/s | × | dgr first token p50 (ms) "
        "| llama-server (ms) | × |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = [
        f"| {r['clients']} | {r['sampling']} | {r['dgr']['tok_s']:.1f} | "
        f"{r['llama_server']['tok_s']:.1f} | {r['ratio_tok_s']:.2f} | "
        f"{r['dgr']['first_token_p50_s'] * 1000:.0f} | "
        f"{r['llama_server']['first_token_p50_s'] * 1000:.0f} | {r['ratio_first_token']:.2f} |"
        for r in result["rows"]
    ]
    return head + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or GGUF")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--requests", type=int, default=4, help="questions per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="threads per engine")
    parser.add_argument(
        "--no-peer-cache",
        action="store_true",
        help="llama-server without its prompt cache (--no-cache-prompt --cache-ram 0)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="a further dgr serve argument"
    )
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or args.requests < 1 or args.stages < 1 or args.max_tokens < 1:
        print("serve_load: --clients, --requests, --stages, --max-tokens >= 1", file=sys.stderr)
        return 2

    def log(text: str) -> None:
        print(f"serve_load: {text}", file=sys.stderr, flush=True)

    try:
        result = run_benchmark(
            model=args.model,
            stages=args.stages,
            clients=args.clients,
            requests=args.requests,
            max_tokens=args.max_tokens,
            threads=args.threads,
            serve_args=args.serve_arg,
            log=log,
            peer_cache=not args.no_peer_cache,
        )
    except ServerFailed as exc:
        print(f"serve_load: a server failed: {exc}", file=sys.stderr)
        return 1
    write_result(args.out, "serve_load", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
