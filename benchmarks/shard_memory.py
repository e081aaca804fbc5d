"""Peak RSS and weight bytes per shard of the mid fixture (or a real model: ``--model``), for 1,
2 and 4 stages, and the same fixture split into several GGUF files with each of 3 shards
holding only its own files.

Each shard is loaded in a process of its own (peak RSS is per process), runs a short prefill and
a few decode steps, and reports its engine stats. Target: every shard's peak RSS <= its weights +
its KV + 64 MiB (:func:`shard_row`; ``benchmarks.peers`` prints these rows beside its speed
rows). The split rows also give the bytes each shard keeps on disk (its files, fetched with
``--layers`` into a root of its own) against the whole model's. Fixture evidence with
``--fixture`` (random weights); with ``--model``, a real model's figures; this machine either way.

With ``--workers``, real ``dgr worker`` processes too, for every layout ``dgr certify`` runs:
each one's peak RSS (its high-water mark since start) against its steady RSS after a short
session, target peak <= steady + 64 MiB, and where its start-up seconds went
(:mod:`benchmarks.worker_start`).

    python -m benchmarks.shard_memory [--fixture mid-llama | --model NAME|PATH] [--stages 1 2 4]
        [--split-stages 3] [--workers]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
SLACK = 64 * MIB
CHILD_KW: dict[str, Any] = {
    "max_sessions": 1,
    "n_ctx_per_session": 512,
    "n_threads": 2,
    "n_batch": 64,
}


def child(path: str, begin: int, end: int) -> None:
    """Runs in the measured process: load the range, prefill, decode, print stats as JSON."""
    import numpy as np

    from dgr_engine import ShardEngine

    with ShardEngine(path, layers=(begin, end), **CHILD_KW) as engine:
        info = engine.info
        engine.open_session(1, 0)
        n = 32
        positions = np.arange(n)
        if info.is_first:
            engine.forward(1, 0, positions, tokens=np.arange(n) % info.n_vocab)
        else:
            engine.forward(1, 0, positions, rows=np.zeros((n, info.in_width), np.float32))
        for i in range(4):
            pos = [n + i]
            if info.is_first:
                engine.forward(1, 0, pos, tokens=[i])
            else:
                engine.forward(1, 0, pos, rows=np.zeros((1, info.in_width), np.float32))
        s = engine.stats()
        print(
            json.dumps(
                {
                    "layers": [begin, end],
                    "n_layer": info.n_layer,
                    "weight_bytes": s.weight_bytes,
                    "kv_bytes": s.kv_bytes,
                    "compute_bytes": s.compute_bytes,
                    "peak_rss_bytes": s.peak_rss_bytes,
                }
            )
        )


def measure(path: Path, begin: int, end: int) -> dict[str, int]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.shard_memory",
            "--child",
            str(path),
            str(begin),
            str(end),
        ],
        cwd=Path(__file__).resolve().parent.parent,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def shard_row(path: Path, begin: int, end: int) -> dict[str, Any]:
    """One shard measured in a process of its own (:func:`measure`) with its budget (weights +
    KV + 64 MiB) and whether its peak RSS kept to it (``met``)."""
    r: dict[str, Any] = dict(measure(path, begin, end))
    r["budget_bytes"] = r["weight_bytes"] + r["kv_bytes"] + SLACK
    r["met"] = r["peak_rss_bytes"] <= r["budget_bytes"]
    return r


def split_rows(name: str, n_layer: int, n_stages: int) -> bool:
    """The split model's rows: each shard's files fetched alone into a root of its own (a
    temporary directory, removed at the end), loaded from there, measured."""
    from dgr_engine.artifacts import provision
    from dgr_engine.artifacts.sources import DirectorySource
    from dgr_engine.fixtures.split import ensure_split
    from dgr_engine.reference import split_points

    split = ensure_split(name)
    manifest = split.manifest
    whole = manifest.size
    print(
        f"\nsplit model {name}: {len(manifest.files)} files, {whole / MIB:.1f} MiB, manifest "
        f"{manifest.sha256[:16]}; each shard's root holds only its files"
    )
    header = (
        f"{'stages':>6} {'layers':>9} {'files':>6} {'disk MiB':>9} {'disk/model':>10} "
        f"{'weights MiB':>12} {'disk/weights':>12} {'peak RSS MiB':>13} {'RSS/budget':>11} "
        f"{'ok':>3}"
    )
    print(header)
    print("-" * len(header))
    all_ok = True
    with tempfile.TemporaryDirectory(prefix="dgr-split-bench-") as scratch:
        for begin, end in split_points(n_layer, n_stages):
            root = Path(scratch) / f"shard-{begin}-{end}"
            provision.fetch(manifest, DirectorySource(split.directory), root, layers=(begin, end))
            held = manifest.files_for((begin, end))
            disk = sum((root / f.name).stat().st_size for f in held)
            r = measure(root / manifest.files[0].name, begin, end)
            budget = r["weight_bytes"] + r["kv_bytes"] + SLACK
            ok = r["peak_rss_bytes"] <= budget
            all_ok &= ok
            print(
                f"{n_stages:>6} {f'[{begin},{end})':>9} {f'{len(held)}/{len(manifest.files)}':>6} "
                f"{disk / MIB:>9.1f} {disk / whole:>10.3f} {r['weight_bytes'] / MIB:>12.1f} "
                f"{disk / r['weight_bytes']:>12.3f} {r['peak_rss_bytes'] / MIB:>13.1f} "
                f"{r['peak_rss_bytes'] / budget:>11.3f} {'yes' if ok else 'NO':>3}"
            )
    return all_ok


def main(argv: list[str] | None = None) -> int:
    # imported here, not at the top: the measured child process loads only what a shard needs
    from benchmarks.model_arg import BenchModelError, add_model_arguments, resolve

    parser = argparse.ArgumentParser(description="peak RSS and weight bytes per shard")
    add_model_arguments(parser, default_fixture="mid-llama", trust=False)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--split-stages", type=int, default=3, help="shards of the split model (0: none)"
    )
    parser.add_argument(
        "--workers",
        action="store_true",
        help="also real workers of every certify layout: peak and steady RSS, start split",
    )
    parser.add_argument("--child", nargs=3, metavar=("PATH", "BEGIN", "END"))
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0

    from dgr_engine.reference import split_points

    try:
        model = resolve(args, notice=lambda m: print(m, flush=True))
    except BenchModelError as exc:
        print(f"benchmarks.shard_memory: {exc}", file=sys.stderr)
        return 2
    path = model.path
    file_mib = path.stat().st_size / MIB
    what = "fixture evidence" if model.is_fixture else "real-model figures"
    print(f"model {path.name}: {file_mib:.1f} MiB file ({what}, this machine)")
    header = (
        f"{'stages':>6} {'layers':>9} {'weights MiB':>12} {'KV MiB':>8} {'compute MiB':>12} "
        f"{'peak RSS MiB':>13} {'budget MiB':>11} {'RSS/budget':>11} {'ok':>3}"
    )
    print(header)
    print("-" * len(header))
    all_ok = True
    n_layer = model.n_layer
    for n_stages in args.stages:
        for begin, end in split_points(n_layer, n_stages):
            r = shard_row(path, begin, end)
            budget, ok = r["budget_bytes"], r["met"]
            all_ok &= ok
            print(
                f"{n_stages:>6} {f'[{begin},{end})':>9} {r['weight_bytes'] / MIB:>12.1f} "
                f"{r['kv_bytes'] / MIB:>8.1f} {r['compute_bytes'] / MIB:>12.1f} "
                f"{r['peak_rss_bytes'] / MIB:>13.1f} {budget / MIB:>11.1f} "
                f"{r['peak_rss_bytes'] / budget:>11.3f} {'yes' if ok else 'NO':>3}"
            )
    split_name = f"{model.label}-split"
    # imported here, not at the top: the measured child process loads only what a shard needs
    from dgr_engine.fixtures.split import SPLITS

    if args.split_stages and model.is_fixture and split_name in SPLITS:
        all_ok &= split_rows(split_name, n_layer, args.split_stages)
    verdict = "met" if all_ok else "MISSED"
    print(f"target (peak RSS <= weights + KV + 64 MiB on every shard): {verdict}")
    if args.workers:
        from benchmarks import worker_start

        rows = worker_start.certify_layout_rows(path, n_layer, model.n_vocab)
        workers_ok = worker_start.print_rows(f"{model.label} ({model.kind})", rows)
        verdict = "met" if workers_ok else "MISSED"
        print(f"target (peak <= steady + 64 MiB on every worker): {verdict}")
        all_ok &= workers_ok
    return 0 if all_ok else 1


if __name__ == "__main__":
    if not __package__:  # run as a file (python benchmarks/shard_memory.py): its package too
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
