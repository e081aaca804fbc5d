"""Real ``dgr worker`` processes for every layout ``dgr certify`` runs (the lock's stage counts):
how long each takes to start and where its seconds go, and its memory at peak and at rest.

Per layout, every stage's worker is spawned at once, as ``--spawn`` and a tracker start a route,
with the default engine options (the lane a default route runs). The route's start is the wall
time until the last one listens. Each worker's own split comes from its log line ``ready in
...`` (:mod:`dgr_engine.worker.reporting.start_times`): finding the model and reading its header,
hashing the file (once per machine: cached by path, size and mtime), loading its layers and
looking up its lane's certification, binding its ports; the rest of the spawn-to-listening time
is the interpreter's start and dgr's imports. Then a short session runs through the route (a
prefill of 32 tokens and 8 greedy decode steps, the stages relayed by this process over gRPC),
and each worker's ``VmRSS`` (steady) and ``VmHWM`` (peak) are read from ``/proc``. Target:
peak <= steady + 64 MiB on every stage (no start-up transient: a stage's memory is what its
layers need, never what the model's vocabulary costs a parser), a SmolLM2 worker ready in
<= 2 s warm, 10 Gemma 3 stages in <= 30 s.

    python -m benchmarks.worker_start [--model NAME|PATH | --fixture NAME] [--stages 2 3 4 10]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dgr_engine.worker.reporting.start_times import phases_in

MIB = 1024 * 1024
SLACK_MIB = 64.0
"""Peak above steady allowed per worker."""
PROMPT_TOKENS = 32
DECODE_STEPS = 8


@attrs.frozen
class WorkerRow:
    """One worker of one layout."""

    stages: int
    layers: tuple[int, int]
    ready_s: float
    """Spawn to listening, as its caller sees it."""
    phases: tuple[tuple[str, float], ...]
    """The worker's own split (``header``, ``hash``, ``engine``, ``serve``)."""
    steady_mib: float
    peak_mib: float

    @property
    def startup_s(self) -> float:
        """The interpreter's start and the imports: spawn-to-listening less the phases."""
        return max(0.0, self.ready_s - sum(seconds for _, seconds in self.phases))

    @property
    def transient_mib(self) -> float:
        return self.peak_mib - self.steady_mib

    @property
    def met(self) -> bool:
        return self.transient_mib <= SLACK_MIB


@attrs.frozen
class LayoutRow:
    """One layout: its route's start and its workers."""

    stages: int
    route_start_s: float
    workers: tuple[WorkerRow, ...]


def memory_mib(pid: int) -> tuple[float, float]:
    """``(steady, peak)`` RSS of a live process, MiB: what certification's ``resources.rss``
    reads."""
    from dgr_engine.certify.scenarios import peak_rss_bytes, steady_rss_bytes

    return steady_rss_bytes(pid) / MIB, peak_rss_bytes(pid) / MIB


async def relay_session(endpoints: Sequence[str], n_vocab: int) -> None:
    """A prefill and a few greedy decode steps through the stages, relayed by this process."""
    from dgr_engine.client.shard_client import ShardClient, expectations_of

    clients = [ShardClient(e) for e in endpoints]
    try:
        adverts = [await c.describe() for c in clients]
        expects = [expectations_of(advert) for advert in adverts]
        # the first stage's tokens, and every stage's whose layers route by token id (V4)
        wants_ids = [a.span.is_first or a.span.needs_token_ids for a in adverts]
        for client, expect in zip(clients, expects, strict=True):
            await client.open("bench", 0, expect)
        tokens = [int(t) for t in np.arange(1, PROMPT_TOKENS + 1) % n_vocab]
        position, step = 0, 0
        for _ in range(1 + DECODE_STEPS):
            positions = list(range(position, position + len(tokens)))
            boundary = None
            for client, expect, ids in zip(clients, expects, wants_ids, strict=True):
                result = await client.forward(
                    "bench",
                    0,
                    step,
                    expect,
                    positions,
                    tokens=tokens if ids else None,
                    boundary=boundary,
                )
                boundary = result.output
            assert boundary is not None
            position += len(tokens)
            step += 1
            tokens = [int(np.argmax(boundary[-1]))]
        for client in clients:
            await client.close("bench", 0)
    finally:
        for client in clients:
            await client.aclose()


