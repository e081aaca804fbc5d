"""Provisioning and verification of a split model's files: time to fetch, to verify, and to
resume each after an interruption half-way, beside ``sha256sum`` over the same files (what a
user would run instead; it can neither resume nor say which chunk is wrong).

Every run works in a temporary storage root (removed at the end) on this machine's disk, from a
directory source; times are wall seconds of one run each, so page-cache effects are shared
(the files were just written or read). Fixture evidence only.

    python -m benchmarks.artifacts [--split mid-llama-split] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


class _Stop(Exception):
    """Raised from the progress callback half-way: the run stops as if the process died."""


def _stop_half_way() -> Callable[[str, int, int], None]:
    calls = [0]

    def progress(_name: str, done: int, total: int) -> None:
        calls[0] += 1
        if done * 2 >= total and calls[0] > 1:
            raise _Stop

    return progress


def _timed(run: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    result = run()
    return time.perf_counter() - began, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fetch / verify / resume times of a split model")
    parser.add_argument("--split", default="mid-llama-split")
    parser.add_argument("--out", type=Path, default=None, help="write artifacts.json here")
    args = parser.parse_args(argv)

    from dgr_engine.artifacts import provision
    from dgr_engine.artifacts.sources import DirectorySource
    from dgr_engine.fixtures.split import ensure_split

    split = ensure_split(args.split)
    manifest = split.manifest
    size, n_chunks = manifest.size, sum(len(f.chunks) for f in manifest.files)
    source = DirectorySource(split.directory)
    rows: list[dict[str, Any]] = []

    def row(what: str, seconds: float, report: Any = None) -> None:
        entry = {"what": what, "seconds": round(seconds, 3)}
        if report is not None:
            entry["hashed_chunks"] = report.hashed_chunks
            entry["trusted_chunks"] = report.trusted_chunks
        rows.append(entry)

    with tempfile.TemporaryDirectory(prefix="dgr-artifacts-bench-") as scratch:
        root = Path(scratch) / "root"
        seconds, report = _timed(lambda: provision.fetch(manifest, source, root))
        row("fetch (all files)", seconds, report)
        seconds, report = _timed(lambda: provision.verify(manifest, root))
        row("verify (every chunk)", seconds, report)
        sha256sum = shutil.which("sha256sum")
        if sha256sum is not None:
            files = [str(root / f.name) for f in manifest.files]
            seconds, _ = _timed(
                lambda: subprocess.run([sha256sum, *files], check=True, capture_output=True)
            )
            row("sha256sum (peer)", seconds)
        try:
            provision.verify(manifest, root, progress=_stop_half_way())
        except _Stop:
            pass
        seconds, report = _timed(lambda: provision.verify(manifest, root))
        row("verify resumed from half-way", seconds, report)
        again = Path(scratch) / "again"
        try:
            provision.fetch(manifest, source, again, progress=_stop_half_way())
        except _Stop:
            pass
        seconds, report = _timed(lambda: provision.fetch(manifest, source, again))
        row("fetch resumed from half-way", seconds, report)

    print(
        f"{args.split}: {len(manifest.files)} files, {size / MIB:.1f} MiB, {n_chunks} chunks of "
        f"{manifest.files[0].chunk_bytes // MIB} MiB (fixture evidence, this machine, one run)"
    )
    peer = next((r["seconds"] for r in rows if r["what"] == "sha256sum (peer)"), None)
    header = f"{'':<30} {'seconds':>8} {'MiB/s':>8} {'hashed':>7} {'trusted':>8} {'/peer':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        whole = not r.get("trusted_chunks") and r["seconds"] > 0
        rate = f"{size / MIB / r['seconds']:>8.0f}" if whole else f"{'-':>8}"
        ratio = f"{r['seconds'] / peer:>7.2f}" if peer else f"{'-':>7}"
        print(
            f"{r['what']:<30} {r['seconds']:>8.2f} {rate} "
            f"{r.get('hashed_chunks', '-'):>7} {r.get('trusted_chunks', '-'):>8} {ratio}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"split": args.split, "bytes": size, "chunks": n_chunks, "rows": rows}
        (args.out / "artifacts.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
