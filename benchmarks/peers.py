"""dgr against llama.cpp's own tools, side by side in one run: the peers in the benchmark.

The peers are built from the same pinned, patched llama.cpp as dgr's engines
(``dgr_engine/tooling/peer_build.py``, cached; ``python -m benchmarks.peer_build``) and run by
``dgr_engine/tooling/rpc_peer.py``. Every computing process gets the same threads
(``--threads``, default 1), ``OMP_WAIT_POLICY=PASSIVE``, the same KV type and flash-attention
mode (default f16 and auto: llama.cpp's defaults); the peers' own reports are checked for it.

* **Decode and prefill tok/s** (prompt ``--prompt``, ``--decode`` steps after it):
  ``llama-bench`` on the whole model against dgr's whole model in-process (``ShardEngine``, as
  ``benchmarks/pipeline.py`` drives it); llama.cpp RPC at 2 and 4 stages (``ggml-rpc-server``
  processes on 127.0.0.1 plus the ``llama-bench`` process, which computes the first stage's
  layers: RPC's ``-ngl`` counts the output layer, so 24 layers in 2 stages is ``-ngl 13``, and
  ``-ts`` splits the rest evenly over the servers) against dgr routes of ``dgr worker``
  processes with the same even layer ranges (``SessionManager`` over ``GrpcStageTransport``,
  the client relay, and over ``ChainStageTransport(ring=True)``, the ring of ``docs/chain.md``:
  ``--transports``); and ``ring-native``: the ring over native links (``docs/native-path.md``:
  the frames run from socket to socket on the engines' own threads).
  llama-bench decodes at depth ``--prompt`` (``-d``), as dgr decodes after its prompt.
* **Sampled decode** (``--sampled on``, the default): at each stage count a session sampling as
  chat clients do (temperature 0.7, top-p 0.9, seeded: ``benchmarks.speculative.SAMPLED``)
  over the path dgr takes by default on these stages, the native ring (its last stage
  samples, ``docs/sampling.md``), against RPC's greedy decode at the same split (target >= 1.0
  x) and against dgr's greedy decode over the same path (target >= 0.95 x; issue 49); its
  tokens are checked against the whole model's with the same sampler.
* **Aggregate decode tok/s at 1, 4 and 8 concurrent sessions**: ``llama-batched-bench`` on the
  whole model (``-npl 1,4,8``: that many sequences decoded together in one batch) against a
  2-stage dgr route driving that many sessions at once; ``--worker-arg`` is passed to these
  workers, and the rows are run both without co-batching (``plain``) and with it
  (``co-batch``: ``--batching co-batch``, an engine option and part of the lane, certified as
  such). dgr's figure is the tokens
  stamped while every session was decoding, over that window.
* **Recovery against position**: ``benchmarks/recovery.py``'s measurement (the last stage of a
  2-stage route SIGKILLed at ``k`` accepted tokens; recovery against one batched prefill of the
  same rows on the recovered route), batched replay. The peers have no recovery (a lost
  rpc-server ends llama.cpp's run); beside it, what RPC's 2-stage prefill of the same rows
  takes: the least a restarted peer would spend, before reloading the model.
* **Time to first token** of the same prompt, in the decode/prefill rounds: dgr's whole model,
  its prompt forward and greedy token (``pipeline.whole_model``'s prefill); dgr's routes, from
  ``SessionManager.start`` to the first accepted token (the opens, the prefill through every
  stage, the token: ``benchmarks/first_token.py``); llama-bench and RPC, the prompt test's
  time (prompt / its prefill tok/s: the prompt decoded, the last row's logits computed, which
  the first token is chosen from; inside the process, after loading).
* **Peak RSS per shard** of the whole model and of each layout's shards, each loaded alone in a
  process of its own (``benchmarks/shard_memory.py``: 1 session, 512 positions), against its
  weights + KV + 64 MiB: met or missed per shard (a second table; no peer).

Interleaved rounds: each round runs every contender once, the order rotated from round to round,
after a warm-up round of dgr's contenders (the peers warm up inside each run); figures are the
median of ``--repeats`` rounds. Recovery runs once per ``k``. dgr's tokens are checked against
the whole model (routes, every concurrent session, recovery); the peers report no tokens.

Prints one table (dgr, nearest peer, dgr / peer, target, met / missed), saves
``benchmarks/out/peers.json`` and ``benchmarks/out/peers.png`` (matplotlib when installed, else
plain bars). Targets (issue 15): dgr >= 1.0 x RPC decode at 2 and at 4 stages; 8 sessions on a
2-stage route >= 0.9 x llama-batched-bench with 8 sequences and >= 3 x one session; batched
recovery <= 1.3 x one prefill of the same rows + 0.3 s.

    python -m benchmarks.peers [--fixture mid-llama | --model NAME|PATH] [--threads 1]
        [--prompt 128] [--decode 64] [--repeats 5] [--stages 2 4] [--sessions 1 4 8]
        [--accepted 16,128,400] [--worker-arg ARG]... [--co-batch on|off]
        [--transports relay ring] [--lock FILE --evidence DIR --sign-key FILE] [--out DIR]

``--model`` takes a real model (a catalog name of ``dgr models list``, fetched when needed, or a
GGUF file); its lane is certified (or its record reused) under ``--lock``, which must declare it
(``benchmarks/model_arg.py``).

**Fixture (or real-model) figures on this shared 2-core machine**: every route worker,
rpc-server, the client and the peers share the same cores (a 2-stage route runs 2 computing
processes at 1 thread each, the whole model 1), and other work on the machine lands on
whichever contender is running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before the engine loads libgomp

from benchmarks import hop_cost, recovery, shard_memory  # noqa: E402
from benchmarks.concurrent_route import ConcurrentRoute  # noqa: E402
from benchmarks.first_token import FirstTokenRouteBench, peer_ttft_s  # noqa: E402
from benchmarks.model_arg import BenchModel, BenchModelError, add_model_arguments  # noqa: E402
from benchmarks.model_arg import resolve as resolve_model  # noqa: E402
from benchmarks.pipeline import Speed, _plain_png, _prompt, whole_model  # noqa: E402
from benchmarks.speculative import SAMPLED  # noqa: E402
from dgr_engine.engine import ShardEngine  # noqa: E402
from dgr_engine.engine.sampling import SeededSampler  # noqa: E402
from dgr_engine.numerics import FLASH_ATTN_MODES, KV_TYPES  # noqa: E402
from dgr_engine.options import EngineOptions  # noqa: E402
from dgr_engine.reference import split_points, whole_model_greedy, whole_model_sampled  # noqa: E402
from dgr_engine.tooling import peer_build  # noqa: E402
from dgr_engine.tooling.rpc_peer import (  # noqa: E402
    FLASH_ATTN_CODE,
    BenchResult,
    PeerConfig,
    kv_type_from_log,
    pick,
    resolved_flash_attn,
    rpc_servers,
    run_batched_bench,
    run_llama_bench,
)

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE_NOTE = (
    "fixture evidence on this shared 2-core machine: route workers, rpc-servers, the client and "
    "the peers share the same cores"
)
"""The figures' label for a fixture run (a real model's: :func:`evidence_note`)."""
MIB = 1024 * 1024
DECODE_TARGET = 1.0
"""dgr decode >= this x RPC decode at the same number of stages."""
SAMPLED_TRANSPORT = "ring-native"
"""The path a sampled session takes by default on these stages (``docs/data-paths.md``: the
native ring, since every loopback ``dgr worker`` offers native links)."""
SAMPLED_NATIVE_TARGET = 0.95
"""Sampled decode on the default path >= this x greedy decode on the native ring (issue 49)."""
AGG_PEER_TARGET = 0.9
"""8 sessions on a 2-stage route >= this x llama-batched-bench with 8 sequences."""
AGG_SCALE_TARGET = 3.0
"""8 sessions on a 2-stage route >= this x one session."""


@attrs.frozen
class Variant:
    """One way of running the aggregate rows' workers."""

    name: str
    batching: str | None
    """``EngineOptions.batching`` (part of the lane, so certified as such); ``None``: leave it."""
    args: tuple[str, ...]
    """Further ``dgr worker`` arguments."""

    def options(self, options: EngineOptions) -> EngineOptions:
        if self.batching is None:
            return options
        return attrs.evolve(options, batching=self.batching)


