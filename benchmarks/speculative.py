"""Decode speed of exact speculative decoding over chained and ringed routes, against the
round-trip time of each link (issue 34, item 5).

For 2 and 4 stages (``dgr worker`` processes on 127.0.0.1), each RTT per link, each transport
(**chain**: ``ChainStageTransport``; **ring**: ``ChainStageTransport(ring=True)``), each
workload, each sampler and each draft source, one session per round, every configuration interleaved
(the order reversed from round to round; one short plain session per transport and workload
warms the workers and proxies up first). A link with RTT > 0 is the userspace WAN proxy of
``dgr_engine.tooling.delay_proxy`` in front of every stage (half the RTT each way); RTT 0 is
plain loopback.

Workloads: **repeat**, a prompt whose answer repeats its context (a real model is asked to
rewrite a given paragraph with one word changed, through its chat template; a fixture gets
a token sequence that repeats), and **chat** (a free question; a fixture gets random tokens).
Samplers (``docs/sampling.md``): **greedy**, and **sampled** (dgr's seeded sampler at
temperature 0.7, top-p 0.9, which the ring's last stage applies; a pass keeps the drafts it
picks, so the tokens are plain seeded sampling's). Draft sources (``docs/speculative.md``):
**plain** (no speculation), **ngram** (``NgramDrafter``, prompt lookup) and **self**
(``ModelDrafter`` of the model itself, run whole by the client: acceptance 1.0 under greedy, the
mechanism's ceiling; its drafts cost a whole-model forward each on the client, so its speed
says what perfect drafts buy, not what a draft model would). Every drafter has
``DraftLength(k_max=--k-max)``; a self-draft starts at ``k_max``.

Per cell: decode tok/s (tokens after the first over the time from the first to the last),
acceptance (drafts kept / drafts verified), tokens per verification pass ((kept + passes) /
passes, the issue's figure), time per route pass (decode time / every decode forward along the
route, verification or not) and the engines' share of it (every stage's engine time, from the
frames' own traces: the rest is the links, gRPC and the code at either end), speed-up over
plain in the same cell, and tokens exact against the
whole model's tokens with the same sampler (the exit status is 1 when any cell is not exact).

    python -m benchmarks.speculative [--model smollm2-135m-instruct | --fixture NAME]
        [--stages 2 4] [--rtts 0,10,30] [--tokens 48] [--rounds 2] [--k-max 8]
        [--sampling greedy,sampled]
        [--lock FILE --evidence DIR --sign-key FILE]

A real model (the default) is certified (or its record reused) under ``--lock``, which must
declare it, e.g. the demo's operator lock: ``--lock ~/.cache/dgr/demo/lock.json --evidence
~/.cache/dgr/demo/evidence`` (``benchmarks/model_arg.py``). Targets (issue 34): at 30 ms and 4
stages, ring + ngram >= 2.0 x ring plain on ``repeat`` and >= 0.95 x on ``chat``; on loopback
ngram never below 0.95 x plain. Sampled (issue 49): at 30 ms and 4 stages, ring + ngram >= 3 x
ring plain on ``repeat`` and >= 1.0 x on ``chat``. Saves ``benchmarks/out/speculative.json`` and
``speculative.png`` (speed-up bars, drawn without matplotlib). Every worker, proxy and the
client (the self-draft's engine included) share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import struct
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from benchmarks.model_arg import BenchModel, BenchModelError, add_model_arguments, resolve
from dgr_engine.client.chained import ChainRecord, ChainStageTransport
from dgr_engine.engine.sampling import SeededSampler
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points, whole_model_reference, whole_model_sampled
from dgr_engine.speculative import ModelDrafter
from dgr_engine.tooling.delay_proxy import Link, ProxiedRoutes
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import EvidenceClass, FailurePolicy, SessionManager, SessionState
from dgr_session.drafts import Drafter, DraftLength, NgramDrafter
from dgr_session.sampling import Sampler, Sampling, greedy
from dgr_session.speculation import MAX_DRAFTS, Speculation
from dgr_session.transport import RouteProvider

ROOT = Path(__file__).resolve().parent.parent
TRANSPORTS = ("chain", "ring")
WORKLOADS = ("repeat", "chat")
DRAFTERS = ("plain", "ngram", "self")
SAMPLINGS = ("greedy", "sampled")
SAMPLED = Sampling(seed=4242, temperature=0.7, top_p=0.9)
"""The sampled workloads' sampler: what chat clients send (issue 49)."""
DEFAULT_MODEL = "smollm2-135m-instruct"
WARMUP_TOKENS = 8
DATA_PATH = "grpc"
"""The frame link is reached at the port its stage advertises, past the WAN proxy, which
fronts gRPC only: gRPC keeps every hop behind its link."""

