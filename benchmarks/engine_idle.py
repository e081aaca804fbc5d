"""What idling between forwards costs an engine on this machine: no dgr code, no network.

A stage of a route computes one forward, then waits while the other stages and the seams do
their part; the whole model in one process computes forward after forward. This benchmark runs
the same ``ShardEngine`` in this process both ways: decode forwards back to back, and with the
thread asleep for ``--gaps`` ms before each one (as a worker's loop sleeps in ``epoll`` until its
next frame). It reports the engine's median time per forward after each gap, relative to back
to back, for the whole model and for one half of it (a 2-stage route's first stage).

``benchmarks/pipeline.py`` finds the workers' engines slower than the whole model's; this shows
how much of that any process on this machine pays just for having been idle (a sleeping vCPU, a
colder core), which no seam or session code can remove. Rounds are interleaved (gap order
rotated) so that a slow spell hits every gap alike.

    python -m benchmarks.engine_idle [--fixture mid-llama] [--threads 1]
        [--gaps 0 2 8 16] [--forwards 24] [--repeats 5]

Fixture evidence on this machine's CPUs only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before the engine loads libgomp

from dgr_engine.engine import ShardEngine  # noqa: E402
from dgr_engine.fixtures import ensure_fixture, lookup  # noqa: E402
from dgr_engine.options import EngineOptions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

_PROMPT = 32
_WARM = 4  # forwards per run not counted (the first after a prefill)


def forward_times(engine: ShardEngine, session: int, gap_s: float, forwards: int) -> list[float]:
    """Seconds per decode forward (after ``_WARM``), each after sleeping ``gap_s``; the engine
    owns the first layers (it takes token ids)."""
    engine.open_session(session, 0)
    try:
        engine.forward(session, 0, np.arange(_PROMPT), tokens=np.arange(_PROMPT) % 7)
        times: list[float] = []
        for i in range(forwards + _WARM):
            if gap_s:
                time.sleep(gap_s)
            began = time.perf_counter()
            engine.forward(session, 0, [_PROMPT + i], tokens=[i % 7])
            if i >= _WARM:
                times.append(time.perf_counter() - began)
        return times
    finally:
        engine.close_session(session, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fixture", default="mid-llama")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.0, 2.0, 8.0, 16.0])
    parser.add_argument("--forwards", type=int, default=24, help="timed forwards per run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)
    if 0.0 not in args.gaps:
        args.gaps = [0.0, *args.gaps]

    path = ensure_fixture(args.fixture)
    spec = lookup(args.fixture)
    ctx = 1 << (_PROMPT + args.forwards + _WARM).bit_length()
    options = EngineOptions(
        n_threads=args.threads, n_ctx_per_session=ctx, n_batch=64, max_sessions=1
    )
    shapes = {"whole": None, "first half": (0, spec.n_layer // 2)}
    medians: dict[str, dict[float, list[float]]] = {name: {} for name in shapes}
    for name, layers in shapes.items():
        with ShardEngine(path, layers=layers, **options.engine_kwargs()) as engine:
            session = 0
            for round_ in range(args.repeats + 1):  # round 0 warms up
                shift = round_ % len(args.gaps)
                for gap in args.gaps[shift:] + args.gaps[:shift]:
                    session += 1
                    times = forward_times(engine, session, gap / 1000, args.forwards)
                    if round_:
                        medians[name].setdefault(gap, []).append(statistics.median(times))

    print(
        f"{path.name}: engine ms per decode forward after sleeping `gap` ms before each "
        f"(median of {args.repeats} interleaved rounds of {args.forwards} forwards; "
        f"{args.threads} thread(s), in-process, no dgr code)"
    )
    print(f"{'gap ms':>7} " + " ".join(f"{n + ' ms':>14} {'vs 0':>6}" for n in shapes))
    table: dict[str, dict[str, float]] = {name: {} for name in shapes}
    for gap in args.gaps:
        cells = []
        for name in shapes:
            value = 1000 * statistics.median(medians[name][gap])
            base = 1000 * statistics.median(medians[name][0.0])
            table[name][f"{gap:g}"] = value
            cells.append(f"{value:>14.2f} {value / base:>6.3f}")
        print(f"{gap:>7g} " + " ".join(cells))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "engine_idle.json"
    out.write_text(
        json.dumps(
            {
                "fixture": args.fixture,
                "threads": args.threads,
                "repeats": args.repeats,
                "forwards": args.forwards,
                "ms_per_forward_by_gap": table,
            },
            indent=2,
        )
    )
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
