"""The ``dgr`` command: one module per subcommand, each with ``configure(parser)`` and
``run(args) -> exit code``.

::

    dgr worker    serve one layer range of a GGUF over gRPC
    dgr generate  generate tokens over a route of workers
    dgr chat      a terminal chat loop over a route
    dgr serve     an OpenAI-compatible HTTP server over a route, and a page to chat with it
    dgr demo      the main job: a local route, a stage lost and recovered, whole-model parity
    dgr fixtures  list or build the generated fixture models
    dgr models    list, fetch or locate the real models of the catalog
    dgr certify   certify a lane here: its scenarios over real workers, one evidence record
    dgr baseline  DGR-020: safetensors against whole-model llama.cpp, one baseline record
    dgr artifacts the hashed manifest of a single or split GGUF
    dgr lock      make a lock: declare a real model, a hardware lane, a certifier key
    dgr gate      evaluate DGR-020, DGR-054 or DGR-070 from the records, against the lock
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from dgr_engine.argtypes import OneLineParser
from dgr_engine.cli import (
    artifacts,
    baseline,
    certify,
    chat,
    demo,
    fixtures,
    gate,
    generate,
    lock,
    models,
    serve,
    worker,
)

_SUBCOMMANDS = {
    "worker": worker,
    "generate": generate,
    "chat": chat,
    "serve": serve,
    "demo": demo,
    "fixtures": fixtures,
    "models": models,
    "certify": certify,
    "baseline": baseline,
    "artifacts": artifacts,
    "lock": lock,
    "gate": gate,
}


def parser() -> argparse.ArgumentParser:
    """The whole command line (every subcommand's options)."""
    top = OneLineParser(prog="dgr", description="Distributed GGUF Runtime")
    sub = top.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser
    )
    for name, module in _SUBCOMMANDS.items():
        summary = (module.__doc__ or "").strip().splitlines()[0]
        module.configure(
            sub.add_parser(
                name,
                help=summary,
                description=module.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        code: int = _SUBCOMMANDS[args.command].run(args)
    except BrokenPipeError:  # the reader went away (``dgr gate ... | head``): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush fails quietly
        return 0
    return code