PARAGRAPH = (
    "The old house stood at the end of the lane, its blue door facing the sea. Every morning the "
    "fisherman walked past it on his way to the harbour, and every evening he walked back, tired "
    "and quiet, as the sun went down behind the hills."
)
REPEAT_TEXT = (
    f"Rewrite the following paragraph, changing only the word 'blue' to 'green':\n\n{PARAGRAPH}"
)
"""The repeating workload of a real model (SmolLM2-135M copies this paragraph; asked to rewrite a
code block it summarizes it instead)."""
CHAT_TEXT = "Tell me about the history of tea, and how it is grown and prepared today."

# the issues' targets: (stages, RTT ms, transport, workload, sampler, drafter, at least x plain)
WAN_TARGETS = (
    (4, 30.0, "ring", "repeat", "greedy", "ngram", 2.0),
    (4, 30.0, "ring", "chat", "greedy", "ngram", 0.95),
    (4, 30.0, "ring", "repeat", "sampled", "ngram", 3.0),
    (4, 30.0, "ring", "chat", "sampled", "ngram", 1.0),
)
LOOPBACK_TARGET = 0.95


@attrs.frozen
class Session:
    """One session's outcome."""

    tokens: list[int]
    decode_s: float
    """From the first token (the prefill's) to the last."""
    passes: int
    drafted: int
    accepted: int
    engine_s: float = 0.0
    """Engine time of the decode frames, summed over the stages (their own traces)."""
    client_frames: int = 0
    """Frames the client sent to the first stage (on a ring, the others its last stage sent)."""


@attrs.frozen
class Cell:
    """One configuration's sessions, summed."""

    stages: int
    rtt_ms: float
    transport: str
    workload: str
    sampling: str
    """``greedy`` or ``sampled`` (:data:`SAMPLED`)."""
    drafter: str
    tps: float
    """Decode tokens per second: the tokens after the first over the time to the last."""
    acceptance: float | None
    """Drafts kept / drafts verified; ``None`` without drafts."""
    tokens_per_pass: float
    """(kept + verification passes) / verification passes; 1.0 without one."""
    route_passes: int
    """Decode forwards along the route, verification or not: tokens after the first - kept."""
    ms_per_pass: float
    """Decode time per route pass."""
    engine_ms_per_pass: float
    """Of which the engines' (every stage's, summed); the rest is transit (the links' delay,
    gRPC), the workers' and the client's code."""
    passes: int
    drafted: int
    accepted: int
    exact: bool
    client_frames: int = 0
    """Frames the client sent to the first stage, over the cell's sessions (a ring's last
    stage sent the others)."""
    speedup: float = 1.0
    """tok/s over plain's in the same stages, RTT, transport, workload and sampler."""


def sampler_of(name: str) -> Sampler:
    """The session's sampler of a :data:`SAMPLINGS` name."""
    return greedy if name == "greedy" else SeededSampler(SAMPLED)


