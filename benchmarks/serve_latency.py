"""First-token latency and decode speed of ``dgr serve`` against ``llama-server``, over HTTP,
as a client of either sees them.

``llama-server`` is built from the same pinned, patched llama.cpp as dgr's engines
(``dgr_engine/tooling/peer_build.py``, with the other peers; cached). Both servers get the same
model, the same engine settings (``--threads``, context 256, batch 64: dgr's one set of
defaults) and the same prompt as token ids (the question through the model's chat template,
tokenized by dgr), asked through ``POST /v1/completions`` with ``stream: true``, greedy
(temperature 0) or, with ``--sampled``, as chat clients ask (temperature 0.7, top-p 0.9, a
seed: each server's own sampler, dgr's on its route's last stage), ``--max-tokens`` at most.
llama-server runs one slot and neither reuses a cached prompt nor keeps one in RAM
(``--no-cache-prompt --cache-ram 0``), so every round computes its prompt as dgr does; dgr
serve runs ``--spawn N`` workers for each ``--stages N``.

* **first token**: from sending the request to the first streamed text (the route's opens and
  the prompt's prefill through every stage for dgr; llama-server's prefill in one process);
* **decode tok/s**: the tokens after the first over the time from the first to the last text.

Interleaved rounds: every server is started once and warmed up with one request; then each
round asks every server once, in a rotated order. Figures are medians over ``--rounds``; the
ratios are dgr's first token over llama-server's and dgr's decode over llama-server's (the
issue's targets at 1 stage: first token <= 1.1 x, decode >= 0.9 x). The greedy answers are
compared too (dgr's
routes compute the whole model's tokens; llama-server's own sampler and batching may differ in
the last bits). Prints a table, writes ``<out>/serve_latency.json`` and ``.md``.

    python -m benchmarks.serve_latency [--model smollm2-135m-instruct] [--stages 1 3]
        [--rounds 5] [--max-tokens 32] [--question TEXT] [--threads 1] [--sampled]
        [--out benchmarks/out]
        [--serve-arg ARG]...

``ServerProcess`` (a ``dgr serve`` or ``llama-server`` process, started and stopped, its URL
read from its own output) is what the end-to-end tests of ``dgr serve`` use too.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import httpx2 as httpx

from dgr_engine.client.text import prompt_ids
from dgr_engine.options import EngineOptions
from dgr_engine.tokenizer import Tokenizer

SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 7}
"""``--sampled``: what a chat client sends (issue 49)."""
QUESTION = "Explain in three sentences why the sky is blue."
"""The default question (chat-templated)."""
BENCH_OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=8)
"""The engine settings of both servers (dgr's one set of defaults; threads: ``--threads``)."""
START_TIMEOUT_S = 300.0
"""Bound on a server's start (dgr serve starts its workers first)."""
REQUEST_TIMEOUT_S = 120.0
"""Bound on one request."""


class ServerFailed(RuntimeError):
    """A server exited or did not say it was listening in time (its output's tail says why)."""


@attrs.define(eq=False)
class ServerProcess:
    """A server process and its URL; :meth:`stop` it (SIGTERM, then SIGKILL; its log removed)."""

    name: str
    proc: subprocess.Popen[str] = attrs.field(repr=False)
    url: str
    log: Path = attrs.field(repr=False)
    """Its output (stderr, and llama-server's stdout)."""

    @classmethod
    def dgr(
        cls,
        model: str,
        stages: int,
        *,
        options: EngineOptions = BENCH_OPTIONS,
        extra: Sequence[str] = (),
        timeout: float = START_TIMEOUT_S,
    ) -> ServerProcess:
        """``dgr serve --model MODEL --spawn STAGES --port 0``; ready at its URL line."""
        argv = [sys.executable, "-m", "dgr_engine.cli", "serve", "--model", model]
        argv += ["--spawn", str(stages), "--port", "0", *options.worker_argv(), *extra]
        log = Path(tempfile.mkstemp(prefix="dgr-serve-", suffix=".log")[1])
        with log.open("w") as sink:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
                env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
            )
        assert proc.stdout is not None
        line = _await_line(proc, proc.stdout, "dgr serve: http", timeout, log)
        url = line.split()[2]
        return cls(f"dgr serve --spawn {stages}", proc, url, log)

    @classmethod
    def llama_server(
        cls,
        binary: Path,
        model: Path,
        *,
        options: EngineOptions = BENCH_OPTIONS,
        timeout: float = START_TIMEOUT_S,
        cache: bool = False,
        slots: int = 1,
    ) -> ServerProcess:
        """``llama-server`` on a free loopback port, ``slots`` slots of ``options``' context
        each, no prompt cache (``cache``: its own, as it runs by default); ready once it has
        loaded the model and listens."""
        port = _free_port()
        threads = str(options.n_threads)
        batch = str(options.n_batch)
        argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["-t", threads, "-tb", threads, "-c", str(options.n_ctx_per_session * slots)]
        argv += ["-b", batch, "-ub", batch, "-np", str(slots)]
        if not cache:
            argv += ["--no-cache-prompt", "--cache-ram", "0"]
        argv += ["--no-webui", "--no-warmup"]
        log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
        )
        assert proc.stderr is not None
        _await_line(proc, proc.stderr, "listening on", timeout, log, after="model loaded")
        return cls("llama-server", proc, f"http://127.0.0.1:{port}", log)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` s; the exit status. Its log is removed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10.0)
        self.log.unlink(missing_ok=True)
        return int(self.proc.returncode)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _await_line(
    proc: subprocess.Popen[str],
    stream: IO[str],
    marker: str,
    timeout: float,
    log: Path,
    *,
    after: str | None = None,
) -> str:
    """The first line of ``stream`` holding ``marker`` (and after a line holding ``after``),
    read by a thread that copies every line to ``log`` and keeps reading until the stream
    ends; :class:`ServerFailed` if the process exits or ``timeout`` passes first."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        with log.open("a") as sink:
            for raw in stream:
                sink.write(raw)
                sink.flush()
                lines.put(raw.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, name=f"pump-{proc.pid}", daemon=True).start()
    deadline = time.monotonic() + timeout
    seen_after = after is None
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            break
        if line is None:
            proc.wait(10.0)
            tail = log.read_text(errors="replace")[-3000:]
            log.unlink(missing_ok=True)
            raise ServerFailed(f"exited with {proc.returncode} before listening:\n{tail}")
        seen_after = seen_after or (after is not None and after in line)
        if seen_after and marker in line:
            return line
    proc.kill()
    proc.wait(10.0)
    tail = log.read_text(errors="replace")[-3000:]
    log.unlink(missing_ok=True)
    raise ServerFailed(f"not listening after {timeout:.0f} s:\n{tail}")


# -- one request -----------------------------------------------------------------------------------


def stream_chunks(
    client: httpx.Client, url: str, path: str, body: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """The JSON chunks of one streamed (server-sent events) request ``POST url + path``, until
    ``[DONE]``; :class:`ServerFailed` for a status other than 200 or an error chunk."""
    with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise ServerFailed(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if chunk.get("error"):
                raise ServerFailed(f"{url}: {chunk['error']}")
            yield chunk


def write_result(out: Path, name: str, result: dict[str, Any], text: str) -> None:
    """Prints the table ``text`` and writes ``out/<name>.json`` and ``.md``."""
    print(text, end="")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(text)
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.md'}")


@attrs.frozen
class Timing:
    """One streamed request as the client saw it."""

    first_token_s: float
    """From sending the request to the first streamed text."""
    decode_tps: float | None
    """Tokens after the first over the time from the first text to the last (``None``: one
    token only)."""
    tokens: int
    """Completion tokens (the server's usage, else the chunks with text)."""
    text: str


def timed_completion(
    client: httpx.Client,
    url: str,
    prompt: Sequence[int],
    max_tokens: int,
    sampling: dict[str, Any] | None = None,
) -> Timing:
    """One streamed completion of ``prompt`` (token ids) at ``url``: greedy, or with the
    request fields ``sampling``."""
    body = {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        **(sampling or {}),
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": False,  # llama-server's own field: compute the prompt every time
    }
    began = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    text = []
    for chunk in stream_chunks(client, url, "/v1/completions", body):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            piece = choice.get("text") or ""
            if piece:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                chunks += 1
                text.append(piece)
    if first is None or last is None:
        raise ServerFailed(f"{url}: no text came back")
    tokens = int(usage["completion_tokens"]) if usage else chunks
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return Timing(first - began, decode, tokens, "".join(text))


# -- the benchmark ---------------------------------------------------------------------------------


@attrs.frozen
class Row:
    """One server's figures over the rounds."""

    name: str
    first_token_s: float
    """Median."""
    decode_tps: float | None
    """Median (``None``: one token only)."""
    tokens: int
    runs: tuple[float, ...]
    """Every round's first-token time, in order."""
    text: str
    """The first round's answer."""


def run_benchmark(
    *,
    model: str,
    stages: Sequence[int],
    rounds: int,
    max_tokens: int,
    question: str,
    threads: int,
    serve_args: Sequence[str] = (),
    log: Any = print,
    sampled: bool = False,
) -> dict[str, Any]:
    """Starts the servers, runs the rounds, stops every server; the result as a dict."""
    from dgr_engine.models.resolve import resolve_model
    from dgr_engine.tooling.peer_build import tool

    path = resolve_model(model, notice=lambda text: log(f"model: {text}"))
    binary = tool("llama-server", log=lambda text: log(text))
    options = attrs.evolve(BENCH_OPTIONS, n_threads=threads)
    with Tokenizer(path) as tokenizer:
        prompt = prompt_ids(tokenizer, question, chat=True)
    servers: list[ServerProcess] = []
    try:
        log("starting llama-server ...")
        servers.append(ServerProcess.llama_server(binary, path, options=options))
        for n in stages:
            log(f"starting dgr serve --spawn {n} ...")
            servers.append(ServerProcess.dgr(model, n, options=options, extra=serve_args))
        timings: dict[str, list[Timing]] = {s.name: [] for s in servers}
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            sampling = SAMPLED if sampled else None
            for server in servers:  # warm-up: not counted
                timed_completion(client, server.url, prompt, max_tokens, sampling)
            for index in range(rounds):
                order = servers[index % len(servers) :] + servers[: index % len(servers)]
                for server in order:
                    timings[server.name].append(
                        timed_completion(client, server.url, prompt, max_tokens, sampling)
                    )
                log(f"round {index + 1}/{rounds} done")
    finally:
        for server in servers:
            server.stop()
    rows = [_row(name, runs) for name, runs in timings.items()]
    peer = rows[0]
    return {
        "model": model,
        "question": question,
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "threads": threads,
        "sampling": SAMPLED if sampled else "greedy",
        "options": attrs.asdict(options),
        "rows": [
            {
                **attrs.asdict(row),
                "ratio_first_token": row.first_token_s / peer.first_token_s,
                "ratio_decode": (
                    row.decode_tps / peer.decode_tps
                    if row.decode_tps is not None and peer.decode_tps
                    else None
                ),
                "same_text_as_llama_server": row.text == peer.text,
            }
            for row in rows
        ],
    }


def _row(name: str, runs: list[Timing]) -> Row:
    decodes = [t.decode_tps for t in runs if t.decode_tps is not None]
    return Row(
        name=name,
        first_token_s=statistics.median(t.first_token_s for t in runs),
        decode_tps=statistics.median(decodes) if decodes else None,
        tokens=runs[0].tokens,
        runs=tuple(t.first_token_s for t in runs),
        text=runs[0].text,
    )


def table(result: dict[str, Any]) -> str:
    """The result as a markdown table."""
    head = (
        f"`dgr serve` against `llama-server`: {result['model']}, prompt "
        f"{result['prompt_tokens']} tokens, up to {result['max_tokens']} "
        f"{'greedy' if result['sampling'] == 'greedy' else 'sampled (T 0.7, top-p 0.9)'}, "
        f"{result['threads']} thread(s) per engine, median of {result['rounds']} round(s)\n\n"
        "| server | first token (ms) | × llama-server | decode tok/s | × llama-server | tokens "
        "| same text |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |\n"
    )
    lines = []
    for row in result["rows"]:
        decode = "-" if row["decode_tps"] is None else f"{row['decode_tps']:.1f}"
        ratio = "-" if row.get("ratio_decode") is None else f"{row['ratio_decode']:.2f}"
        lines.append(
            f"| {row['name']} | {row['first_token_s'] * 1000:.1f} | "
            f"{row['ratio_first_token']:.2f} | {decode} | {ratio} | {row['tokens']} | "
            f"{'yes' if row['same_text_as_llama_server'] else 'no'} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or GGUF")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3], help="dgr routes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--threads", type=int, default=1, help="threads per engine")
    parser.add_argument(
        "--sampled", action="store_true", help="ask as chat clients do: T 0.7, top-p 0.9, a seed"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="a further dgr serve argument"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 2 or args.threads < 1 or min(args.stages) < 1:
        print(
            "serve_latency: --rounds, --threads, --stages >= 1; --max-tokens >= 2", file=sys.stderr
        )
        return 2

    def log(text: str) -> None:
        print(f"serve_latency: {text}", file=sys.stderr, flush=True)

    try:
        result = run_benchmark(
            model=args.model,
            stages=args.stages,
            rounds=args.rounds,
            max_tokens=args.max_tokens,
            question=args.question,
            threads=args.threads,
            serve_args=args.serve_arg,
            log=log,
            sampled=args.sampled,
        )
    except ServerFailed as exc:
        print(f"serve_latency: a server failed: {exc}", file=sys.stderr)
        return 1
    write_result(args.out, "serve_latency", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
