"""llama.cpp's own tools as peers of dgr: ``llama-bench`` (whole model, or llama.cpp RPC over
``ggml-rpc-server`` processes with dgr's even layer split) and ``llama-batched-bench``, run with
the same threads, KV type and flash-attention mode as dgr, and their JSON reports parsed.

What the benchmarks (``benchmarks/peers.py``) and ``dgr certify``'s ``speed.vs_rpc`` share. The
executables come from :mod:`dgr_engine.tooling.peer_build` (the pinned, patched llama.cpp).
Every process started here is on 127.0.0.1 and stopped before the call that started it returns
(:func:`rpc_servers` is a context manager; a bench run is bounded by :data:`RUN_TIMEOUT` and
killed on any exception, Ctrl-C included).

RPC's split: the ``llama-bench`` process computes the first stage's layers; RPC's ``-ngl``
counts the output layer, so 24 layers in 2 stages is ``-ngl 13``, and ``-ts`` weights put each
further stage on its server (:func:`rpc_split`, checked against llama.cpp's own assignment by
:func:`rpc_assignment`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import attrs
import numpy as np

from dgr_engine.reference import split_points

FLASH_ATTN_CODE = {"auto": -1, "off": 0, "on": 1}
"""llama.cpp's ``llama_flash_attn_type`` values, as llama-bench's JSON reports them."""
RUN_TIMEOUT = 1800.0
"""Bound on any one peer process run (seconds)."""


# --- llama-bench JSON -------------------------------------------------------------------------


@attrs.frozen
class BenchResult:
    """One test of ``llama-bench -o json``."""

    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float
    """Tokens per second (the mean over the test's repetitions)."""
    n_threads: int
    type_k: str
    type_v: str
    flash_attn: int
    """``llama_flash_attn_type`` as requested: -1 auto, 0 off, 1 on."""
    n_gpu_layers: int
    tensor_split: str
    backends: str

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> BenchResult:
        return cls(
            n_prompt=int(item["n_prompt"]),
            n_gen=int(item["n_gen"]),
            n_depth=int(item.get("n_depth", 0)),
            avg_ts=float(item["avg_ts"]),
            n_threads=int(item["n_threads"]),
            type_k=str(item["type_k"]),
            type_v=str(item["type_v"]),
            flash_attn=_flash_attn_code(item["flash_attn"]),
            n_gpu_layers=int(item["n_gpu_layers"]),
            tensor_split=str(item.get("tensor_split", "")),
            backends=str(item.get("backends", "")),
        )


def _flash_attn_code(value: Any) -> int:
    """llama-bench writes ``flash_attn`` as an int (older builds: a bool or a mode name)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str) and value in FLASH_ATTN_CODE:
        return FLASH_ATTN_CODE[value]
    return int(value)


def parse_llama_bench(stdout: str) -> list[BenchResult]:
    """The tests of ``llama-bench -o json`` output (a JSON array on stdout; anything printed
    before it is skipped). ``ValueError`` when there is no array or a test lacks a field."""
    start = stdout.find("[")
    while start != -1:
        try:
            items = json.loads(stdout[start:])
        except json.JSONDecodeError:
            start = stdout.find("[", start + 1)
            continue
        if not isinstance(items, list):
            break
        try:
            return [BenchResult.from_json(item) for item in items]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"llama-bench JSON test lacks a field: {exc!r}") from exc
    raise ValueError(f"no llama-bench JSON array in its output: {stdout[:200]!r}")


def pick(results: Sequence[BenchResult], n_prompt: int, n_gen: int, n_depth: int) -> BenchResult:
    """The one test with these sizes (``LookupError`` if absent)."""
    for result in results:
        if (result.n_prompt, result.n_gen, result.n_depth) == (n_prompt, n_gen, n_depth):
            return result
    raise LookupError(f"llama-bench gave no test pp {n_prompt} tg {n_gen} depth {n_depth}")


def parse_batched_bench(text: str) -> dict[int, dict[str, Any]]:
    """``llama-batched-bench --output-format jsonl`` lines by ``pl`` (sequences)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and "pl" in item and "speed_tg" in item:
            rows[int(item["pl"])] = item
    if not rows:
        raise ValueError(f"no llama-batched-bench jsonl rows in its output: {text[-400:]!r}")
    return rows


# --- RPC split arithmetic ---------------------------------------------------------------------


def rpc_split(n_layer: int, stages: int) -> tuple[int, list[float]]:
    """``(-ngl, -ts weights)`` that make llama.cpp RPC run :func:`split_points` ``(n_layer,
    stages)``: the local (llama-bench) process keeps the first range, server ``d`` the
    ``d + 1``-th, the last server also the output layer (which ``-ngl`` counts as a layer).
    Weights put each split point half a layer before a boundary, so float rounding in
    llama.cpp's ``upper_bound`` cannot move a layer; one server needs no weights (``[]``)."""
    if stages < 2:
        raise ValueError("RPC needs at least 2 stages (1 local + 1 server)")
    layout = split_points(n_layer, stages)
    local = layout[0][1]
    ngl = n_layer - local + 1
    if stages == 2:
        return ngl, []
    ends = [end - local for _, end in layout[1:-1]]  # offsets where servers 1.. start
    points = [end - 0.5 for end in ends] + [float(ngl)]
    weights = [points[0]] + [b - a for a, b in zip(points, points[1:], strict=False)]
    return ngl, weights


def rpc_assignment(n_layer: int, ngl: int, weights: Sequence[float], n_devices: int) -> list[int]:
    """Device of layers ``0..n_layer`` (``n_layer``: the output layer) as llama.cpp's
    ``llama_model::load_tensors`` assigns them at the pinned commit (float32 arithmetic):
    ``-1`` the local CPU, else the index of the RPC device."""
    splits = np.zeros(n_devices, dtype=np.float32)
    if weights and any(w != 0 for w in weights):
        splits[:] = np.asarray(weights, dtype=np.float32)
    else:
        splits[:] = np.float32(1.0)  # equal free memory: an even split
    cumulative = np.cumsum(splits, dtype=np.float32)
    cumulative = (cumulative / cumulative[-1]).astype(np.float32)
    start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= act:
            out.append(-1)
            continue
        x = np.float32(il - start) / np.float32(act)
        out.append(int(np.searchsorted(cumulative, x, side="right")))
    return out


def ts_arg(weights: Sequence[float]) -> str:
    """``-ts`` value: weights joined by ``/``."""
    return "/".join(f"{w:g}" for w in weights)


# --- peer processes ---------------------------------------------------------------------------


def peer_env() -> dict[str, str]:
    """The peers' environment: ``OMP_WAIT_POLICY=PASSIVE`` as for dgr."""
    return dict(os.environ, OMP_WAIT_POLICY="PASSIVE")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RpcEndpoint(Protocol):
    """Where ``llama-bench`` reaches an RPC server: the server itself, or a proxy before it."""

    @property
    def endpoint(self) -> str:
        """``host:port``."""
        ...


@attrs.frozen
class Endpoint:
    """An :class:`RpcEndpoint` by its address (a WAN proxy's in front of a server)."""

    endpoint: str


class RpcServer:
    """One ``ggml-rpc-server`` on 127.0.0.1 (it serves one client at a time)."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, stderr: IO[bytes]) -> None:
        self.proc = proc
        self.port = port
        self._stderr = stderr

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, binary: Path, threads: int, timeout: float = 60.0) -> RpcServer:
        """Starts a server on a free port and waits (bounded) until it accepts connections;
        ``RuntimeError`` if it cannot (it is stopped first). Up to 3 ports are tried."""
        error = ""
        for _ in range(3):
            port = _free_port()
            stderr = tempfile.TemporaryFile()
            proc = subprocess.Popen(
                [str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=peer_env(),
            )
            server = cls(proc, port, stderr)
            try:
                if server._await_listening(timeout):
                    return server
            except BaseException:
                server.stop()
                raise
            error = server.stderr_text()
            server.stop()
        raise RuntimeError(f"ggml-rpc-server did not start: {error[-800:]}")

    def _await_listening(self, timeout: float) -> bool:
        """True once a connection is accepted (the probe closes at once: the server drops it
        and waits for the next client); False if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return True
            except OSError:
                pass
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.05)  # bounded pause that also notices an exit
        raise TimeoutError(f"ggml-rpc-server on port {self.port} not listening in {timeout} s")

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        self._stderr.close()


