"""List or build the generated fixture models (random weights: fixture evidence only).

'dgr fixtures list' prints one line per fixture; 'dgr fixtures build NAME...' builds the
named fixtures (or finds them cached) and prints their paths. The hf-* fixtures are
converter-made (transformers, then llama.cpp's convert_hf_to_gguf.py; needs dgr[baseline]);
the *-split ones are split by llama.cpp's llama-gguf-split (the path printed is their manifest).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from dgr_engine.fixtures import (
    FIXTURES,
    AnySpec,
    Deepseek4Spec,
    converted,
    ensure_fixture,
    estimated_bytes,
    split,
)

_PROGRESS_MIN_BYTES = 16 * 1024 * 1024


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="fixtures_command", required=True, metavar="SUBCOMMAND")
    sub.add_parser("list", help="list the fixtures", description="List the fixtures.")
    build = sub.add_parser(
        "build",
        help="build (or find cached) fixtures and print their paths",
        description="Build (or find cached) fixtures and print their paths.",
    )
    names = [*FIXTURES, *converted.names(), *split.SPLITS]
    build.add_argument(
        "names", nargs="+", choices=sorted(names), metavar="NAME", help=", ".join(names)
    )
    build.add_argument(
        "--dir", type=Path, default=None, help="cache directory (default: $DGR_FIXTURES_DIR, ...)"
    )


def run(args: argparse.Namespace) -> int:
    if args.fixtures_command == "list":
        for spec in FIXTURES.values():
            print(_line(spec))
        for name in converted.names():
            hf = converted.lookup(name)
            print(f"{name:<17} {hf.model_class} (converter-made)  {hf.description}")
        for cut in split.SPLITS.values():
            print(f"{cut.name:<17} split by llama-gguf-split  {cut.description}")
        return 0
    for name in args.names:
        if name in FIXTURES:
            print(ensure_fixture(name, args.dir, progress=_print_progress(name)))
        elif name in split.SPLITS:
            print(split.ensure_split(name, args.dir).manifest_path)
        else:
            print(converted.ensure_converted(name, args.dir).gguf)
    return 0


def _line(spec: AnySpec) -> str:
    if isinstance(spec, Deepseek4Spec):
        shape = (
            f"H={spec.n_head}x{spec.head_dim} X={spec.n_expert}/{spec.n_expert_used} "
            f"V={spec.n_vocab} f32"
        )
    else:
        shape = (
            f"H={spec.n_head}/{spec.n_head_kv} FF={spec.n_ff} V={spec.n_vocab} {spec.matrix_dtype}"
        )
    return (
        f"{spec.name:<16} {spec.arch:<6} L={spec.n_layer} E={spec.n_embd} {shape} "
        f"~{estimated_bytes(spec) / 1e6:.1f} MB  {spec.description}"
    )


def _print_progress(name: str) -> Callable[[int, int], None]:
    """Progress lines on stderr every 10 %, for fixtures big enough to take a while."""
    last = [-1]

    def report(done: int, total: int) -> None:
        if total < _PROGRESS_MIN_BYTES:
            return
        step = 10 * done // total
        if step != last[0]:
            last[0] = step
            print(f"{name}: {10 * step:3d}% of {total / 1e6:.0f} MB", file=sys.stderr)

    return report