# --- the run ----------------------------------------------------------------------------------


def evidence_note(model: BenchModel) -> str:
    """How to read the figures of a run on ``model``."""
    if model.is_fixture:
        return EVIDENCE_NOTE
    return (
        f"real-model figures ({model.label}) on this shared {os.cpu_count()}-core machine: route "
        "workers, rpc-servers, the client and the peers share the same cores, and other work "
        "runs on the machine concurrently"
    )


@attrs.frozen
class Settings:
    fixture: str
    """The model's label: a fixture's name, a catalog name or a GGUF's file name."""
    threads: int
    prompt: int
    decode: int
    repeats: int
    stages: tuple[int, ...]
    sessions: tuple[int, ...]
    accepted: tuple[int, ...]
    kv_type: str
    flash_attn: str
    variants: tuple[Variant, ...]
    """How the aggregate rows' workers run (without, and where available with, co-batching)."""
    transports: tuple[str, ...] = ("relay",)
    """How dgr's decode and prefill routes carry frames: ``relay`` (the client relays every
    boundary), ``chain`` or ``ring`` (``docs/chain.md``)."""
    sampled: bool = False
    """Also a sampled route per stage count (:data:`SAMPLED_TRANSPORT`, :data:`SAMPLED`)."""


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


async def speed_rounds(
    s: Settings,
    path: Path,
    n_layer: int,
    options: EngineOptions,
    config: PeerConfig,
    rpc_binary: Path,
    prompt: list[int],
    sampled_tokens: Sequence[int] = (),
) -> dict[str, Any]:
    """Decode and prefill of every contender in interleaved rounds (``sampled_tokens``: what
    the whole model's tokens are with :data:`SAMPLED`, for the sampled routes)."""
    benches = {
        f"{n}{'' if t == 'relay' else ' ' + t}": FirstTokenRouteBench(
            path, split_points(n_layer, n), options, transport=t
        )
        for n in s.stages
        for t in s.transports
    }
    if s.sampled:
        for n in s.stages:
            benches[f"{n} sampled"] = FirstTokenRouteBench(
                path,
                split_points(n_layer, n),
                options,
                transport=SAMPLED_TRANSPORT,
                sampler=SeededSampler(SAMPLED),
            )
    runs: dict[str, list[tuple[float, float, float]]] = {}  # prefill tok/s, decode tok/s, TTFT s
    parts: dict[str, list[Mapping[str, float]]] = {}  # a dgr route's ms per decode token, by part
    tokens_equal: dict[str, bool] = {}
    peer_checks: list[dict[str, Any]] = []
    whole_tokens: list[int] = []
    contenders = ["dgr whole", "llama-bench whole"]
    for n in s.stages:
        contenders += [f"dgr {key}" for key in benches if key.split(" ")[0] == str(n)]
        contenders += [f"rpc {n}"]
    try:
        for bench in benches.values():
            await bench.start()
        with (
            ShardEngine(path, **options.engine_kwargs()) as engine,
            rpc_servers(rpc_binary, max(s.stages) - 1, s.threads) as servers,
        ):
            for name in contenders:  # what the peers resolve flash attention to: a quiet probe
                kind, _, which = name.partition(" ")
                if kind == "dgr":
                    continue
                stages = 1 if which == "whole" else int(which)
                results, log = await asyncio.to_thread(
                    run_llama_bench,
                    config,
                    [8],
                    0,
                    [0],
                    servers=servers[: stages - 1],
                    n_layer=n_layer,
                    verbose=True,
                )
                peer_checks.append(_bench_check(name, results[0], log, config))
            for round_ in range(s.repeats + 1):
                shift = round_ % len(contenders)
                for name in contenders[shift:] + contenders[:shift]:
                    kind, _, which = name.partition(" ")
                    if round_ == 0 and kind != "dgr":
                        continue  # the peers warm up inside each run
                    if name == "dgr whole":
                        pre, dec, toks = whole_model(engine, 1000 + round_, prompt, s.decode)
                        whole_tokens = whole_tokens or toks
                        tokens_equal[name] = tokens_equal.get(name, True) and toks == whole_tokens
                        figures = (s.prompt / pre, s.decode / dec, pre)
                    elif kind == "dgr":
                        timed = await benches[which].timed_run(prompt, s.decode)
                        run = timed.run
                        if which.endswith(" sampled"):
                            ok = run.tokens == list(sampled_tokens)
                        else:
                            ok = whole_tokens == [] or run.tokens == whole_tokens
                        tokens_equal[name] = tokens_equal.get(name, True) and ok
                        figures = (s.prompt / run.prefill_s, s.decode / run.decode_s, timed.ttft_s)
                        if round_:
                            parts.setdefault(name, []).append(run.parts_ms)
                    else:
                        stages = 1 if which == "whole" else int(which)
                        results, log = await asyncio.to_thread(
                            run_llama_bench,
                            config,
                            [s.prompt],
                            s.decode,
                            [0, s.prompt],
                            servers=servers[: stages - 1],
                            n_layer=n_layer,
                        )
                        pp = pick(results, s.prompt, 0, 0)
                        tg = pick(results, 0, s.decode, s.prompt)
                        figures = (pp.avg_ts, tg.avg_ts, peer_ttft_s(s.prompt, pp.avg_ts))
                        if round_ == 1:  # the timed run's own report
                            peer_checks.append(_bench_check(name, tg, "", config))
                    if round_:
                        runs.setdefault(name, []).append(figures)
    finally:
        for bench in benches.values():
            await bench.aclose()
    speeds = {
        name: {
            "prefill_tps": _median([p for p, _, _ in got]),
            "decode_tps": _median([d for _, d, _ in got]),
            "ttft_s": _median([t for _, _, t in got]),
            "rounds": [{"prefill_tps": p, "decode_tps": d, "ttft_s": t} for p, d, t in got],
            "parts_ms": {part: _median([r[part] for r in parts[name]]) for part in parts[name][0]}
            if parts.get(name)
            else {},
        }
        for name, got in runs.items()
    }
    return {"speeds": speeds, "tokens_equal": tokens_equal, "peer_checks": peer_checks}