@contextlib.contextmanager
def rpc_servers(binary: Path, count: int, threads: int) -> Iterator[list[RpcServer]]:
    servers: list[RpcServer] = []
    try:
        for _ in range(count):
            servers.append(RpcServer.start(binary, threads))
        yield servers
    finally:
        for server in servers:
            server.stop()


_FA_RESOLVED_RE = re.compile(r"Flash Attention (enabled|not supported)")


def resolved_flash_attn(log: str) -> str | None:
    """What llama.cpp resolved flash attention to (``on``/``off``) from a log of its context
    set-up (``resolve_fused_ops: Flash Attention enabled``); ``None`` if the log does not say
    (flash attention not ``auto``, or a quiet run)."""
    found = _FA_RESOLVED_RE.findall(log)
    if not found:
        return None
    return "on" if all(f == "enabled" for f in found) else "off"


@attrs.frozen
class PeerConfig:
    """What every peer run shares."""

    model: Path
    bench: Path
    batched: Path
    threads: int
    kv_type: str
    flash_attn: str
    n_batch: int

    def common(self) -> list[str]:
        kv, fa, nb = self.kv_type, self.flash_attn, str(self.n_batch)
        return ["-t", str(self.threads), "-ctk", kv, "-ctv", kv, "-fa", fa, "-b", nb, "-ub", nb]


