"""What each numerics choice (KV cache type x flash-attention mode) costs in error and speed.

Two tables, measured side by side in one run:

1. **Error** on the converter-made fixtures: whole-model llama.cpp at each setting against
   ``transformers`` (CPU, float32) from the same safetensors, on the same prompts (2 x 24 seeded
   ids; for the DeepSeek V4 ones the 260- and 140-token prompts of
   ``tiny_v4.parity_prompts``, past the sliding window and the compression blocks): max |d logit|,
   max row-normwise relative error, top-1 agreement, greedy tokens equal, and llama.cpp's decode
   speed over transformers' (each side in its own process, the same threads).
2. **Speed** on a larger fixture (``mid-llama`` by default): decode and prefill tokens/s of the
   whole model at each setting relative to llama.cpp's default (f16 KV, flash attention auto),
   and the KV bytes per session; interleaved rounds so a slow spell hits every setting alike.

    python -m benchmarks.numerics [--models hf-llama-gqa ...] [--speed-fixture mid-llama]
        [--rounds 3] [--threads 2] [--out benchmarks/out]

Fixture evidence on this machine's CPUs only; a setting llama.cpp refuses for a model (a q8_0
cache needs a head dimension divisible by 32) is listed as refused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before the engine loads libgomp

from dgr_engine.baseline import runs, tiny_v4  # noqa: E402
from dgr_engine.baseline.compare import compare  # noqa: E402
from dgr_engine.baseline.runner import prompts_for  # noqa: E402
from dgr_engine.engine import ShardEngine  # noqa: E402
from dgr_engine.errors import EngineError  # noqa: E402
from dgr_engine.fixtures import converted, ensure_fixture  # noqa: E402
from dgr_engine.numerics import Numerics  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = (
    Numerics("f16", "auto"),
    Numerics("f16", "off"),
    Numerics("f32", "auto"),
    Numerics("f32", "off"),
    Numerics("q8_0", "on"),
)


def error_table(models: list[str], threads: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name in models:
        fixture = converted.ensure_converted(name)
        v4 = name in converted.V4_SPECS
        work = runs.Work(tiny_v4.parity_prompts() if v4 else prompts_for(320), 16, threads)
        reference = runs.in_child(runs.run_transformers, str(fixture.hf_dir), work)
        for numerics in SETTINGS:
            row: dict[str, Any] = {"model": name, "kv": numerics.kv_type, "fa": numerics.flash_attn}
            try:
                got = runs.in_child(runs.run_llama, str(fixture.gguf), numerics, work)
            except EngineError as exc:
                rows.append({**row, "refused": str(exc).rsplit(": ", 1)[-1][:90]})
                continue
            c = compare(reference.logits, got.logits, reference.tokens, got.tokens)
            rows.append(
                {
                    **row,
                    "max_abs": c.max_abs,
                    "max_rel": c.max_rel,
                    "top1": c.top1_agreement,
                    "tokens_equal": c.tokens_equal,
                    "margin_ratio": c.margin_ratio,
                    "decode_vs_transformers": got.decode_rate(work) / reference.decode_rate(work),
                }
            )
    return rows


def _rates(engine: ShardEngine, prompt: np.ndarray, n_decode: int) -> tuple[float, float]:
    engine.open_session(1, 0)
    try:
        n = len(prompt)
        t0 = time.perf_counter()
        engine.forward(1, 0, np.arange(n, dtype=np.int32), tokens=prompt)
        prefill = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for pos in range(n, n + n_decode):
            engine.forward(1, 0, np.array([pos], np.int32), tokens=prompt[pos % n : pos % n + 1])
        return prefill, n_decode / (time.perf_counter() - t0)
    finally:
        engine.close_session(1, 0)


def speed_table(fixture: str, threads: int, rounds: int) -> list[dict[str, Any]]:
    path = ensure_fixture(fixture)
    prompt = (np.arange(64, dtype=np.int32) * 37 + 11) % 256
    engines: dict[Numerics, ShardEngine | str] = {}
    for numerics in SETTINGS:
        try:
            engines[numerics] = ShardEngine(
                path, max_sessions=1, n_ctx_per_session=128, n_threads=threads, n_batch=64,
                n_ubatch=64, numerics=numerics,
            )  # fmt: skip
        except EngineError as exc:
            engines[numerics] = str(exc).rsplit(": ", 1)[-1][:90]
    measured: dict[Numerics, list[tuple[float, float]]] = {n: [] for n in SETTINGS}
    try:
        for round_ in range(rounds + 1):  # round 0 warms up
            shift = round_ % len(SETTINGS)
            for numerics in SETTINGS[shift:] + SETTINGS[:shift]:
                engine = engines[numerics]
                if isinstance(engine, ShardEngine):
                    rates = _rates(engine, prompt, 16)
                    if round_:
                        measured[numerics].append(rates)
        rows = []
        base = measured[SETTINGS[0]]
        base_prefill = statistics.median(r[0] for r in base)
        base_decode = statistics.median(r[1] for r in base)
        for numerics in SETTINGS:
            engine = engines[numerics]
            row: dict[str, Any] = {"kv": numerics.kv_type, "fa": numerics.flash_attn}
            if not isinstance(engine, ShardEngine):
                rows.append({**row, "refused": engine})
                continue
            prefill = statistics.median(r[0] for r in measured[numerics])
            decode = statistics.median(r[1] for r in measured[numerics])
            rows.append(
                {
                    **row,
                    "prefill_tok_s": prefill,
                    "decode_tok_s": decode,
                    "prefill_vs_default": prefill / base_prefill,
                    "decode_vs_default": decode / base_decode,
                    "kv_mib_per_session": engine.stats().kv_bytes / 2**20,
                }
            )
        return rows
    finally:
        for engine in engines.values():
            if isinstance(engine, ShardEngine):
                engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(converted.names()))
    parser.add_argument("--speed-fixture", default="mid-llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)

    errors = error_table(args.models, args.threads)
    print("error against transformers (float32, CPU), whole model, converter-made fixtures:")
    print(f"{'model':<18} {'kv':<5} {'fa':<5} {'max|d|':>9} {'max rel':>9} {'top-1':>6} "
          f"{'tokens':>7} {'err/margin':>10} {'decode vs tf':>12}")  # fmt: skip
    for r in errors:
        head = f"{r['model']:<18} {r['kv']:<5} {r['fa']:<5}"
        if "refused" in r:
            print(f"{head} refused: {r['refused']}")
            continue
        print(
            f"{head} {r['max_abs']:>9.2e} {r['max_rel']:>9.2e} {r['top1']:>6.3f} "
            f"{'equal' if r['tokens_equal'] else 'DIFFER':>7} {r['margin_ratio']:>10.3g} "
            f"{r['decode_vs_transformers']:>12.2f}"
        )
    speed = speed_table(args.speed_fixture, args.threads, args.rounds)
    print(
        f"\nspeed of the whole {args.speed_fixture} by setting (median of {args.rounds} "
        f"interleaved rounds; 64-token prefill, 16 decode steps, {args.threads} threads):"
    )
    print(f"{'kv':<5} {'fa':<5} {'prefill tok/s':>13} {'vs default':>10} {'decode tok/s':>12} "
          f"{'vs default':>10} {'KV MiB/session':>14}")  # fmt: skip
    for r in speed:
        head = f"{r['kv']:<5} {r['fa']:<5}"
        if "refused" in r:
            print(f"{head} refused: {r['refused']}")
            continue
        print(
            f"{head} {r['prefill_tok_s']:>13.1f} {r['prefill_vs_default']:>10.2f} "
            f"{r['decode_tok_s']:>12.1f} {r['decode_vs_default']:>10.2f} "
            f"{r['kv_mib_per_session']:>14.2f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "numerics.json"
    out.write_text(json.dumps({"error": errors, "speed": speed}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