def _bench_check(name: str, tg: BenchResult, log: str, config: PeerConfig) -> dict[str, Any]:
    """What the peer reported using, against what dgr was given (``log``: llama.cpp's log of a
    verbose probe run, else empty)."""
    fa_wanted = FLASH_ATTN_CODE[config.flash_attn]
    return {
        "peer": name if log else f"{name} (timed run)",
        "n_threads": tg.n_threads,
        "type_k": tg.type_k,
        "type_v": tg.type_v,
        "flash_attn": tg.flash_attn,
        "flash_attn_resolved": resolved_flash_attn(log),
        "kv_logged": kv_type_from_log(log),
        "n_gpu_layers": tg.n_gpu_layers,
        "tensor_split": tg.tensor_split,
        "backends": tg.backends,
        "same": tg.n_threads == config.threads
        and tg.type_k == config.kv_type
        and tg.type_v == config.kv_type
        and tg.flash_attn == fa_wanted
        and kv_type_from_log(log) in (None, config.kv_type),
    }


_PROBE = """
import sys
import numpy as np
from dgr_engine.engine import ShardEngine
from dgr_engine.options import EngineOptions
options = EngineOptions(**{k: (int(v) if v.isdigit() else v) for k, v in
                           (a.split("=", 1) for a in sys.argv[3:])})
a, b = (int(x) for x in sys.argv[2].split(":"))
with ShardEngine(sys.argv[1], layers=(a, b), **options.engine_kwargs()) as engine:
    engine.open_session(1, 0)
    width = engine.info.in_width
    if width:
        engine.forward(1, 0, [0], rows=np.zeros((1, width), dtype=np.float32))
    else:
        engine.forward(1, 0, [0], tokens=[1])
"""


