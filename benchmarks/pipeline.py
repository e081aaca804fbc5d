"""Whole model vs dgr routes of loopback workers: decode and prefill speed, per-hop seam cost.

Side by side in one run, one session at a time, greedy:

* ``whole``: the whole model in-process (``ShardEngine``, same llama.cpp commit, same engine
  options and thread count), driven like a route session: the prompt in one call, then one
  token per call, argmax in Python.
* ``dgr N``: a route of N ``dgr worker`` processes on 127.0.0.1 (even layer ranges), driven
  by ``dgr_session.SessionManager`` over ``GrpcStageTransport`` (gRPC streams): what a user
  of dgr gets. ``dgr 1`` (the whole model behind one worker) separates the cost of the
  network path from the cost of cutting the model.

Decode tokens/s is over the tokens after the first (the first one is the prefill's); prefill
tokens/s is the prompt length over the prefill's wall time (relayed: from the first stage's
first request to the last stage's reply of the prompt's last chunk; chained: the prompt
forwards' round trips, from the first frame sent to the answer, the epoch's opens and links
left out as llama.cpp's prompt test has none; the time to the first token keeps them). Each
is the median of ``--repeats`` rounds; every round runs the
whole model and every route once (order rotated per round, all routes' workers up throughout),
after one warm-up round, so that a slow spell of this shared machine hits them all alike.

Where a route's decode time goes, per token: its engines (what the workers report), the
workers' handlers around them, the transit (the client's time inside gRPC minus the handlers)
and the client's own code; ``dgr-free`` is the ratio of the engines and transit alone (dgr's
code at zero cost). Beside it the **floor**: the same route shape over bare grpc.aio echo
servers (``grpc_floor.py``, raw bytes, no dgr code) that each read memory for a stage's median
engine time; ``best`` is the ratio a route would reach with floor-cost hops and engines as fast
as the whole model.

Per-hop seam overhead (µs, client round trip minus the engine time the worker reports, the
method of ``benchmarks/seam_overhead.py``): for the route's dense boundary (measured on the
2-stage route's decode steps) and, with ``seam_overhead``'s echo worker, for a 4 x 4096 f32
boundary (DeepSeek V4's, 64 KiB per token in and out) and the dense width.

Prints a table, saves ``benchmarks/out/pipeline.json`` and ``benchmarks/out/pipeline.png``
(matplotlib when installed, else a plain bar chart written without it). Targets: decode
ratio >= 0.90 at 2 stages and >= 0.85 at 4 stages; seam overhead <= 300 µs per hop for the
4 x 4096 boundary.

    python -m benchmarks.pipeline [--fixture mid-llama] [--threads 1]
        [--prompt 128] [--decode 64] [--repeats 5] [--stages 1 2 4] [--frames 300]

Fixture evidence on this machine's CPUs (thread placement is the OS's: every worker and the
client share the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import time
import zlib
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path

import attrs
import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before the engine loads libgomp

from benchmarks import grpc_floor, seam_overhead  # noqa: E402
from benchmarks.concurrent_route import LoopbackRoute  # noqa: E402
from dgr_engine.client.chained import ChainRecord, ChainStageTransport  # noqa: E402
from dgr_engine.client.relay import ForwardRecord, GrpcStageTransport  # noqa: E402
from dgr_engine.engine import ShardEngine  # noqa: E402
from dgr_engine.fixtures import ensure_fixture, lookup  # noqa: E402
from dgr_engine.options import EngineOptions  # noqa: E402
from dgr_engine.reference import split_points  # noqa: E402
from dgr_engine.tooling.loopback import LoopbackRouteProvider  # noqa: E402
from dgr_engine.tooling.processes import dgr_command  # noqa: E402
from dgr_session import EvidenceClass, FailurePolicy, SessionManager  # noqa: E402
from dgr_session.sampling import Sampler, greedy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

V4_BOUNDARY = 4 * 4096
TARGETS = {2: 0.90, 4: 0.85}
SEAM_TARGET_US = 300.0


@attrs.frozen
class Speed:
    name: str
    stages: int
    prefill_tps: float
    decode_tps: float
    decode_ms: float
    hop_overhead_us: float | None = None
    """Median per-hop overhead over the decode steps (rtt - engine), dgr routes only."""


@attrs.frozen
class Breakdown:
    """Where a route's decode time goes, per token (medians over the runs), and the floor.

    The four parts add up to the route's time per token: ``engine_ms`` + ``worker_ms`` (the
    worker's handler around the engine) + ``transit_ms`` (inside gRPC, both ways: serialising,
    HTTP/2, loopback, thread hand-offs) + ``client_ms`` (the client's own code: session
    manager, transport, frames, sampling)."""

    stages: int
    engine_ms: float
    """Engine time of all stages (what the workers report)."""
    worker_ms: float
    """The workers' handlers minus their engine time: frame checks, reply building."""
    transit_ms: float
    """The client's time inside gRPC minus the workers' handler time, summed over the stages."""
    client_ms: float
    """The rest: the client's own code between a reply and the next request."""
    whole_ms: float
    """The whole model's time per token in the same rounds."""
    floor_us: float
    """A hop of the same route shape over bare grpc.aio echo servers, each busy for a stage's
    engine time (``grpc_floor.py``)."""

    @property
    def seam_ms(self) -> float:
        """Round trips minus engine time (the client's view of the seam)."""
        return self.worker_ms + self.transit_ms

    @property
    def best_ratio(self) -> float:
        """The decode ratio a route would reach if each hop cost only the bare-gRPC floor and
        the stages computed exactly as fast as the whole model."""
        return self.whole_ms / (self.whole_ms + self.stages * self.floor_us / 1000)

    @property
    def dgr_free_ratio(self) -> float:
        """The decode ratio of this route's own engines and gRPC transit alone, as measured:
        what it would reach if dgr's code (client and worker handlers) cost nothing."""
        return self.whole_ms / (self.engine_ms + self.transit_ms)