def layout_row(model: Path, layout: Sequence[tuple[int, int]], n_vocab: int) -> LayoutRow:
    """Spawns the layout's workers at once, runs a session through them, measures each."""
    from dgr_engine.options import EngineOptions
    from dgr_engine.tooling.processes import WorkerProcess

    def spawn(layers: tuple[int, int]) -> tuple[WorkerProcess, float]:
        began = time.perf_counter()
        worker = WorkerProcess.spawn(model, layers, options=EngineOptions(), startup_timeout=120)
        return worker, time.perf_counter() - began

    began = time.perf_counter()
    with ThreadPoolExecutor(len(layout)) as pool:
        futures = [pool.submit(spawn, layers) for layers in layout]
        started = []
        try:
            for future in futures:
                started.append(future.result())
        finally:
            for future in futures[len(started) :]:  # a failed start: stop the rest
                if future.exception() is None:
                    future.result()[0].stop()
    route_start = time.perf_counter() - began
    try:
        asyncio.run(relay_session([w.address for w, _ in started], n_vocab))
        rows = []
        for layers, (worker, ready) in zip(layout, started, strict=True):
            steady, peak = memory_mib(worker.pid)
            rows.append(
                WorkerRow(len(layout), layers, ready, phases_in(worker.stderr_text()), steady, peak)
            )
    finally:
        for worker, _ in started:
            worker.stop()
    return LayoutRow(len(layout), route_start, tuple(rows))


def certify_layout_rows(
    model: Path, n_layer: int, n_vocab: int, stage_counts: Sequence[int] | None = None
) -> list[LayoutRow]:
    """:func:`layout_row` of every layout ``dgr certify`` runs (the lock's stage counts, or
    ``stage_counts``)."""
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.certify.runner import layouts_for

    counts = stage_counts or load_lock().thresholds.layout_stage_counts
    return [layout_row(model, layout, n_vocab) for layout in layouts_for(n_layer, counts)]


def print_rows(label: str, layouts: Sequence[LayoutRow]) -> bool:
    """The table; whether every worker met the memory target."""
    print(f"\n`dgr worker` start and memory, {label} (this machine, default engine options)")
    head = (
        f"{'stages':>6} {'layers':>9} {'ready s':>8} {'python s':>9} {'header s':>9} "
        f"{'hash s':>7} {'engine s':>9} {'serve s':>8} {'steady MiB':>11} {'peak MiB':>9} "
        f"{'peak-steady':>12} {'ok':>3}"
    )
    print(head)
    print("-" * len(head))
    all_ok = True
    for layout in layouts:
        for w in layout.workers:
            split = dict(w.phases)
            all_ok &= w.met
            print(
                f"{w.stages:>6} {f'[{w.layers[0]},{w.layers[1]})':>9} {w.ready_s:>8.2f} "
                f"{w.startup_s:>9.2f} {split.get('header', 0):>9.2f} {split.get('hash', 0):>7.2f} "
                f"{split.get('engine', 0):>9.2f} {split.get('serve', 0):>8.2f} "
                f"{w.steady_mib:>11.1f} {w.peak_mib:>9.1f} {w.transient_mib:>12.1f} "
                f"{'yes' if w.met else 'NO':>3}"
            )
    print("\nroute start (every stage spawned at once, until the last listens):")
    for layout in layouts:
        print(f"  {layout.stages:>2} stages: {layout.route_start_s:.2f} s")
    return all_ok


def as_json(label: str, layouts: Sequence[LayoutRow]) -> dict[str, Any]:
    return {
        "model": label,
        "layouts": [
            {
                "stages": layout.stages,
                "route_start_s": layout.route_start_s,
                "workers": [
                    {
                        "layers": list(w.layers),
                        "ready_s": w.ready_s,
                        "python_s": w.startup_s,
                        "phases": dict(w.phases),
                        "steady_mib": w.steady_mib,
                        "peak_mib": w.peak_mib,
                        "met": w.met,
                    }
                    for w in layout.workers
                ],
            }
            for layout in layouts
        ],
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.model_arg import BenchModelError, add_model_arguments, resolve

    parser = argparse.ArgumentParser(description="dgr worker start time and peak/steady memory")
    add_model_arguments(parser, default_fixture="mid-llama", trust=False)
    parser.add_argument(
        "--stages", type=int, nargs="+", default=None, help="default: the lock's layouts"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    try:
        model = resolve(args, notice=lambda m: print(m, flush=True))
    except BenchModelError as exc:  # one line, exit 2
        parser.exit(2, f"benchmarks.worker_start: {exc}\n")
    layouts = certify_layout_rows(model.path, model.n_layer, model.n_vocab, args.stages)
    ok = print_rows(f"{model.label} ({model.kind})", layouts)
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(model.label, layouts), indent=1))
    print(
        f"target (peak <= steady + {SLACK_MIB:g} MiB on every worker): {'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    if not __package__:  # run as a file: its package too
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