def dgr_resolved_flash_attn(path: Path, options: EngineOptions, layers: tuple[int, int]) -> Any:
    """What dgr's engine (the same llama.cpp, ``DGR_LLAMA_LOG=1``) resolves flash attention to
    for ``layers``, from its log; ``None`` if it does not say, an error text if the probe
    fails."""
    argv = [sys.executable, "-c", _PROBE, str(path), f"{layers[0]}:{layers[1]}"]
    argv += [f"{k}={v}" for k, v in attrs.asdict(options).items()]
    env = dict(os.environ, DGR_LLAMA_LOG="1")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, check=False)
    if proc.returncode != 0:
        return f"probe failed: {proc.stderr.strip().splitlines()[-1:]}"
    return resolved_flash_attn(proc.stderr)


async def aggregate_rounds(
    s: Settings,
    path: Path,
    n_layer: int,
    options: EngineOptions,
    config: PeerConfig,
    prompts: list[list[int]],
    references: list[list[int]],
) -> dict[str, Any]:
    """Aggregate decode tok/s at each session count: llama-batched-bench against each variant
    of a 2-stage dgr route, interleaved."""
    layout = split_points(n_layer, 2)
    routes = {v.name: ConcurrentRoute(path, layout, v.options(options), v.args) for v in s.variants}
    got: dict[str, dict[int, list[float]]] = {}
    exact: dict[str, dict[int, int]] = {name: {} for name in routes}
    peer_checks: list[dict[str, Any]] = []
    contenders = ["batched-bench", *routes]
    try:
        for route in routes.values():
            await route.start()
        # what it resolves flash attention to and the KV type it logs: a quiet probe
        rows, log = await asyncio.to_thread(run_batched_bench, config, 8, 1, [1], True)
        peer_checks.append(_batched_check(rows[1], log, config))
        for round_ in range(s.repeats + 1):
            shift = round_ % len(contenders)
            for name in contenders[shift:] + contenders[:shift]:
                if name == "batched-bench":
                    if round_ == 0:
                        continue
                    rows, log = await asyncio.to_thread(
                        run_batched_bench, config, s.prompt, s.decode, s.sessions
                    )
                    for n in s.sessions:
                        got.setdefault(name, {}).setdefault(n, []).append(
                            float(rows[n]["speed_tg"])
                        )
                    if round_ == 1:  # the timed run's own report
                        peer_checks.append(_batched_check(rows[max(s.sessions)], "", config))
                    continue
                for n in s.sessions:
                    tps, tokens = await routes[name].run(prompts[:n], s.decode)
                    equal = sum(t == r for t, r in zip(tokens, references[:n], strict=True))
                    exact[name][n] = min(exact[name].get(n, n), equal)
                    if round_:
                        got.setdefault(name, {}).setdefault(n, []).append(tps)
    finally:
        for route in routes.values():
            await route.aclose()
    return {
        "tps": {name: {n: _median(v) for n, v in by_n.items()} for name, by_n in got.items()},
        "rounds": got,
        "tokens_exact": exact,
        "peer_checks": peer_checks,
    }


def _batched_check(row: dict[str, Any], log: str, config: PeerConfig) -> dict[str, Any]:
    """What llama-batched-bench reported using (``log``: a verbose probe's, else empty)."""
    return {
        "peer": "llama-batched-bench" if log else "llama-batched-bench (timed run)",
        "n_threads": row.get("n_threads"),
        "n_threads_batch": row.get("n_threads_batch"),
        "flash_attn": row.get("flash_attn"),
        "flash_attn_resolved": resolved_flash_attn(log),
        "kv_logged": kv_type_from_log(log),
        "same": row.get("n_threads") == config.threads
        and row.get("n_threads_batch") == config.threads
        and row.get("flash_attn") == FLASH_ATTN_CODE[config.flash_attn]
        and kv_type_from_log(log) in (None, config.kv_type),
    }


def recovery_rows(
    s: Settings,
    path: Path,
    n_layer: int,
    options: EngineOptions,
    config: PeerConfig,
    rpc_binary: Path,
    n_vocab: int,
) -> list[dict[str, Any]]:
    """``benchmarks.recovery``'s measurement at each ``k`` (batched replay), its tokens checked
    against the whole model, and RPC's 2-stage prefill of the same rows."""
    if not s.accepted:
        return []
    layout = split_points(n_layer, 2)
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, n_vocab, size=recovery.PROMPT_LEN)]
    (reference,) = whole_model_greedy(path, [prompt], max(s.accepted) + recovery.AFTER, options)
    rows = []
    for k in s.accepted:
        run = asyncio.run(recovery._one(path, layout, options, prompt, k, "batched"))
        run["exact"] = run.pop("tokens") == reference[: k + recovery.AFTER]
        run["rows"] = recovery.PROMPT_LEN + k
        run["target_s"] = 1.3 * run["prefill_s"] + 0.3
        run["met"] = run["recovery_s"] <= run["target_s"]
        rows.append(run)
    with rpc_servers(rpc_binary, 1, s.threads) as servers:
        results, _ = run_llama_bench(
            config, [r["rows"] for r in rows], 0, [0], servers=servers, n_layer=n_layer
        )
    for row in rows:
        row["rpc_prefill_s"] = row["rows"] / pick(results, row["rows"], 0, 0).avg_ts
    return rows


