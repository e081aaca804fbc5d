"""What verifying a shard's files at load costs: seconds per GiB of hashing every chunk.

A worker no longer trusts a verification state, a size or an mtime (all can be rewritten by
whoever writes the storage root); it hashes every chunk of the files it will load
(``dgr_engine.artifacts.content.check_content``, files side by side in threads). This measures
that check on this machine's disk, on synthetic files of random bytes in a temporary storage
root (removed at the end), beside ``sha256sum`` over the same files (the peer a user would run):

* ``load check, page cache warm``: the files were just written (the usual case right after a
  fetch, and what a worker pays when the files fit in memory);
* ``load check, page cache dropped``: each file's pages evicted first (``posix_fadvise
  DONTNEED`` after ``fsync``), so the disk is read too;
* ``load check, one thread``: the same, warm, one file at a time;
* ``sha256sum (peer)``: coreutils over the same files, warm.

Each row is the best of ``--repeats`` runs (each run's figure is kept in the JSON). Bounded: the
files total ``--gib`` (at most 8), and every run hashes them once. Fixture evidence only.

    python -m benchmarks.artifact_verify [--gib 1] [--files 4] [--repeats 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = 1 << 30
MAX_GIB = 8.0


def _write_files(root: Path, total: int, count: int, chunk_bytes: int) -> list[Any]:
    from dgr_engine.artifacts.manifest import FileEntry

    entries = []
    each = total // count
    block = os.urandom(chunk_bytes)
    for i in range(count):
        name = f"bench-{i + 1:05d}-of-{count:05d}.gguf"
        chunks, whole = [], hashlib.sha256()
        with (root / name).open("wb") as out:
            for start in range(0, each, chunk_bytes):
                # each chunk distinct (its index in the first bytes), so no hash repeats
                data = (i * 1_000_003 + start).to_bytes(8, "little") + block[8:]
                data = data[: min(chunk_bytes, each - start)]
                out.write(data)
                whole.update(data)
                chunks.append(hashlib.sha256(data).hexdigest())
            out.flush()
            os.fsync(out.fileno())
        entries.append(FileEntry(name, each, whole.hexdigest(), chunk_bytes, chunks, []))
    return entries


def _drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _runs(repeats: int, run: Callable[[], float], before: Callable[[], None] | None) -> list[float]:
    seconds = []
    for _ in range(repeats):
        if before is not None:
            before()
        seconds.append(run())
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="seconds per GiB of hashing a shard at load")
    parser.add_argument("--gib", type=float, default=1.0, help=f"bytes to hash (≤ {MAX_GIB})")
    parser.add_argument("--files", type=int, default=4, help="how many files they are split in")
    parser.add_argument("--chunk-mib", type=int, default=16, help="manifest chunk size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write artifact_verify.json here")
    args = parser.parse_args(argv)
    if not 0 < args.gib <= MAX_GIB or not 1 <= args.files <= 64 or not 1 <= args.repeats <= 10:
        parser.error(f"--gib in (0, {MAX_GIB}], --files in [1, 64], --repeats in [1, 10]")

    from dgr_engine.artifacts.content import check_content
    from dgr_engine.artifacts.rootdir import RootDir

    total = int(args.gib * GIB)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dgr-artifact-verify-") as scratch:
        root = Path(scratch)
        entries = _write_files(root, total, args.files, args.chunk_mib << 20)
        paths = [root / e.name for e in entries]
        nbytes = sum(e.size for e in entries)

        def load_check(threads: int | None) -> Callable[[], float]:
            def run() -> float:
                with RootDir.open(root) as directory:
                    check = check_content(directory, entries, threads=threads)
                assert check.ok and check.nbytes == nbytes, check.problems
                return check.seconds

            return run

        def peer(command: str) -> Callable[[], float]:
            def run() -> float:
                began = time.perf_counter()
                subprocess.run([command, *map(str, paths)], check=True, capture_output=True)
                return time.perf_counter() - began

            return run

        plan: list[tuple[str, Callable[[], float], Callable[[], None] | None]] = [
            ("load check, page cache warm", load_check(None), None),
            ("load check, page cache dropped", load_check(None), lambda: _drop_cache(paths)),
            ("load check, one thread", load_check(1), None),
        ]
        sha256sum = shutil.which("sha256sum")
        if sha256sum is not None:
            plan.append(("sha256sum (peer)", peer(sha256sum), None))
        for what, run, before in plan:
            seconds = _runs(args.repeats, run, before)
            best = min(seconds)
            rows.append(
                {
                    "what": what,
                    "seconds": [round(s, 3) for s in seconds],
                    "best_s": round(best, 3),
                    "s_per_gib": round(best / (nbytes / GIB), 3),
                    "mib_per_s": round(nbytes / 2**20 / best, 1),
                }
            )

    load_avg = os.getloadavg()
    print(
        f"{nbytes / GIB:.2f} GiB in {args.files} files, chunks of {args.chunk_mib} MiB, "
        f"{os.cpu_count()} CPUs, load average {load_avg[0]:.2f} (best of {args.repeats})"
    )
    header = f"{'':<32} {'best s':>7} {'s/GiB':>7} {'MiB/s':>8}  runs"
    print(header)
    print("-" * len(header))
    for r in rows:
        runs = " ".join(f"{s:.2f}" for s in r["seconds"])
        print(
            f"{r['what']:<32} {r['best_s']:>7.2f} {r['s_per_gib']:>7.3f} "
            f"{r['mib_per_s']:>8.0f}  {runs}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "bytes": nbytes,
            "files": args.files,
            "chunk_bytes": args.chunk_mib << 20,
            "cpus": os.cpu_count(),
            "load_average": list(load_avg),
            "rows": rows,
        }
        (args.out / "artifact_verify.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