def drafter_for(name: str, model: Path, n_vocab: int, options: EngineOptions) -> Drafter | None:
    if name == "plain":
        return None
    if name == "ngram":
        return NgramDrafter()
    return ModelDrafter(
        model,
        target_n_vocab=n_vocab,
        n_threads=options.n_threads,
        n_ctx=options.n_ctx_per_session,
        n_batch=options.n_batch,
    )


async def one_session(
    provider: RouteProvider,
    transport_name: str,
    prompt: list[int],
    tokens: int,
    tag: str,
    drafter: Drafter | None,
    k_max: int,
    sampler: Sampler = greedy,
) -> Session:
    """Runs one session (speculating when ``drafter``); the drafter is closed after."""
    stamps: list[float] = []
    traces: list[ChainRecord] = []
    spec = None
    if drafter is not None:
        start = k_max if isinstance(drafter, ModelDrafter) else min(2, k_max)
        spec = Speculation(drafter, DraftLength(k_max=k_max, k_start=start))
    transport = ChainStageTransport(
        timeout=30.0,
        close_timeout=1.0,
        ring=transport_name == "ring",
        data_path=DATA_PATH,
        chain_observer=traces.append,
    )
    policy = FailurePolicy(step_deadline=30.0, session_deadline=600.0)
    try:
        async with transport:
            manager = SessionManager(
                transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
            )
            handle = manager.start(
                prompt,
                max_new_tokens=tokens,
                session_id=tag,
                speculation=spec,
                sampler=sampler,
                on_token=lambda _t: stamps.append(time.perf_counter()),
            )
            result = await handle.wait()
            await manager.aclose()
    finally:
        if drafter is not None:
            drafter.close()
    if result.state is not SessionState.DONE:
        raise RuntimeError(f"{tag}: session ended {result.state}: {result.error}")
    return Session(
        tokens=list(result.tokens),
        decode_s=stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0,
        passes=spec.passes if spec else 0,
        drafted=spec.drafted if spec else 0,
        accepted=spec.accepted if spec else 0,
        engine_s=sum(sum(t.compute_us) for t in traces if t.step >= 1) / 1e6,
        client_frames=transport.chain_stats.sent,
    )


def summarize(
    key: tuple[int, float, str, str, str, str], runs: list[Session], want: list[int]
) -> Cell:
    stages, rtt, transport, workload, sampling, drafter = key
    after_first = sum(len(r.tokens) - 1 for r in runs)
    decode_s = sum(r.decode_s for r in runs)
    passes = sum(r.passes for r in runs)
    drafted = sum(r.drafted for r in runs)
    accepted = sum(r.accepted for r in runs)
    route_passes = after_first - accepted
    return Cell(
        stages=stages,
        rtt_ms=rtt,
        transport=transport,
        workload=workload,
        sampling=sampling,
        drafter=drafter,
        tps=after_first / decode_s if decode_s > 0 else 0.0,
        acceptance=accepted / drafted if drafted else None,
        tokens_per_pass=(accepted + passes) / passes if passes else 1.0,
        route_passes=route_passes,
        ms_per_pass=1000 * decode_s / route_passes if route_passes else 0.0,
        engine_ms_per_pass=(
            1000 * sum(r.engine_s for r in runs) / route_passes if route_passes else 0.0
        ),
        passes=passes,
        drafted=drafted,
        accepted=accepted,
        exact=all(r.tokens == want for r in runs),
        client_frames=sum(r.client_frames for r in runs),
    )