def llama_bench_argv(
    config: PeerConfig,
    prompts: Sequence[int],
    n_gen: int,
    depths: Sequence[int],
    *,
    servers: Sequence[RpcEndpoint] = (),
    n_layer: int = 0,
    verbose: bool = False,
) -> list[str]:
    """The command line of one ``llama-bench`` run (1 repetition per test); with ``servers``,
    RPC over them with the first stage local (:func:`rpc_split`)."""
    argv = [str(config.bench), "-m", str(config.model), "-o", "json", "-r", "1"]
    if verbose:
        argv += ["-v", "--no-warmup"]
    argv += config.common()
    argv += ["-p", ",".join(map(str, prompts)), "-n", str(n_gen)]
    argv += ["-d", ",".join(map(str, depths))]
    if servers:
        ngl, weights = rpc_split(n_layer, len(servers) + 1)
        argv += ["-rpc", ",".join(s.endpoint for s in servers), "-ngl", str(ngl)]
        if weights:
            argv += ["-ts", ts_arg(weights)]
    else:
        argv += ["-ngl", "0"]
    return argv


def run_llama_bench(
    config: PeerConfig,
    prompts: Sequence[int],
    n_gen: int,
    depths: Sequence[int],
    *,
    servers: Sequence[RpcEndpoint] = (),
    n_layer: int = 0,
    verbose: bool = False,
) -> tuple[list[BenchResult], str]:
    """One ``llama-bench`` run (:func:`llama_bench_argv`). Returns the tests and its stderr
    (llama.cpp's log only with ``verbose``: a probe run, never a timed one)."""
    argv = llama_bench_argv(
        config, prompts, n_gen, depths, servers=servers, n_layer=n_layer, verbose=verbose
    )
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=peer_env(), check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama-bench failed (exit {proc.returncode}): {' '.join(argv)}\n{proc.stderr[-1500:]}"
        )
    return parse_llama_bench(proc.stdout), proc.stderr


async def run_llama_bench_async(
    config: PeerConfig,
    prompts: Sequence[int],
    n_gen: int,
    depths: Sequence[int],
    *,
    servers: Sequence[RpcEndpoint] = (),
    n_layer: int = 0,
) -> list[BenchResult]:
    """:func:`run_llama_bench` for an event loop: the process is killed and reaped when the
    caller is cancelled (Ctrl-C) or :data:`RUN_TIMEOUT` passes (``TimeoutError``);
    ``RuntimeError`` when it fails, ``ValueError`` when its output is not its JSON."""
    argv = llama_bench_argv(config, prompts, n_gen, depths, servers=servers, n_layer=n_layer)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=peer_env(),
    )
    try:
        async with asyncio.timeout(RUN_TIMEOUT):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama-bench failed (exit {proc.returncode}): {' '.join(argv)}\n"
            f"{err.decode(errors='replace')[-1500:]}"
        )
    return parse_llama_bench(out.decode(errors="replace"))


def settings_differ(result: BenchResult, config: PeerConfig) -> str | None:
    """What in a peer's own report differs from what it was given (threads, KV type,
    flash-attention mode), or ``None`` when nothing does."""
    wanted = {
        "threads": (result.n_threads, config.threads),
        "type_k": (result.type_k, config.kv_type),
        "type_v": (result.type_v, config.kv_type),
        "flash_attn": (result.flash_attn, FLASH_ATTN_CODE[config.flash_attn]),
    }
    bad = [f"{k} {got} (wanted {want})" for k, (got, want) in wanted.items() if got != want]
    return "; ".join(bad) or None


def run_batched_bench(
    config: PeerConfig, prompt: int, n_gen: int, sequences: Sequence[int], verbose: bool = False
) -> tuple[dict[int, dict[str, Any]], str]:
    """One ``llama-batched-bench`` run on the whole model: rows by sequence count, and its
    stderr (llama.cpp's log only with ``verbose``: a probe run, never a timed one)."""
    n_ctx = max(sequences) * (prompt + n_gen) + 64
    argv = [str(config.batched), "-m", str(config.model), "-c", str(n_ctx)]
    argv += [*config.common(), "-tb", str(config.threads), "-ngl", "0"]
    argv += ["-npp", str(prompt), "-ntg", str(n_gen), "-npl", ",".join(map(str, sequences))]
    argv += ["--output-format", "jsonl", *(["-v"] if verbose else [])]
    # Its rows come through llama.cpp's asynchronous log, which the peers' own patch
    # (patches/peers/0001) drains before exit: a run that exits 0 has printed every row.
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=peer_env(), check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama-batched-bench failed (exit {proc.returncode}): {' '.join(argv)}\n"
            f"{proc.stderr[-1500:]}"
        )
    try:
        rows = parse_batched_bench(proc.stdout + "\n" + proc.stderr)
    except ValueError:  # not one row
        rows = {}
    missing = sorted(set(sequences) - set(rows))
    if missing:
        raise RuntimeError(
            f"llama-batched-bench gave no row for {missing} sequences: {' '.join(argv)}\n"
            f"{(proc.stdout + proc.stderr)[-1500:]}"
        )
    return rows, proc.stderr


_KV_LOG_RE = re.compile(r"llama_kv_cache:.*K \((\w+)\)")


def kv_type_from_log(log: str) -> str | None:
    """The K cache type llama.cpp logged (``llama_kv_cache: ... K (f16): ...``)."""
    m = _KV_LOG_RE.search(log)
    return m.group(1) if m else None