def _prompt(n: int, n_vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(11).integers(0, n_vocab, size=n)]


# --- whole model -------------------------------------------------------------------------------


def whole_model(
    engine: ShardEngine, session: int, prompt: list[int], n_decode: int
) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds, tokens) of one greedy run on the whole model (the
    prompt in chunks of the engine's ``n_batch``, as a route session feeds it)."""
    engine.open_session(session, 0)
    try:
        began = time.perf_counter()
        chunk = engine.info.n_batch
        for start in range(0, len(prompt), chunk):
            rows = prompt[start : start + chunk]
            positions = np.arange(start, start + len(rows))
            logits = engine.forward(session, 0, positions, tokens=rows)
        token = int(np.argmax(logits[-1]))
        prefill = time.perf_counter() - began
        tokens, pos = [token], len(prompt)
        began = time.perf_counter()
        for _ in range(n_decode):
            logits = engine.forward(session, 0, [pos], tokens=[token])
            token = int(np.argmax(logits[-1]))
            tokens.append(token)
            pos += 1
        return prefill, time.perf_counter() - began, tokens
    finally:
        engine.close_session(session, 0)


# --- dgr route ---------------------------------------------------------------------------------


@attrs.frozen
class RouteRun:
    """One run over a route (greedy, or with the bench's sampler)."""

    prefill_s: float
    decode_s: float
    tokens: list[int]
    decode_records: list[ForwardRecord]
    """The forwards of the decode steps after the first token (one row each)."""
    ttft_s: float = 0.0
    """From ``SessionManager.start`` to the first accepted token (the stages' opens, the
    prompt's prefill through every stage and its greedy token: what a user waits for)."""
    parts_ms: Mapping[str, float] = attrs.field(factory=dict)
    """Where a decode token's time went, ms per token (:func:`token_parts`)."""


class RouteBench(LoopbackRoute):
    """A route of loopback ``dgr worker`` processes and a session manager over it, kept up
    across runs so that runs of every layout can be interleaved."""

    def __init__(
        self,
        path: Path,
        layout: list[tuple[int, int]],
        options: EngineOptions,
        *,
        transport: str = "relay",
        sampler: Sampler = greedy,
    ) -> None:
        """``transport``: ``relay`` (``GrpcStageTransport``), ``chain`` or ``ring``
        (``ChainStageTransport``, ``docs/chain.md``: over the frame link), ``chain-grpc`` or
        ``ring-grpc`` (the same over gRPC; ``docs/data-paths.md``), ``ring-native`` (over
        native links, ``docs/native-path.md``). ``sampler``: every run's (``docs/sampling.md``:
        a seeded one samples on the last stage)."""
        self.stages = len(layout)
        self.sampler = sampler
        self.provider = LoopbackRouteProvider(path, layout, options=options)
        self._records: list[tuple[float, ForwardRecord]] = []
        self._chained: list[ChainRecord] = []
        self.ring = False
        if transport == "relay":
            self.transport = GrpcStageTransport(timeout=60.0, observer=self._observe)
        else:
            mode, _, via = transport.partition("-")
            self.ring = mode == "ring"
            self.transport = ChainStageTransport(
                timeout=60.0,
                observer=self._observe,
                chain_observer=self._chained.append,
                ring=mode == "ring",
                data_path=via if via in ("grpc", "native") else "frame",
            )
        policy = FailurePolicy(step_deadline=60.0, session_deadline=600.0)
        self.manager = SessionManager(
            self.transport, self.provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
        )
        self._runs = 0

    def _observe(self, record: ForwardRecord) -> None:
        self._records.append((time.perf_counter(), record))

    async def run(self, prompt: list[int], n_decode: int) -> RouteRun:
        self._records.clear()
        self._chained.clear()
        times: list[float] = []
        self._runs += 1
        began = time.perf_counter()
        handle = self.manager.start(
            prompt,
            max_new_tokens=n_decode + 1,
            session_id=f"bench-{self.stages}-{self._runs}",
            on_token=partial(_stamp, times),
            sampler=self.sampler,
        )
        result = await handle.wait()
        if result.error is not None:
            raise result.error
        # the prompt's forwards: its chunks through every stage (pipelined by the relay)
        prefill = [(t, r) for t, r in self._records if r.positions.start < len(prompt)]
        first_token_at = times[0]
        decode_s = times[-1] - times[0]
        if not prefill:  # a chained route reports no per-stage forwards: its prefill forwards'
            # round trips, from each one's first frame sent to its answer (the stages' opens
            # and links left out, as RPC's prompt test has none); the time to the first token
            # keeps them
            ttft = first_token_at - began
            prompt_frames = [r for r in self._chained if r.step == 0]
            prefill_s = sum(r.rtt_us for r in prompt_frames) / 1e6 if prompt_frames else ttft
            steps = [r for r in self._chained if r.step > 0]
            parts = chained_token_parts(steps, decode_s, n_decode, ring=self.ring)
            return RouteRun(prefill_s, decode_s, list(result.tokens), [], ttft, parts)
        start = min(t - r.rtt_us / 1e6 for t, r in prefill)
        decode = [r for t, r in self._records if t > first_token_at and len(r.positions) == 1]
        return RouteRun(
            max(t for t, _ in prefill) - start,
            decode_s,
            list(result.tokens),
            decode,
            first_token_at - began,
            relay_token_parts(decode, decode_s, n_decode),
        )


def relay_token_parts(
    records: Sequence[ForwardRecord], decode_s: float, n_decode: int
) -> dict[str, float]:
    """A relayed decode token's ms: the engines, the workers' own code (checks, encode), the
    transit (each call's round trip beyond its handler: gRPC, the network), and the client's
    code (the rest of the wall time: the session core, the relay's own code); ``llama.cpp``:
    the part of the engines inside llama.cpp (the rest of ``engine`` is the Python around the
    engine call: its arguments, result and output checks)."""
    engine = sum(r.compute_us for r in records) / n_decode / 1000
    native = sum(r.native_us for r in records) / n_decode / 1000
    handler = sum(r.handler_us for r in records) / n_decode / 1000
    wire = sum(r.wire_us for r in records) / n_decode / 1000
    wall = 1000 * decode_s / n_decode
    return {
        "engine": engine,
        "llama.cpp": native,
        "worker": handler - engine,
        "transit": wire - handler,
        "client": wall - wire,
    }


def chained_token_parts(
    records: Sequence[ChainRecord], decode_s: float, n_decode: int, *, ring: bool
) -> dict[str, float]:
    """A chained decode token's ms: the engines and the workers' own code (every hop's trace),
    the transit (a chain: the client's round trip beyond the stages' handlers; a ring: the rest
    of the wall time, since the last stage sends the next frame itself and the client, reading
    the logits beside it, is off the critical path) and the client's code (a chain: the rest
    of the wall time; a ring: 0); ``llama.cpp``: the part of the engines inside llama.cpp."""
    engine = sum(sum(r.compute_us) for r in records) / n_decode / 1000
    native = sum(sum(r.native_us) for r in records) / n_decode / 1000
    handler = sum(sum(r.handler_us) for r in records) / n_decode / 1000
    wall = 1000 * decode_s / n_decode
    if ring:
        return {
            "engine": engine,
            "llama.cpp": native,
            "worker": handler - engine,
            "transit": wall - handler,
            "client": 0.0,
        }
    rtt = sum(r.rtt_us for r in records) / n_decode / 1000
    return {
        "engine": engine,
        "llama.cpp": native,
        "worker": handler - engine,
        "transit": rtt - handler,
        "client": wall - rtt,
    }


def _stamp(times: list[float], token: int) -> None:
    times.append(time.perf_counter())


def speed(
    name: str, stages: int, prompt_len: int, n_decode: int, runs: list[tuple[float, float]]
) -> Speed:
    prefill = statistics.median(p for p, _ in runs)
    decode = statistics.median(d for _, d in runs)
    return Speed(name, stages, prompt_len / prefill, n_decode / decode, 1000 * decode / n_decode)


def breakdown(
    stages: int, runs: list[RouteRun], n_decode: int, whole_ms: float, floor_us: float
) -> Breakdown:
    parts: dict[str, list[float]] = {"engine": [], "worker": [], "transit": [], "client": []}
    for run in runs:
        records = run.decode_records
        engine = sum(r.compute_us for r in records) / n_decode / 1000
        handler = sum(r.handler_us for r in records) / n_decode / 1000
        wire = sum(r.wire_us for r in records) / n_decode / 1000
        parts["engine"].append(engine)
        parts["worker"].append(handler - engine)
        parts["transit"].append(wire - handler)
        parts["client"].append(1000 * run.decode_s / n_decode - wire)
    median = {name: statistics.median(values) for name, values in parts.items()}
    return Breakdown(
        stages=stages,
        engine_ms=median["engine"],
        worker_ms=median["worker"],
        transit_ms=median["transit"],
        client_ms=median["client"],
        whole_ms=whole_ms,
        floor_us=floor_us,
    )


def stage_compute_s(runs: list[RouteRun]) -> float:
    """Median engine time of one stage's decode forward."""
    return statistics.median(r.compute_us for run in runs for r in run.decode_records) / 1e6


# --- seam overhead -----------------------------------------------------------------------------


def echo_overhead(width: int, frames: int) -> tuple[float, dict[str, float]]:
    """Median per-hop overhead (µs) through seam_overhead's echo worker, streaming, and the
    medians of its parts (client code, transit inside gRPC, worker code)."""
    worker = seam_overhead.EchoProcess.spawn_echo(width)
    try:
        hops = asyncio.run(seam_overhead.measure(worker.address, width, frames, True))
    finally:
        worker.stop()
    return float(statistics.median(h.overhead for h in hops)), seam_overhead.part_medians(hops)


# --- the plot ----------------------------------------------------------------------------------


def plot(path: Path, speeds: list[Speed], seams: dict[str, float], title: str) -> str:
    """Writes the PNG; returns how (``matplotlib`` or ``plain``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plain_png(path, speeds, seams)
        return "plain (matplotlib not installed: bars only, numbers in pipeline.json)"
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    names = [s.name for s in speeds]
    for ax, values, label in (
        (axes[0], [s.decode_tps for s in speeds], "decode tokens/s"),
        (axes[1], [s.prefill_tps for s in speeds], "prefill tokens/s"),
    ):
        bars = ax.bar(names, values, color=["#555"] + ["#2a7"] * (len(values) - 1))
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(label)
    whole = speeds[0].decode_tps
    for target in TARGETS.values():
        axes[0].axhline(whole * target, ls=":", lw=1, color="#c33")
        axes[0].text(len(names) - 0.5, whole * target, f" {target:.2f}x", va="bottom", fontsize=8)
    bars = axes[2].bar(list(seams), list(seams.values()), color="#37a")
    axes[2].bar_label(bars, fmt="%.0f")
    axes[2].axhline(SEAM_TARGET_US, ls=":", lw=1, color="#c33")
    axes[2].set_title("seam overhead µs / hop (stream)")
    axes[2].tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def _plain_png(path: Path, speeds: list[Speed], seams: dict[str, float]) -> None:
    """Three groups of bars (decode, prefill, seam), each scaled to its own maximum."""
    height, bar, gap = 240, 28, 12
    groups = [
        [s.decode_tps for s in speeds],
        [s.prefill_tps for s in speeds],
        list(seams.values()),
    ]
    width = sum(len(g) * (bar + 4) + 3 * gap for g in groups) + gap
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    x = gap
    for colour, values in zip(((40, 160, 110), (40, 110, 160), (160, 90, 40)), groups, strict=True):
        top = max(values) or 1.0
        for value in values:
            h = int((height - 20) * value / top)
            img[height - 10 - h : height - 10, x : x + bar] = colour
            x += bar + 4
        x += 3 * gap
    raw = b"".join(b"\x00" + row.tobytes() for row in img)

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


# --- main --------------------------------------------------------------------------------------


async def interleaved_rounds(
    path: Path,
    layouts: dict[int, list[tuple[int, int]]],
    prompt: list[int],
    n_decode: int,
    repeats: int,
    options: EngineOptions,
) -> tuple[list[tuple[float, float, list[int]]], dict[int, list[RouteRun]]]:
    """``repeats`` rounds (after one warm-up round), each running the whole model and every
    route once, in an order rotated from round to round: a slow spell of this shared machine
    lands on every configuration alike instead of on whichever ran last."""
    benches = {n: RouteBench(path, layout, options) for n, layout in layouts.items()}
    whole_runs: list[tuple[float, float, list[int]]] = []
    route_runs: dict[int, list[RouteRun]] = {n: [] for n in layouts}
    try:
        for bench in benches.values():
            await bench.start()
        with ShardEngine(path, **options.engine_kwargs()) as engine:
            configs: list[int | None] = [None, *layouts]
            for round_ in range(repeats + 1):
                shift = round_ % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    if config is None:
                        result = whole_model(engine, round_ + 1, prompt, n_decode)
                        if round_:
                            whole_runs.append(result)
                    else:
                        run = await benches[config].run(prompt, n_decode)
                        if round_:
                            route_runs[config].append(run)
    finally:
        for bench in benches.values():
            await bench.aclose()
    return whole_runs, route_runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fixture", default="mid-llama")
    parser.add_argument("--threads", type=int, default=1, help="engine threads (every engine)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=64, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--frames", type=int, default=300, help="echo frames per seam case")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)

    path = ensure_fixture(args.fixture)
    spec = lookup(args.fixture)
    ctx = 1 << (args.prompt + args.decode + 2).bit_length()
    batch = max(64, 1 << (args.prompt - 1).bit_length())
    # two slots: a run's session may still be closing when the next one opens
    options = EngineOptions(
        n_threads=args.threads, n_ctx_per_session=ctx, n_batch=batch, max_sessions=2
    )
    prompt = _prompt(args.prompt, spec.n_vocab)
    cores = os.cpu_count()
    print(
        f"{path.name}: {spec.n_layer} layers, n_embd {spec.n_embd}; {args.threads} engine "
        f"thread(s) per engine, {cores} cores shared by every process; prompt {args.prompt}, "
        f"{args.decode} decode steps, median of {args.repeats} interleaved rounds"
    )

    # dark lanes are unroutable: the fixture lane of these options is certified first (its
    # record reused when one of exactly this lane exists); the routes require fixture evidence
    certify = attrs.evolve(options, max_sessions=8)  # the isolation scenario's sessions
    subprocess.run(
        [dgr_command(), "certify", "--fixture", args.fixture, "--reuse", *certify.worker_argv()],
        check=True,
        timeout=1800,
    )
    layouts = {n: split_points(spec.n_layer, n) for n in args.stages}
    whole_runs, route_runs = asyncio.run(
        interleaved_rounds(path, layouts, prompt, args.decode, args.repeats, options)
    )
    reference = whole_runs[0][2]
    speeds = [speed("whole", 0, args.prompt, args.decode, [(p, d) for p, d, _ in whole_runs])]
    whole_ms = speeds[0].decode_ms
    breakdowns: list[Breakdown] = []
    dense_hop: float | None = None
    floor_servers = [grpc_floor.spawn_floor() for _ in range(max(args.stages))]
    try:
        addresses = [server.address for server in floor_servers]
        for n, got in route_runs.items():
            if any(run.tokens != reference for run in got):
                raise SystemExit(f"dgr {n}: tokens differ from the whole model's")
            hops = [r.rtt_us - r.compute_us for run in got for r in run.decode_records]
            hop = float(statistics.median(hops))
            s = speed(
                f"dgr {n}", n, args.prompt, args.decode, [(r.prefill_s, r.decode_s) for r in got]
            )
            speeds.append(attrs.evolve(s, hop_overhead_us=hop))
            if n == 2:
                dense_hop = hop
            # the same route shape with bare echo servers: each busy for a stage's engine time
            busy = stage_compute_s(got)
            floor = grpc_floor.floor_us(addresses[:n], 4 * spec.n_embd, busy, 40 * n)
            breakdowns.append(breakdown(n, got, args.decode, whole_ms, floor))
    finally:
        for server in floor_servers:
            server.stop()
    seams: dict[str, float] = {}
    if dense_hop is not None:
        seams[f"route dense {spec.n_embd}"] = dense_hop
    seam_parts: dict[str, dict[str, float]] = {}
    for name, width in ((f"echo {spec.n_embd}", spec.n_embd), ("echo 4x4096", V4_BOUNDARY)):
        seams[name], seam_parts[name] = echo_overhead(width, args.frames)

    whole = speeds[0]
    print()
    print(
        f"{'run':<8} {'stages':>6} {'decode tok/s':>12} {'ms/token':>9} {'ratio':>6} "
        f"{'target':>6} {'prefill tok/s':>13} {'ratio':>6} {'hop µs':>7}"
    )
    for s in speeds:
        ratio = s.decode_tps / whole.decode_tps
        goal = TARGETS.get(s.stages)
        mark = "" if goal is None else (" ok" if ratio >= goal else " MISS")
        hop_text = "" if s.hop_overhead_us is None else f"{s.hop_overhead_us:.0f}"
        print(
            f"{s.name:<8} {s.stages:>6} {s.decode_tps:>12.1f} {s.decode_ms:>9.2f} {ratio:>6.3f} "
            f"{'' if goal is None else f'{goal:.2f}':>6} {s.prefill_tps:>13.1f} "
            f"{s.prefill_tps / whole.prefill_tps:>6.3f} {hop_text:>7}{mark}"
        )
    print()
    print(
        "where a route's decode time goes, ms per token (median of runs): engines; worker "
        "(handlers minus engines); transit (inside gRPC both ways, minus handlers); client "
        "(the client's own code).\nfloor = the same route shape over bare grpc.aio echo "
        "servers, each busy (reading memory) for a stage's engine time; best = the ratio with "
        "floor-cost hops and whole-model-speed engines; dgr-free = the ratio of this route's "
        "measured engines and transit alone (dgr's own code at zero cost)"
    )
    print(
        f"{'stages':>6} {'whole':>7} {'engines':>8} {'worker':>7} {'transit':>8} {'client':>7} "
        f"{'floor µs/hop':>13} {'best':>6} {'dgr-free':>8} {'target':>6}"
    )
    for b in breakdowns:
        goal = TARGETS.get(b.stages)
        print(
            f"{b.stages:>6} {b.whole_ms:>7.2f} {b.engine_ms:>8.2f} {b.worker_ms:>7.2f} "
            f"{b.transit_ms:>8.2f} {b.client_ms:>7.2f} {b.floor_us:>13.0f} "
            f"{b.best_ratio:>6.3f} {b.dgr_free_ratio:>8.3f} "
            f"{'' if goal is None else f'{goal:.2f}':>6}"
        )
    print()
    print(
        "per-hop seam overhead, µs (median; rtt - worker engine time; streaming); echo hops "
        "split into client code / transit inside gRPC / worker code (medians)"
    )
    for name, value in seams.items():
        note = ""
        if name in seam_parts:
            parts = seam_parts[name]
            note = "  (" + " / ".join(f"{parts[k]:.0f}" for k in seam_overhead.PARTS) + ")"
        if name == "echo 4x4096":
            note += f"  target <= {SEAM_TARGET_US:.0f}"
            note += " ok" if value <= SEAM_TARGET_US else " MISS"
        print(f"  {name:<22} {value:8.0f}{note}")

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "fixture": args.fixture,
        "threads": args.threads,
        "cores": cores,
        "prompt": args.prompt,
        "decode": args.decode,
        "repeats": args.repeats,
        "speeds": [attrs.asdict(s) for s in speeds],
        "seam_overhead_us": seams,
        "seam_parts_us": seam_parts,
        "breakdown_ms_per_token": [
            {
                **attrs.asdict(b),
                "seam_ms": b.seam_ms,
                "best_ratio": b.best_ratio,
                "dgr_free_ratio": b.dgr_free_ratio,
            }
            for b in breakdowns
        ],
        "targets": {"decode_ratio": TARGETS, "seam_us": SEAM_TARGET_US},
    }
    (args.out / "pipeline.json").write_text(json.dumps(result, indent=2))
    title = (
        f"{args.fixture}: whole model vs dgr loopback routes, {args.threads} thread(s) per "
        f"engine, {cores} shared cores (fixture evidence)"
    )
    how = plot(args.out / "pipeline.png", speeds, seams, title)
    print(f"\nsaved {args.out / 'pipeline.json'} and {args.out / 'pipeline.png'} ({how})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
