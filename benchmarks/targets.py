"""Issue 15's targets in one table: every target line with its measured value, beside the peer.

Runs the three benchmarks that measure issue 15's targets one after the other (never side by
side: they share the machine's cores), each in a fresh interpreter of its own (the control
plane's microsecond timings never run in a heap that a long benchmark grew) and within
``--timeout`` seconds, then reads what each saved in ``--out`` and prints one table:

* ``benchmarks.peers``: decode against llama.cpp RPC at 2 and 4 stages (part 4), aggregate
  decode of 8 sessions against ``llama-batched-bench`` and against one session (part 2),
  recovery against a fresh prefill at each ``--accepted`` k (part 1);
* ``benchmarks.chain``: chained routes (chain and ring) against the client relay on loopback
  and at each ``--rtts`` RTT per link through the delay proxy (part 3);
* ``benchmarks.control_plane``: p99 per transition, session creation, bytes per session
  (part 5).

The table is saved as ``targets.json`` beside the benchmarks' own outputs. ``--assemble`` only
reads the outputs already in ``--out`` (the runs of the three benchmarks, started by hand).
Every figure is fixture evidence from this machine: the workers, the peers and the client share
its cores.

    python -m benchmarks.targets [--fixture mid-llama] [--repeats 3] [--out DIR]
        [--peers "ARGS"] [--chain "ARGS"] [--control-plane "ARGS"] [--timeout S] [--assemble]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECOVERY_KS = "16,128,400,1000"
"""The accepted-token counts at which issue 15 sets recovery's target."""


def _part_of_peers_row(name: str) -> str:
    if name.startswith("recovery"):
        return "1 recovery"
    if "session" in name:
        return "2 co-batching"
    return "4 peers"


def peers_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``peers.json``'s table that carry a target."""
    return [
        {
            "part": _part_of_peers_row(row["name"]),
            "name": row["name"],
            "dgr": row["dgr_text"],
            "peer": row["peer_text"],
            "ratio": row["ratio"],
            "target": row["target"],
            "met": bool(row["met"]),
        }
        for row in result["table"]
        if row["target"]
    ]


def chain_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``chain.json``'s targets, each with the two decode rates it compares."""
    rows = []
    cells = {(c["stages"], c["rtt_ms"]): c for c in result["cells"]}
    for target in result["targets"]:
        mode = target["mode"]
        cell = cells[(target["stages"], target["rtt_ms"])]
        rows.append(
            {
                "part": "3 chained routes",
                "name": f"decode tok/s, {target['name']}",
                "dgr": f"{mode} {cell[f'{mode}_tps']:.1f}",
                "peer": f"relay {cell['relay_tps']:.1f}",
                "ratio": target["value"],
                "target": f">= {target['target']:g} x relay",
                "met": bool(target["met"]),
            }
        )
    return rows


def control_plane_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``control_plane.json``'s issue 15 lines (no peer: the tracker's own control plane)."""
    return [
        {
            "part": "5 control plane",
            "name": row["name"],
            "dgr": row["detail"],
            "peer": "",
            "ratio": None,
            "target": f"<= {row['target']:g} {row['unit']}",
            "met": bool(row["met"]),
        }
        for row in result["issue15_targets"]
    ]


SOURCES: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "peers.json": peers_rows,
    "chain.json": chain_rows,
    "control_plane.json": control_plane_rows,
}


def assemble(out: Path) -> list[dict[str, Any]]:
    """Every target row from the outputs in ``out``, ordered by the issue's parts."""
    rows: list[dict[str, Any]] = []
    for filename, rows_of in SOURCES.items():
        path = out / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path}: run its benchmark first (or leave out --assemble)")
        rows += rows_of(json.loads(path.read_text()))
    return sorted(rows, key=lambda row: row["part"][0])


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print("| part | measured | dgr | nearest peer | dgr / peer | target | met |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        met = "met" if r["met"] else "**missed**"
        print(
            f"| {r['part']} | {r['name']} | {r['dgr']} | {r['peer']} | {ratio} | {r['target']} "
            f"| {met} |"
        )
    missed = sum(not r["met"] for r in rows)
    print(f"{len(rows)} targets: {len(rows) - missed} met, {missed} missed (fixture evidence)")


def run_module(name: str, argv: Sequence[str], timeout_s: float) -> int:
    """``python -m benchmarks.<name> argv`` from the repo root, its output passed through; past
    ``timeout_s`` it is terminated (its own cleanup stops its workers), then killed."""
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{name}", *argv], cwd=ROOT)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"benchmarks.{name} ran past {timeout_s:.0f} s and was stopped", flush=True)
        return 124


def run_benchmarks(args: argparse.Namespace) -> int:
    """Runs the three benchmarks in turn: 1 when peers or chain exits nonzero (chain does on
    inexact tokens; peers records exactness in its JSON), else 0. The control plane's own exit
    status is issue 3's targets' verdict, so it is printed, not returned."""
    out = ["--out", str(args.out)]
    fixture = ["--fixture", args.fixture]
    peers_argv = [*fixture, "--repeats", str(args.repeats), "--accepted", RECOVERY_KS, *out]
    chain_argv = [*fixture, "--rounds", str(args.repeats), *out]
    runs = [
        ("peers", peers_argv, args.peers, True),
        ("chain", chain_argv, args.chain, True),
        ("control_plane", out, args.control_plane, False),
    ]
    status = 0
    for name, argv, extra, checks_tokens in runs:
        print(f"\n=== benchmarks.{name} ===", flush=True)
        (args.out / f"{name}.json").unlink(missing_ok=True)  # never assemble an older run's
        code = run_module(name, [*argv, *shlex.split(extra)], args.timeout)
        if code != 0:
            print(f"benchmarks.{name} exited {code}", flush=True)
            if checks_tokens:
                status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fixture", default="mid-llama")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of peers and chain")
    parser.add_argument("--peers", default="", help="further benchmarks.peers arguments")
    parser.add_argument("--chain", default="", help="further benchmarks.chain arguments")
    parser.add_argument(
        "--control-plane", default="", help="further benchmarks.control_plane arguments"
    )
    parser.add_argument("--assemble", action="store_true", help="only read the outputs in --out")
    parser.add_argument(
        "--timeout", type=float, default=7200.0, help="seconds each benchmark may run"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)
    status = 0 if args.assemble else run_benchmarks(args)
    rows = assemble(args.out)
    print("\n=== issue 15: every target ===")
    print_table(rows)
    (args.out / "targets.json").write_text(json.dumps({"targets": rows}, indent=2) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