async def measure(
    model: BenchModel,
    stages: list[int],
    rtts: list[float],
    prompts: dict[str, list[int]],
    wants: dict[tuple[str, str], list[int]],
    tokens: int,
    rounds: int,
    k_max: int,
    options: EngineOptions,
    log: Callable[[str], None],
    samplings: tuple[str, ...] = SAMPLINGS,
) -> list[Cell]:
    cells: list[Cell] = []
    configs = list(itertools.product(TRANSPORTS, WORKLOADS, samplings, DRAFTERS))
    for n in stages:
        pool = LoopbackRouteProvider(model.path, split_points(model.n_layer, n), options=options)
        await pool.start()
        try:
            for rtt in rtts:
                provider: RouteProvider = pool
                routes = None
                if rtt > 0:
                    routes = ProxiedRoutes(pool, Link(rtt=rtt / 1000, seed=1))
                    provider = routes
                seen: dict[tuple[str, str, str, str], list[Session]] = {c: [] for c in configs}
                try:
                    for transport, workload in itertools.product(TRANSPORTS, WORKLOADS):
                        warm = min(WARMUP_TOKENS, tokens)
                        got = await one_session(
                            provider,
                            transport,
                            prompts[workload],
                            warm,
                            f"warm-s{n}-r{rtt:g}-{transport}-{workload}",
                            None,
                            k_max,
                        )
                        if got.tokens != wants[(workload, "greedy")][:warm]:
                            raise RuntimeError(f"warm-up {transport} {workload}: tokens differ")
                    for r in range(rounds):
                        for config in configs if r % 2 == 0 else configs[::-1]:
                            transport, workload, sampling, name = config
                            drafter = drafter_for(name, model.path, model.n_vocab, options)
                            tag = f"s{n}-r{rtt:g}-{r}-{transport}-{workload}-{sampling}-{name}"
                            seen[config].append(
                                await one_session(
                                    provider,
                                    transport,
                                    prompts[workload],
                                    tokens,
                                    tag,
                                    drafter,
                                    k_max,
                                    sampler_of(sampling),
                                )
                            )
                finally:
                    if routes is not None:
                        await routes.aclose()
                here = {c: summarize((n, rtt, *c), seen[c], wants[c[1:3]]) for c in configs}
                for (transport, workload, sampling, _), cell in here.items():
                    plain = here[(transport, workload, sampling, "plain")].tps
                    cell = attrs.evolve(cell, speedup=cell.tps / plain if plain else 0.0)
                    cells.append(cell)
                    log(f"  {row(cell)}")
        finally:
            await pool.aclose()
    return cells


HEAD = (
    f"{'stages':>6} {'RTT':>4} {'transport':<9} {'workload':<8} {'sampler':<7} {'drafter':<7} "
    f"{'tok/s':>7} "
    f"{'accept':>6} {'tok/pass':>8} {'ms/pass':>8} {'engines':>7} {'x plain':>7} exact"
)


def row(c: Cell) -> str:
    accept = "-" if c.acceptance is None else f"{c.acceptance:.2f}"
    return (
        f"{c.stages:>6} {c.rtt_ms:>4g} {c.transport:<9} {c.workload:<8} {c.sampling:<7} "
        f"{c.drafter:<7} "
        f"{c.tps:>7.1f} {accept:>6} {c.tokens_per_pass:>8.2f} {c.ms_per_pass:>8.1f} "
        f"{c.engine_ms_per_pass:>7.1f} {c.speedup:>7.2f} {c.exact}"
    )


def targets_of(cells: list[Cell]) -> list[dict[str, Any]]:
    """The issue's targets that the measured cells can judge."""
    by = {(c.stages, c.rtt_ms, c.transport, c.workload, c.sampling, c.drafter): c for c in cells}
    out: list[dict[str, Any]] = []

    def add(c: Cell, target: float) -> None:
        where = f"at {c.rtt_ms:g} ms" if c.rtt_ms else "loopback"
        out.append(
            {
                "name": f"{where}, {c.stages} stages, {c.transport}, {c.workload}, "
                f"{c.sampling}: {c.drafter} / plain",
                "stages": c.stages,
                "rtt_ms": c.rtt_ms,
                "transport": c.transport,
                "workload": c.workload,
                "sampling": c.sampling,
                "drafter": c.drafter,
                "value": c.speedup,
                "target": target,
                "met": c.speedup >= target,
            }
        )

    for *key, target in WAN_TARGETS:
        cell = by.get(tuple(key))  # type: ignore[arg-type]
        if cell is not None:
            add(cell, target)
    for c in cells:
        if c.rtt_ms == 0 and c.drafter == "ngram":
            add(c, LOOPBACK_TARGET)
    return out


