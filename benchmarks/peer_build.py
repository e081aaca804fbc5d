"""Builds llama.cpp's own benchmark peers from the pinned, patched source: ``llama-bench``,
``ggml-rpc-server`` and ``llama-batched-bench`` (the build itself, its options, cache and key
are :mod:`dgr_engine.tooling.peer_build`'s, which ``dgr certify`` uses as well).

    python -m benchmarks.peer_build [--force] [--print-prefix]

A cold build took 740 s on this 2-core machine while other builds and tests shared it (12 min
of CPU: 143 compile steps, llama.cpp's common library included); cached, a call takes a second.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dgr_engine.tooling.llama_build import build_module
from dgr_engine.tooling.peer_build import ensure_peers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument(
        "--print-prefix", action="store_true", help="print only the prefix (progress on stderr)"
    )
    args = parser.parse_args(argv)
    stream = sys.stderr if args.print_prefix else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=stream, flush=True)

    build = build_module()
    try:
        prefix = ensure_peers(force=args.force, log=log)
    except build.BuildError as exc:
        print(f"peers: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if args.print_prefix:
        print(prefix, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
