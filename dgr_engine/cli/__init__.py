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
    dgr mtp       DGR-070: DeepSeek V4's MTP block drafting through routes, one MTP record
    dgr artifacts the hashed manifest of a single or split GGUF
    dgr lock      make a lock: declare a real model, a hardware lane, a certifier key
    dgr gate      evaluate DGR-020, DGR-054 or DGR-070 from the records, against the lock
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from dgr_engine.argtypes import OneLineParser
from dgr_engine.cli._progress import quiet_progress
from dgr_session.errors import DgrError

_SUBCOMMANDS = {
    name: f"dgr_engine.cli.{name}"
    for name in (
        "worker",
        "generate",
        "chat",
        "serve",
        "demo",
        "fixtures",
        "models",
        "certify",
        "baseline",
        "mtp",
        "artifacts",
        "lock",
        "gate",
    )
}
"""Each subcommand's module, imported only when its command runs or the whole command line is
built: ``dgr worker`` never imports ``dgr serve``'s web framework (about 0.6 s of every start)."""


def subcommand(name: str) -> ModuleType:
    """The module of the subcommand ``name`` (``configure`` and ``run``)."""
    return importlib.import_module(_SUBCOMMANDS[name])


QUIET_HELP = "no progress on stderr (results, warnings and errors still print)"


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line (every subcommand's options, and ``--quiet`` on each:
    ``args.quiet``, False unless given); ``only``: the subcommand of that name alone (what
    :func:`main` parses a command line naming it with: the same arguments, the same
    errors, one module imported)."""
    top = OneLineParser(prog="dgr", description="Distributed GGUF Runtime")
    top.set_defaults(quiet=False)
    sub = top.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser
    )
    for name in _SUBCOMMANDS if only is None else (only,):
        module = subcommand(name)
        summary = (module.__doc__ or "").strip().splitlines()[0]
        command = sub.add_parser(
            name,
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(command)
        _add_quiet(command)
    return top


def _add_quiet(p: argparse.ArgumentParser) -> None:
    """``--quiet`` on ``p`` and on its own subcommands (``dgr models fetch NAME --quiet``).
    Set only when given (``SUPPRESS``): a nested parser's default would otherwise overwrite
    ``--quiet`` given before its subcommand."""
    p.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help=QUIET_HELP)
    for action in p._actions:  # argparse has no public way to reach the nested parsers
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                _add_quiet(nested)


DEBUG_ENV = "DGR_DEBUG"
"""Set (to anything but empty or ``0``) to let an error that escapes a subcommand raise with
its traceback instead of the one line :func:`main` prints."""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand and returns its exit status. No traceback reaches the user: an
    error that escapes the subcommand is one line on stderr, ``dgr COMMAND: message`` (a
    ``DgrError``, ``OSError`` or ``ValueError``: a problem with what was given or found) or
    ``dgr COMMAND: unexpected TYPE: message`` naming :data:`DEBUG_ENV`, and exit status 2;
    Ctrl-C is one line and 130. A bad command line is argparse's one line and exit 2."""
    words = list(sys.argv[1:] if argv is None else argv)
    named = words[0] if words and words[0] in _SUBCOMMANDS else None
    args = parser(named).parse_args(words)
    command = args.command
    try:
        with quiet_progress(args.quiet):
            code: int = subcommand(command).run(args)
    except BrokenPipeError:  # the reader went away (``dgr gate ... | head``): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush fails quietly
        return 0
    except KeyboardInterrupt:
        if _debugging():
            raise
        print(f"dgr {command}: interrupted", file=sys.stderr)
        return 130
    except (DgrError, OSError, ValueError) as exc:
        if _debugging():
            raise
        print(f"dgr {command}: {one_line(exc)}", file=sys.stderr)
        for line in getattr(exc, "log_tail", ()):  # a worker that died: what its log said
            print(f"  {line}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug: one line, and how to see the traceback
        if _debugging():
            raise
        print(
            f"dgr {command}: unexpected {type(exc).__name__}: {one_line(exc)} (run with "
            f"{DEBUG_ENV}=1 for the traceback)",
            file=sys.stderr,
        )
        return 2
    return code


def one_line(error: BaseException) -> str:
    """``error``'s message on one line: an ``OSError`` as ``FILE: reason``, line breaks
    folded, the class name when there is no message."""
    summary = getattr(error, "summary", None)  # errors whose text has more lines than one
    if isinstance(summary, str):
        text = summary
    elif isinstance(error, OSError) and error.strerror and error.filename is not None:
        text = f"{error.filename}: {error.strerror}"
    else:
        text = str(error)
    text = " ".join(text.split())
    return text or type(error).__name__


def _debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