def workloads(model: BenchModel, prompt_len: int) -> dict[str, list[int]]:
    """The prompts: a real model's from its tokenizer and chat template; a fixture's from a
    seeded generator (a sequence said three times, and random tokens)."""
    if model.is_fixture:
        rng = np.random.default_rng(5)
        part = [int(t) for t in rng.integers(0, model.n_vocab, size=max(2, prompt_len // 3))]
        repeat = (part * 3 + part)[:prompt_len]
        chat = [int(t) for t in rng.integers(0, model.n_vocab, size=len(repeat))]
        return {"repeat": repeat, "chat": chat}
    from dgr_engine.client.text import prompt_ids
    from dgr_engine.tokenizer import Tokenizer

    with Tokenizer(model.path) as tokenizer:
        return {
            "repeat": prompt_ids(tokenizer, REPEAT_TEXT, chat=True),
            "chat": prompt_ids(tokenizer, CHAT_TEXT, chat=True),
        }


def plot(path: Path, cells: list[Cell]) -> None:
    """A PNG of the speed-ups (no matplotlib): per stages/RTT/transport/workload group, bars for
    plain (grey, 1.0), ngram (green) and self (blue), a grey line at 1.0 and a red one at the
    2.0 target; the numbers are in the JSON."""
    groups = [cells[i : i + len(DRAFTERS)] for i in range(0, len(cells), len(DRAFTERS))]
    height, bar, gap = 260, 10, 10
    width = gap + len(groups) * (len(DRAFTERS) * bar + gap)
    top = max([2.5, *(c.speedup for c in cells)])
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    base = height - 10

    def y(value: float) -> int:
        return base - int((height - 20) * value / top)

    colours = {"plain": (150, 150, 150), "ngram": (40, 160, 110), "self": (40, 110, 160)}
    x = gap
    for group in groups:
        for c in group:
            img[y(c.speedup) : base, x : x + bar - 1] = colours.get(c.drafter, (0, 0, 0))
            x += bar
        x += gap
    img[y(1.0), :] = (90, 90, 90)
    img[y(2.0), :] = (200, 50, 50)
    raw = b"".join(b"\x00" + line.tobytes() for line in img)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_model_arguments(parser, default_fixture="tiny-llama")
    parser.add_argument("--rtts", default="0,10,30", help="RTT per link, ms, comma-separated")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=48, help="tokens per session")
    parser.add_argument("--prompt", type=int, default=24, help="a fixture's prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per cell")
    parser.add_argument(
        "--k-max", type=int, default=8, help=f"most drafts a pass (<= {MAX_DRAFTS})"
    )
    parser.add_argument("--threads", type=int, default=1, help="engine threads per worker")
    parser.add_argument(
        "--sampling",
        default=",".join(SAMPLINGS),
        help=f"samplers, comma-separated ({', '.join(SAMPLINGS)}; default both)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)
    if args.model is None and args.fixture is None:
        args.model = DEFAULT_MODEL
    samplings = tuple(s for s in args.sampling.split(",") if s)
    if not samplings or any(s not in SAMPLINGS for s in samplings):
        parser.exit(2, f"benchmarks.speculative: --sampling {args.sampling}: one of {SAMPLINGS}\n")
    try:
        rtts = [float(r) for r in args.rtts.split(",")]
    except ValueError:
        parser.exit(2, f"benchmarks.speculative: --rtts {args.rtts}: not comma-separated numbers\n")
    if (
        not 1 <= args.k_max <= MAX_DRAFTS
        or args.tokens < 2
        or args.rounds < 1
        or args.prompt < 2
        or any(r < 0 for r in rtts)
        or any(n < 1 for n in args.stages)
    ):
        parser.exit(
            2,
            f"benchmarks.speculative: need 1 <= --k-max <= {MAX_DRAFTS}, --tokens >= 2, "
            "--rounds >= 1, --prompt >= 2, RTTs >= 0 and stages >= 1\n",
        )
    try:
        model = resolve(args, notice=lambda m: print(m, flush=True))
    except BenchModelError as exc:
        print(f"benchmarks.speculative: {exc}", file=sys.stderr)
        return 2
    if any(n > model.n_layer for n in args.stages):
        print(f"benchmarks.speculative: {model.label} has {model.n_layer} layers", file=sys.stderr)
        return 2
    model.export_trust()  # the workers and this client judge the lane by the same lock
    prompts = workloads(model, args.prompt)
    longest = max(len(p) for p in prompts.values())
    need = longest + args.tokens + MAX_DRAFTS + 2
    options = EngineOptions(
        n_threads=args.threads,
        n_ctx_per_session=max(256, 1 << need.bit_length()),  # 256: the demo lane's records
        n_batch=max(64, 1 << longest.bit_length()),  # the prompt in one call, as the reference
        max_sessions=2,
    )
    certify = attrs.evolve(options, max_sessions=8)  # the isolation scenario's sessions
    print(f"certifying the lane of {model.label} (or reusing its record)", flush=True)
    try:  # dark lanes are unroutable
        model.require_certified(certify)
    except BenchModelError as exc:
        print(f"benchmarks.speculative: {exc}", file=sys.stderr)
        return 2
    refs = whole_model_reference(model.path, [prompts[w] for w in WORKLOADS], args.tokens, options)
    wants = {(w, "greedy"): tokens for w, (tokens, _) in zip(WORKLOADS, refs, strict=True)}
    hot = whole_model_sampled(
        model.path,
        [prompts[w] for w in WORKLOADS],
        args.tokens,
        options,
        [SeededSampler(SAMPLED) for _ in WORKLOADS],
    )
    wants.update({(w, "sampled"): tokens for w, tokens in zip(WORKLOADS, hot, strict=True)})
    note = model.evidence_note(os.cpu_count())
    print(
        f"{model.path.name}: {model.n_layer} layers, stages {args.stages}, RTT per link {rtts} ms "
        f"(0: loopback, no proxy), prompts {[len(prompts[w]) for w in WORKLOADS]} tokens "
        f"(repeat, chat), {args.tokens} tokens, {args.rounds} rounds, k_max {args.k_max}; "
        f"{note} (the self-draft's whole-model engine runs in the client, on the same cores)",
        flush=True,
    )
    print(HEAD, flush=True)
    cells = asyncio.run(
        measure(
            model,
            args.stages,
            rtts,
            prompts,
            wants,
            args.tokens,
            args.rounds,
            args.k_max,
            options,
            lambda line: print(line, flush=True),
            samplings,
        )
    )
    print()
    print(HEAD)
    for c in cells:
        print(row(c))
    targets = targets_of(cells)
    print()
    for t in targets:
        verdict = "met" if t["met"] else "MISSED"
        print(f"target {t['name']} >= {t['target']:g}: {t['value']:.2f} {verdict}")
    exact = all(c.exact for c in cells)
    print(f"tokens exact vs the whole model's, sampler for sampler, in every cell: {exact}")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": model.label,
        "model_kind": model.kind,
        "evidence": note,
        "cores": os.cpu_count(),
        "prompt_tokens": {w: len(prompts[w]) for w in WORKLOADS},
        "tokens": args.tokens,
        "rounds": args.rounds,
        "k_max": args.k_max,
        "sampled": attrs.asdict(SAMPLED),
        "cells": [attrs.asdict(c) for c in cells],
        "targets": targets,
        "exact": exact,
    }
    (args.out / "speculative.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(args.out / "speculative.png", cells)
    print(f"saved {args.out / 'speculative.json'} and {args.out / 'speculative.png'}")
    if not exact:
        print("benchmarks.speculative: tokens differ from the whole model's", file=sys.stderr)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