# --- the table --------------------------------------------------------------------------------


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds:.3f} s"


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def table_rows(
    s: Settings, speeds: dict[str, Any], agg: dict[str, Any], rec: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The table's rows: name, dgr, peer, ratio, target, met (None: no target)."""
    rows: list[dict[str, Any]] = []
    sp = speeds["speeds"]
    whole_d, whole_p = sp["dgr whole"], sp["llama-bench whole"]

    def add(
        name: str,
        dgr: float,
        dgr_text: str,
        peer: float | None,
        peer_text: str,
        target: str = "",
        met: bool | None = None,
    ) -> None:
        rows.append(
            {
                "name": name,
                "dgr": dgr,
                "dgr_text": dgr_text,
                "peer": peer,
                "peer_text": peer_text,
                "ratio": None if peer is None else dgr / peer,
                "target": target,
                "met": met,
            }
        )

    for metric, key, label in (
        ("decode", "decode_tps", "decode tok/s"),
        ("prefill", "prefill_tps", f"prefill {s.prompt} tok/s"),
    ):
        add(
            f"{label}, whole model",
            whole_d[key],
            f"{whole_d[key]:.1f}",
            whole_p[key],
            f"llama-bench: {whole_p[key]:.1f}",
        )
        for n in s.stages:
            for transport in s.transports:
                mode = "" if transport == "relay" else f" {transport}"
                d, p = sp[f"dgr {n}{mode}"][key], sp[f"rpc {n}"][key]
                ratio = d / p
                target, met = ("", None)
                if metric == "decode":
                    target = f"dgr >= {DECODE_TARGET:.1f} x RPC"
                    met = ratio >= DECODE_TARGET
                add(
                    f"{label}, {n} stages{' [' + transport + ']' if mode else ''} (ratio to whole)",
                    d,
                    f"{d:.1f} ({d / whole_d[key]:.3f})",
                    p,
                    f"RPC, same split: {p:.1f} ({p / whole_p[key]:.3f})",
                    target,
                    met,
                )
    for n in s.stages if s.sampled else ():
        d, p = sp[f"dgr {n} sampled"]["decode_tps"], sp[f"rpc {n}"]["decode_tps"]
        add(
            f"sampled decode tok/s, {n} stages [{SAMPLED_TRANSPORT}, the default path]",
            d,
            f"{d:.1f}",
            p,
            f"RPC greedy, same split: {p:.1f}",
            f"dgr >= {DECODE_TARGET:.1f} x RPC",
            d / p >= DECODE_TARGET,
        )
        greedy_native = sp.get(f"dgr {n} {SAMPLED_TRANSPORT}")
        if greedy_native is not None:
            g = greedy_native["decode_tps"]
            add(
                f"sampled decode tok/s, {n} stages, against greedy [{SAMPLED_TRANSPORT}]",
                d,
                f"{d:.1f}",
                g,
                f"dgr greedy, same path: {g:.1f}",
                f"dgr >= {SAMPLED_NATIVE_TARGET:.2f} x greedy",
                d / g >= SAMPLED_NATIVE_TARGET,
            )
    whole_t, whole_bench_t = whole_d["ttft_s"], whole_p["ttft_s"]
    add(
        f"time to first token, prompt {s.prompt} (s), whole model",
        whole_t,
        _s(whole_t),
        whole_bench_t,
        f"llama-bench prompt test: {_s(whole_bench_t)}",
    )
    for n in s.stages:
        for transport in s.transports:
            mode = "" if transport == "relay" else f" {transport}"
            d, p = sp[f"dgr {n}{mode}"]["ttft_s"], sp[f"rpc {n}"]["ttft_s"]
            add(
                f"time to first token, prompt {s.prompt} (s), {n} stages"
                + (f" [{transport}]" if mode else ""),
                d,
                _s(d),
                p,
                f"RPC prompt test, same split: {_s(p)}",
            )
    peer = agg["tps"]["batched-bench"]
    top = max(s.sessions)
    for name in (v.name for v in s.variants):
        mine = agg["tps"][name]
        for n in s.sessions:
            target, met = "", None
            if n == top:
                target = f">= {AGG_PEER_TARGET} x batched-bench {n}"
                met = mine[n] / peer[n] >= AGG_PEER_TARGET
            add(
                f"{n} session{'s' if n > 1 else ''}, 2 stages, aggregate decode tok/s [{name}]",
                mine[n],
                f"{mine[n]:.1f}",
                peer[n],
                f"llama-batched-bench, whole, {n} seq: {peer[n]:.1f}",
                target,
                met,
            )
        low = min(s.sessions)
        if top != low:
            scale, peer_scale = mine[top] / mine[low], peer[top] / peer[low]
            add(
                f"{top} sessions / {low} session, 2 stages [{name}]",
                scale,
                f"{scale:.2f} x",
                peer_scale,
                f"llama-batched-bench: {peer_scale:.2f} x",
                f">= {AGG_SCALE_TARGET:.0f} x one session",
                scale >= AGG_SCALE_TARGET,
            )
    for row in rec:
        add(
            f"recovery at {row['accepted']} accepted tokens (s)",
            row["recovery_s"],
            f"{_s(row['recovery_s'])} (dgr prefill of {row['rows']}: {_s(row['prefill_s'])})",
            None,
            f"none: RPC has no recovery (its 2-stage prefill of {row['rows']}: "
            f"{_s(row['rpc_prefill_s'])})",
            f"<= 1.3 x prefill + 0.3 s = {_s(row['target_s'])}",
            bool(row["met"]),
        )
    return rows


def print_parts_table(speeds: Mapping[str, Mapping[str, Any]]) -> None:
    """Every dgr route row's decode token, part by part (engines, and of them the part inside
    llama.cpp; the workers' own code, the transit between them, the client's code), beside its
    wall time and the Python on its critical path (everything but llama.cpp and the client)."""
    print(
        "| dgr route | ms/token | engines | of which llama.cpp | worker code | transit | client "
        "| dgr's Python and the hops (ms/token - llama.cpp - client) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, got in speeds.items():
        p = got.get("parts_ms") or {}
        if not p:
            continue
        wall = 1000 / got["decode_tps"]
        cells = " | ".join(
            f"{p[k]:.2f}" for k in ("engine", "llama.cpp", "worker", "transit", "client")
        )
        print(f"| {name} | {wall:.2f} | {cells} | {wall - p['llama.cpp'] - p['client']:.2f} |")


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print("| | dgr | nearest peer | dgr / peer | target | met |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        met = "" if r["met"] is None else _met(r["met"])
        print(
            f"| {r['name']} | {r['dgr_text']} | {r['peer_text']} | {ratio} | {r['target']} | "
            f"{met} |"
        )


def plot(
    path: Path,
    s: Settings,
    speeds: dict[str, Any],
    agg: dict[str, Any],
    rec: list[dict[str, Any]],
    title: str,
) -> str:
    """Writes the PNG; returns how (``matplotlib`` or ``plain``)."""
    sp = speeds["speeds"]
    names = ["whole", *(f"{n}" for n in s.stages)]
    dgr_keys = ["dgr whole", *(f"dgr {n}" for n in s.stages)]
    peer_keys = ["llama-bench whole", *(f"rpc {n}" for n in s.stages)]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        pairs = [
            Speed(k, 0, sp[k]["prefill_tps"], sp[k]["decode_tps"], 0.0)
            for pair in zip(dgr_keys, peer_keys, strict=True)
            for k in pair
        ]
        bars = {f"{name} {n}": v for name, by_n in agg["tps"].items() for n, v in by_n.items()}
        _plain_png(path, pairs, bars)
        return (
            "plain (matplotlib not installed: bars only, dgr and peer alternating; numbers "
            "in peers.json)"
        )
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    x = np.arange(len(names))
    for ax, key, label in (
        (axes[0], "decode_tps", "decode tok/s"),
        (axes[1], "prefill_tps", "prefill tok/s"),
    ):
        a = ax.bar(x - 0.2, [sp[k][key] for k in dgr_keys], 0.4, label="dgr", color="#2a7")
        b = ax.bar(x + 0.2, [sp[k][key] for k in peer_keys], 0.4, label="llama.cpp", color="#555")
        ax.bar_label(a, fmt="%.0f", fontsize=7)
        ax.bar_label(b, fmt="%.0f", fontsize=7)
        ax.set_xticks(x, ["whole", *(f"{n} stages" for n in s.stages)])
        ax.set_title(label)
        ax.legend(fontsize=7)
    for name, by_n in agg["tps"].items():
        axes[2].plot(list(by_n), list(by_n.values()), marker="o", label=name)
    axes[2].set_xlabel("concurrent sessions / sequences")
    axes[2].set_title("aggregate decode tok/s")
    axes[2].legend(fontsize=7)
    ks = [r["accepted"] for r in rec]
    axes[3].plot(ks, [r["recovery_s"] for r in rec], marker="o", label="dgr recovery")
    axes[3].plot(ks, [r["prefill_s"] for r in rec], marker="o", label="dgr prefill, same rows")
    axes[3].plot(ks, [r["rpc_prefill_s"] for r in rec], marker="o", label="RPC prefill, same rows")
    axes[3].plot(ks, [r["target_s"] for r in rec], ls=":", color="#c33", label="target")
    axes[3].set_xlabel("accepted tokens at the kill")
    axes[3].set_title("recovery s (RPC has none)")
    axes[3].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def certify(model: BenchModel, options: EngineOptions) -> str | None:
    """Dark lanes are unroutable: certify this lane (or reuse its record), as pipeline.py does.
    ``None`` when it passed, else the end of what ``dgr certify`` said."""
    return model.certify(options)


def memory_rows(path: Path, n_layer: int, stages: Sequence[int]) -> list[dict[str, Any]]:
    """Peak RSS of the whole model and of each shard of ``stages``' even layouts, each loaded
    alone in a process of its own (``shard_memory.shard_row``), with its budget and verdict."""
    rows = []
    for n in (1, *stages):
        for begin, end in split_points(n_layer, n):
            row = shard_memory.shard_row(path, begin, end)
            rows.append({"stages": n, **row})
            print(
                f"  peak RSS, {n} stage{'s' if n > 1 else ''} [{begin},{end}): "
                f"{row['peak_rss_bytes'] / MIB:.1f} MiB, budget {row['budget_bytes'] / MIB:.1f}",
                flush=True,
            )
    return rows


def print_memory_table(rows: Sequence[dict[str, Any]]) -> None:
    print(
        "| shard | layers | weights MiB | KV MiB | budget MiB | peak RSS MiB | RSS / budget | met |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        begin, end = r["layers"]
        where = "whole model" if r["stages"] == 1 else f"{r['stages']} stages"
        print(
            f"| {where} | [{begin},{end}) | {r['weight_bytes'] / MIB:.1f} | "
            f"{r['kv_bytes'] / MIB:.1f} | {r['budget_bytes'] / MIB:.1f} | "
            f"{r['peak_rss_bytes'] / MIB:.1f} | {r['peak_rss_bytes'] / r['budget_bytes']:.3f} | "
            f"{_met(r['met'])} |"
        )


def _all_finite(rows: Sequence[dict[str, Any]]) -> bool:
    return all(
        math.isfinite(r["dgr"])
        and r["dgr"] > 0
        and (r["peer"] is None or (math.isfinite(r["peer"]) and r["peer"] > 0))
        for r in rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_model_arguments(parser, default_fixture="mid-llama")
    parser.add_argument("--threads", type=int, default=1, help="threads per computing process")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=64, help="decode steps after the prompt")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=("relay", "chain", "ring", "chain-grpc", "ring-grpc", "ring-native"),
        default=["relay", "ring-grpc", "ring", "ring-native"],
        help="how dgr's decode/prefill routes carry frames: chain and ring over the frame link, "
        "-grpc over gRPC, -native over native links (default relay ring-grpc ring ring-native; "
        "docs/chain.md, docs/data-paths.md, docs/native-path.md)",
    )
    parser.add_argument(
        "--sampled",
        choices=("on", "off"),
        default="on",
        help=f"also decode sampled (T 0.7, top-p 0.9, seeded) over {SAMPLED_TRANSPORT}, the "
        "default path, at each stage count (default on)",
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--accepted", default="16,128,400", help="recovery k values ('' none)")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="most rows per forward, every peer's and dgr's (llama.cpp's -b and -ub; dgr's "
        "n_batch, its prompt chunk, part of the lane); default: the prompt rounded up to a "
        "power of two, at least 64. Below the prompt, dgr's chained routes pipeline the "
        "prompt's chunks along the stages (docs/chain.md)",
    )
    parser.add_argument("--kv-type", choices=KV_TYPES, default="f16")
    parser.add_argument("--flash-attn", choices=FLASH_ATTN_MODES, default="auto")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="a further `dgr worker` argument for the aggregate rows (repeat for several)",
    )
    parser.add_argument(
        "--co-batch",
        choices=("on", "off"),
        default="on",
        help="aggregate rows with the workers co-batching sessions as well (`dgr worker "
        "--batching co-batch`, default on)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.stages):
        parser.error("--stages: RPC needs at least 2 stages")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch: at least 1 row")

    began = time.monotonic()
    try:
        model = resolve_model(args, notice=lambda m: print(m, flush=True))
    except BenchModelError as exc:
        print(f"benchmarks.peers: {exc}", file=sys.stderr)
        return 2
    model.export_trust()  # the workers and this client judge the lane by the same lock
    path, note = model.path, evidence_note(model)
    accepted = tuple(int(k) for k in args.accepted.split(",") if k)
    base = tuple(args.worker_arg)
    variants = [Variant("plain" if not base else " ".join(base), None, base)]
    if args.co_batch != "off":  # workers co-batching sessions: EngineOptions.batching
        variants.append(Variant("co-batch", "co-batch", base))
    s = Settings(
        fixture=model.label,
        threads=args.threads,
        prompt=args.prompt,
        decode=args.decode,
        repeats=args.repeats,
        stages=tuple(args.stages),
        sessions=tuple(sorted(set(args.sessions))),
        accepted=accepted,
        kv_type=args.kv_type,
        flash_attn=args.flash_attn,
        variants=tuple(variants),
        transports=tuple(dict.fromkeys(["relay", *args.transports])),
        sampled=args.sampled == "on",
    )
    # one lane for every route: the context covers the speed runs and the largest recovery
    need = max(s.prompt + s.decode + 2, recovery.PROMPT_LEN + max(accepted, default=0) + 12)
    ctx = max(256, 1 << (need - 1).bit_length())
    batch = args.batch or max(64, 1 << (s.prompt - 1).bit_length())
    options = EngineOptions(
        n_threads=s.threads,
        n_ctx_per_session=ctx,
        n_batch=batch,
        max_sessions=max(s.sessions) + 2,  # a run's sessions may still be closing
        kv_type=s.kv_type,
        flash_attn=s.flash_attn,
    )
    prefix = peer_build.ensure_peers(log=lambda m: print(m, flush=True))
    config = PeerConfig(
        model=path,
        bench=prefix / "bin" / "llama-bench",
        batched=prefix / "bin" / "llama-batched-bench",
        threads=s.threads,
        kv_type=s.kv_type,
        flash_attn=s.flash_attn,
        n_batch=batch,
    )
    rpc_binary = prefix / "bin" / "ggml-rpc-server"
    print(
        f"{path.name}: {model.n_layer} layers, n_embd {model.n_embd}; {s.threads} thread(s) per "
        f"computing process, OMP_WAIT_POLICY=PASSIVE, kv {s.kv_type}, flash attention "
        f"{s.flash_attn}; prompt {s.prompt}, {s.decode} decode steps; median of {s.repeats} "
        f"interleaved rounds; {os.cpu_count()} cores shared by every process ({note})",
        flush=True,
    )
    print(f"aggregate rows: {', '.join(v.name for v in variants)}", flush=True)
    print(f"certifying the lane of {model.label} (or reusing its record)", flush=True)
    failed = certify(model, options)
    if failed is not None:
        last = failed.strip().splitlines()[-1] if failed.strip() else "no output"
        print(f"benchmarks.peers: dgr certify failed for {model.label}: {last}", file=sys.stderr)
        return 2
    left_out: dict[str, str] = {}
    for v in variants[1:]:
        if v.options(options) != options and (failed := certify(model, v.options(options))):
            print(f"aggregate rows [{v.name}] left out: its lane did not certify:\n{failed}")
            left_out[v.name] = f"its lane did not certify: {failed}"
            s = attrs.evolve(s, variants=tuple(x for x in s.variants if x is not v))
    dgr_fa = {
        f"layers {a}:{b}": dgr_resolved_flash_attn(path, options, (a, b))
        for a, b in [(0, model.n_layer), split_points(model.n_layer, 2)[1]]
    }

    prompt = _prompt(s.prompt, model.n_vocab)
    sampled_tokens: list[int] = []
    if s.sampled:
        (sampled_tokens,) = whole_model_sampled(
            path, [prompt], s.decode + 1, options, [SeededSampler(SAMPLED)]
        )
    speeds = asyncio.run(
        speed_rounds(s, path, model.n_layer, options, config, rpc_binary, prompt, sampled_tokens)
    )
    print(f"[{time.monotonic() - began:.0f} s] decode/prefill rounds done", flush=True)

    prompts = [
        [int(t) for t in np.random.default_rng(100 + i).integers(0, model.n_vocab, size=s.prompt)]
        for i in range(max(s.sessions))
    ]
    references = whole_model_greedy(path, prompts, s.decode + 1, options)
    agg = asyncio.run(
        aggregate_rounds(s, path, model.n_layer, options, config, prompts, references)
    )
    print(f"[{time.monotonic() - began:.0f} s] aggregate rounds done", flush=True)
    rec = recovery_rows(s, path, model.n_layer, options, config, rpc_binary, model.n_vocab)
    print(f"[{time.monotonic() - began:.0f} s] recovery done", flush=True)
    memory = memory_rows(path, model.n_layer, s.stages)
    print(f"[{time.monotonic() - began:.0f} s] peak RSS per shard done", flush=True)
    hops = hop_cost.measure(model.n_embd, frames=300, rounds=s.repeats)
    print(f"[{time.monotonic() - began:.0f} s] per-hop cost done", flush=True)

    rows = table_rows(s, speeds, agg, rec)
    print()
    print(f"dgr against llama.cpp's own tools ({note}):")
    print()
    print_table(rows)
    print()
    checks = speeds["peer_checks"] + agg["peer_checks"]
    print(
        f"same settings: dgr threads {s.threads}, kv {s.kv_type}, flash attention "
        f"{s.flash_attn} (requested; fa code {FLASH_ATTN_CODE[s.flash_attn]}); resolved by "
        "dgr's engine: " + ", ".join(f"{k} {v}" for k, v in dgr_fa.items())
    )
    for c in checks:
        fields = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("peer", "same"))
        print(f"  {c['peer']}: {fields} -> {'same' if c['same'] else 'DIFFERENT'}")
    resolved = {c["flash_attn_resolved"] for c in checks} | set(dgr_fa.values())
    resolved.discard(None)
    print(
        "flash attention as resolved by llama.cpp: "
        + ("the same everywhere" if len(resolved) <= 1 else "DIFFERENT")
        + f" ({', '.join(sorted(map(str, resolved))) or 'not logged'})"
    )
    print(
        "tokens equal to the whole model: "
        + ", ".join(f"{k} {v}" for k, v in speeds["tokens_equal"].items())
        + "; concurrent sessions exact (fewest over rounds): "
        + "; ".join(
            f"{name}: " + ", ".join(f"{n}: {e}/{n}" for n, e in by_n.items())
            for name, by_n in agg["tokens_exact"].items()
        )
        + "; recovery: "
        + ", ".join(f"k {r['accepted']} {r['exact']}" for r in rec)
        + " (the peers report no tokens)"
    )
    decode_targets = [r for r in rows if r["target"].startswith("dgr >=")]
    verdict = all(r["met"] for r in decode_targets)
    print(
        f"target: dgr >= {DECODE_TARGET:.1f} x RPC decode at "
        + " and at ".join(f"{n}" for n in s.stages)
        + f" stages: {_met(verdict)} ("
        + ", ".join(f"{r['ratio']:.2f}" for r in decode_targets)
        + ")"
    )
    print()
    print(
        "where a decode token's time goes, ms per token (median of the rounds; "
        "benchmarks/pipeline.py: token_parts):"
    )
    print()
    print_parts_table(speeds["speeds"])
    print()
    hop_cost.print_rows(hops)
    print()
    print(
        "peak RSS per shard, each loaded alone (1 session, "
        f"{shard_memory.CHILD_KW['n_ctx_per_session']} positions), against its weights + KV + "
        "64 MiB:"
    )
    print()
    print_memory_table(memory)
    missed = sum(not r["met"] for r in memory)
    print(
        f"target: peak RSS <= weights + KV + 64 MiB on every shard: "
        f"{_met(missed == 0)} ({len(memory) - missed} of {len(memory)} shards met)"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "fixture": s.fixture,
        "model": model.label,
        "model_kind": model.kind,
        "evidence": note,
        "settings": attrs.asdict(s),
        "cores": os.cpu_count(),
        "options": attrs.asdict(options),
        "peers_prefix": str(prefix),
        "peers_build_seconds": peer_build.build_seconds(prefix),
        "left_out": left_out,
        "dgr_flash_attn_resolved": dgr_fa,
        "flash_attn_resolved_same": len(resolved) <= 1,
        "speeds": speeds,
        "aggregate": agg,
        "recovery": rec,
        "table": rows,
        "memory": memory,
        "hop_cost": hops,
        "memory_target_met": all(r["met"] for r in memory),
        "all_finite": _all_finite(rows),
        "decode_target_met": verdict,
        "seconds": time.monotonic() - began,
    }
    (args.out / "peers.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    title = f"{s.fixture}: dgr vs llama.cpp's tools, {s.threads} thread(s) per process ({note})"
    how = plot(args.out / "peers.png", s, speeds, agg, rec, title)
    print(
        f"\nsaved {args.out / 'peers.json'} and {args.out / 'peers.png'} ({how}); "
        f"{time.monotonic() - began:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
