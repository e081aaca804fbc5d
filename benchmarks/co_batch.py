"""Sessions batched per stage (issue 15 part 2): aggregate decode throughput of concurrent
sessions on a route of workers that co-batch (``--batching co-batch``) against the same route
without it, and what co-batching does to a session's numbers.

**Throughput.** A 2-stage route of ``dgr worker`` processes (1 engine thread each) serves ``N``
concurrent greedy sessions (``SessionManager`` over ``GrpcStageTransport``), for each ``N`` in
``--sessions``, once per batching mode, in interleaved rounds (median over ``--repeats``).
Aggregate decode tok/s is ``benchmarks.concurrent_route.aggregate_tps`` of the sessions' token time
stamps (the tokens of the window in which every session decodes). Beside it, in-process (no
network): one engine of the whole model decoding ``N`` sessions one call each against one
co-batched call (``ShardEngine.forward_batch``): what the engine itself gains. Targets
(issue 15): 8 sessions >= 3 x one session (co-batching route); >= 0.9 x
``llama-batched-bench`` with 8 sequences on the whole model, which ``benchmarks.peers``
measures beside it.

**Numerics.** Every session's tokens on the co-batching route are checked against the whole
model run alone; and in-process, over seeded sessions decoded co-batched and alone on the whole
model, the share of sessions whose tokens differ and the largest logit difference.

    python -m benchmarks.co_batch [--fixture mid-llama] [--sessions 1,4,8] [--decode 32]
        [--repeats 3] [--seeds 24] [--out DIR]

Fixture evidence on this machine: both workers and the client share its 2 cores, so a stage's
engine competes with the other stage and the client for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from benchmarks.concurrent_route import ConcurrentRoute
from dgr_engine.engine import ForwardItem, ShardEngine
from dgr_engine.fixtures import ensure_fixture, lookup
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points, whole_model_greedy
from dgr_engine.tooling.processes import dgr_command

PROMPT_LEN = 16
MODES = ("session", "co-batch")


def prompts_for(n: int, n_vocab: int, seed: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, n_vocab, size=PROMPT_LEN)] for _ in range(n)]


def engine_throughput(path: Path, options: EngineOptions, n: int, steps: int) -> dict[str, float]:
    """In-process whole model: ``n`` sessions decoded one call each vs one co-batched call."""
    out: dict[str, float] = {}
    with ShardEngine(path, **options.engine_kwargs()) as engine:
        for sid in range(n):
            engine.open_session(sid, 1)
            engine.forward(sid, 1, np.arange(PROMPT_LEN), tokens=np.full(PROMPT_LEN, 7))
        pos = PROMPT_LEN
        for mode in ("alone", "co-batch", "alone", "co-batch"):  # interleaved, second counts
            began = time.perf_counter()
            for _ in range(steps):
                if mode == "co-batch":
                    engine.forward_batch([ForwardItem(s, 1, [pos], tokens=[5]) for s in range(n)])
                else:
                    for sid in range(n):
                        engine.forward(sid, 1, [pos], tokens=[5])
                pos += 1
            out[mode] = n * steps / (time.perf_counter() - began)
    return out


def numerics(fixture: str, options: EngineOptions, seeds: int, steps: int) -> dict[str, Any]:
    """Seeded sessions, 8 at a time, decoded co-batched and alone on the whole model."""
    path, n_vocab = ensure_fixture(fixture), lookup(fixture).n_vocab
    differing = 0
    diffs: list[float] = []
    with ShardEngine(path, **options.engine_kwargs()) as engine:
        for start in range(0, seeds, 8):
            batch = prompts_for(min(8, seeds - start), n_vocab, seed=100 + start)
            alone = [_decode_alone(engine, p, steps) for p in batch]
            together = _decode_together(engine, batch, steps)
            for (a_tok, a_log), (b_tok, b_log) in zip(alone, together, strict=True):
                differing += a_tok != b_tok
                pairs = enumerate(zip(a_tok, b_tok, strict=True))
                same = next((i for i, (x, y) in pairs if x != y), steps)
                diffs.append(float(np.abs(a_log[: same + 1] - b_log[: same + 1]).max()))
    return {
        "seeds": seeds,
        "differing": differing,
        "max_logit_diff": max(diffs),
        "median_logit_diff": statistics.median(diffs),
    }


def _decode_alone(
    engine: ShardEngine, prompt: list[int], steps: int
) -> tuple[list[int], np.ndarray]:
    engine.open_session(0, 1)
    rows = [engine.forward(0, 1, np.arange(len(prompt)), tokens=prompt)[-1].copy()]
    tokens = [int(np.argmax(rows[-1]))]
    for step in range(steps - 1):
        rows.append(engine.forward(0, 1, [len(prompt) + step], tokens=[tokens[-1]])[-1].copy())
        tokens.append(int(np.argmax(rows[-1])))
    engine.close_session(0, 1)
    return tokens, np.stack(rows)


def _decode_together(
    engine: ShardEngine, prompts: list[list[int]], steps: int
) -> list[tuple[list[int], np.ndarray]]:
    for sid in range(len(prompts)):
        engine.open_session(sid, 1)
    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    items = [ForwardItem(s, 1, np.arange(len(p)), tokens=p) for s, p in enumerate(prompts)]
    for _ in range(steps):
        outs = _packed(engine, items)
        items = []
        for sid, out in enumerate(outs):
            if isinstance(out, Exception):
                raise out
            rows[sid].append(out[-1].copy())
            tokens[sid].append(int(np.argmax(out[-1])))
            pos = len(prompts[sid]) + len(tokens[sid]) - 1
            items.append(ForwardItem(sid, 1, [pos], tokens=[tokens[sid][-1]]))
    for sid in range(len(prompts)):
        engine.close_session(sid, 1)
    return [(t, np.stack(r)) for t, r in zip(tokens, rows, strict=True)]


def _packed(engine: ShardEngine, items: list[ForwardItem]) -> list[Any]:
    """``items`` in co-batched calls of at most ``n_batch`` rows, in order (as a co-batching
    worker packs the frames that wait together)."""
    outs: list[Any] = []
    call: list[ForwardItem] = []
    rows = 0
    for item in items:
        n = len(np.asarray(item.positions).reshape(-1))
        if call and rows + n > engine.info.n_batch:
            outs += engine.forward_batch(call)
            call, rows = [], 0
        call.append(item)
        rows += n
    return outs + engine.forward_batch(call)


async def _rounds(
    path: Path,
    options: dict[str, EngineOptions],
    layout: list[tuple[int, int]],
    counts: list[int],
    decode: int,
    repeats: int,
    n_vocab: int,
) -> tuple[dict[str, dict[int, list[float]]], dict[str, bool]]:
    figures: dict[str, dict[int, list[float]]] = {m: {n: [] for n in counts} for m in MODES}
    exact = {m: True for m in MODES}
    routes = {m: ConcurrentRoute(path, layout, options[m], ()) for m in MODES}
    prompts = prompts_for(max(counts), n_vocab)
    reference = whole_model_greedy(path, prompts, decode + 1, options["session"])
    try:
        for route in routes.values():
            await route.start()
        for round_index in range(repeats + 1):  # the first round warms up
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for n in counts:
                for mode in order:
                    tok_s, tokens = await routes[mode].run(prompts[:n], decode)
                    exact[mode] &= tokens == reference[:n]
                    if round_index > 0:
                        figures[mode][n].append(tok_s)
    finally:
        for route in routes.values():
            await route.aclose()
    return figures, exact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default="mid-llama")
    parser.add_argument("--sessions", default="1,4,8")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=24, help="numerics sessions (0: none)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.sessions.split(",") if n]
    spec = lookup(args.fixture)
    base = EngineOptions(
        n_threads=1,
        n_ctx_per_session=PROMPT_LEN + args.decode + 8,
        n_batch=64,
        max_sessions=max(8, max(counts)),
    )
    options = {m: attrs.evolve(base, batching=m) for m in MODES}
    for mode in MODES:  # dark lanes are unroutable: certify each lane (or reuse its record)
        subprocess.run(
            [dgr_command(), "certify", "--fixture", args.fixture, "--reuse"]
            + options[mode].worker_argv(),
            check=True,
            timeout=3600,
            stdout=subprocess.DEVNULL,
        )
    path = ensure_fixture(args.fixture)
    layout = split_points(spec.n_layer, 2)
    figures, exact = asyncio.run(
        _rounds(path, options, layout, counts, args.decode, args.repeats, spec.n_vocab)
    )
    print(
        f"{path.name}: 2 stages {layout}, {PROMPT_LEN}-token prompts, {args.decode} tokens each, "
        f"1 engine thread per worker; median of {args.repeats} interleaved rounds; both workers "
        "and the client share this machine's cores (fixture evidence)"
    )
    header = f"{'sessions':>8} {'per-session tok/s':>17} {'co-batch tok/s':>14} {'co/per':>7}"
    print(header)
    print("-" * len(header))
    medians = {m: {n: statistics.median(v) for n, v in figures[m].items()} for m in MODES}
    for n in counts:
        plain, co = medians["session"][n], medians["co-batch"][n]
        print(f"{n:>8} {plain:>17.1f} {co:>14.1f} {co / plain:>7.2f}")
    one = medians["co-batch"].get(1)
    most = max(counts)
    scale = medians["co-batch"][most] / one if one else float("nan")
    verdict = "met" if scale >= 3.0 else "MISSED"
    print(f"target: {most} sessions >= 3 x one session (co-batch): {scale:.2f} x, {verdict}")
    same = ", ".join(f"{mode} {exact[mode]}" for mode in MODES)
    print(f"tokens equal to the whole model's: {same}")
    engine = {n: engine_throughput(path, options["session"], n, 8) for n in counts}
    print("in-process whole model, decode tok/s: one call per session vs one co-batched call")
    for n in counts:
        alone, co = engine[n]["alone"], engine[n]["co-batch"]
        print(f"{n:>8} {alone:>17.1f} {co:>14.1f} {co / alone:>7.2f}")
    report: dict[str, Any] = {
        "fixture": args.fixture,
        "layout": layout,
        "route_tok_s": figures,
        "route_median_tok_s": medians,
        "scale_vs_one": scale,
        "tokens_exact": exact,
        "engine_tok_s": engine,
    }
    if args.seeds > 0:
        num = numerics("tiny-llama", options["session"], args.seeds, 12)
        report["numerics"] = num
        print(
            f"co-batched vs alone, tiny-llama, {num['seeds']} seeded sessions: tokens differ in "
            f"{num['differing']}, largest logit difference {num['max_logit_diff']:.2e} "
            f"(median {num['median_logit_diff']:.2e})"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "co_batch.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
