"""The model a benchmark runs on, from its command line: ``--fixture NAME`` (a generated
fixture, built when missing) or ``--model NAME|PATH`` (a real model of ``dgr models list``,
taken from the models directory or fetched and verified there first, or a GGUF file), and the
``dgr certify`` that makes its lane routable (dark lanes are never routed).

A real model is certified under a lock that declares it (an operator's lock: ``--lock``, with
a certifier key it trusts for real-model evidence: ``--sign-key``); ``--lock`` and
``--evidence`` reach the workers the benchmark starts and its own client through ``$DGR_LOCK``
and ``$DGR_EVIDENCE_DIR`` (:meth:`BenchModel.export_trust`), so certify, workers and client
judge the lane by one lock. A mistake on the command line is :class:`BenchModelError`: the
benchmark prints its one line and exits 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Callable, MutableMapping
from pathlib import Path

import attrs

from dgr_engine.certification.lock import LOCK_ENV
from dgr_engine.certification.record import EVIDENCE_DIR_ENV
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.processes import dgr_command
from dgr_session.errors import DgrError

CERTIFY_TIMEOUT_S = 3600.0
"""Bound on one ``dgr certify`` run (a real model's four layouts take a few minutes here)."""


class BenchModelError(DgrError, ValueError):
    """The model a benchmark was given cannot be had: an unknown name (the message lists the
    catalog and the fixtures), a missing file, a fetch that failed, or a lane that did not
    certify. Nothing was measured."""


@attrs.frozen
class BenchModel:
    """The GGUF a benchmark runs on and what it needs to know of it."""

    path: Path
    label: str
    """The fixture's or catalog's name, else the file's name: what the tables call it."""
    kind: str
    """``fixture`` or ``real model``: the evidence the figures are."""
    n_layer: int
    n_embd: int
    n_vocab: int
    certify_model: tuple[str, ...]
    """``dgr certify``'s model arguments: ``--fixture NAME`` or ``--model PATH``."""
    trust: tuple[str, ...] = ()
    """``--lock``, ``--evidence`` and ``--sign-key`` as given, for ``dgr certify``."""
    lock: Path | None = None
    evidence: Path | None = None

    @property
    def is_fixture(self) -> bool:
        return self.kind == "fixture"

    def evidence_note(self, cores: int | None) -> str:
        """How to read the figures: what kind of model, on how many shared cores."""
        what = "fixture evidence" if self.is_fixture else f"real-model figures ({self.label})"
        return (
            f"{what} on this shared {cores or '?'}-core machine: every process of the run shares "
            "its cores, and other work on the machine runs concurrently"
        )

    def export_trust(self, environ: MutableMapping[str, str] | None = None) -> None:
        """``--lock`` / ``--evidence`` into ``$DGR_LOCK`` / ``$DGR_EVIDENCE_DIR`` (of
        ``environ``, default this process's), so the workers this process starts and its
        client's certification check use them; unset flags leave the environment as it is."""
        env = os.environ if environ is None else environ
        if self.lock is not None:
            env[LOCK_ENV] = str(self.lock.resolve())
        if self.evidence is not None:
            env[EVIDENCE_DIR_ENV] = str(self.evidence.resolve())

    def certify_argv(self, options: EngineOptions) -> list[str]:
        """``dgr certify ... --reuse`` of this model's lane with ``options``."""
        return [
            dgr_command(),
            "certify",
            *self.certify_model,
            "--reuse",
            *options.worker_argv(),
            *self.trust,
        ]

    def certify(self, options: EngineOptions) -> str | None:
        """Certifies this lane (or reuses its record): ``None`` when it passed, else the end of
        what ``dgr certify`` said."""
        proc = subprocess.run(
            self.certify_argv(options),
            capture_output=True,
            text=True,
            timeout=CERTIFY_TIMEOUT_S,
            check=False,
        )
        if proc.returncode == 0:
            return None
        return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])

    def require_certified(self, options: EngineOptions) -> None:
        """:meth:`certify`, and :class:`BenchModelError` in one line when it did not pass
        (the last line ``dgr certify`` printed says why)."""
        failed = self.certify(options)
        if failed is not None:
            last = failed.strip().splitlines()[-1] if failed.strip() else "no output"
            raise BenchModelError(f"{self.label}: dgr certify of its lane failed: {last}")


def add_model_arguments(
    parser: argparse.ArgumentParser, default_fixture: str, *, trust: bool = True
) -> None:
    """``--fixture`` / ``--model`` (one of the two; default: ``--fixture default_fixture``) and,
    with ``trust`` (a benchmark that routes), ``--lock``, ``--evidence`` and ``--sign-key``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--fixture", default=None, help=f"a generated fixture by name (default {default_fixture})"
    )
    group.add_argument(
        "--model",
        default=None,
        metavar="NAME|PATH",
        help="a real model of `dgr models list` (fetched and verified when needed) or a GGUF file",
    )
    parser.set_defaults(default_fixture=default_fixture, lock=None, evidence=None, sign_key=None)
    if not trust:
        return
    parser.add_argument(
        "--lock",
        type=Path,
        default=None,
        help="the lock to certify under (an operator's, "
        "declaring the real model; default $DGR_LOCK, else certification/lock.json)",
    )
    parser.add_argument(
        "--evidence",
        type=Path,
        default=None,
        help="certification records (default $DGR_EVIDENCE_DIR, else the checkout's evidence/)",
    )
    parser.add_argument(
        "--sign-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="the certifier key dgr certify signs with (a real model's records need one the "
        "lock trusts for real-model evidence)",
    )


def resolve(args: argparse.Namespace, notice: Callable[[str], None] | None = None) -> BenchModel:
    """The model ``args`` name (see :func:`add_model_arguments`); ``notice`` hears a fetch.
    :class:`BenchModelError` when it cannot be had."""
    trust = _trust_argv(args)
    for flag in ("lock", "sign_key"):
        given = getattr(args, flag)
        if given is not None and not Path(given).is_file():
            raise BenchModelError(f"--{flag.replace('_', '-')} {given}: no such file")
    if args.model is None:
        model = _fixture(args.fixture or args.default_fixture)
    else:
        model = _real(args.model, notice)
    return attrs.evolve(model, trust=trust, lock=args.lock, evidence=args.evidence)


def _trust_argv(args: argparse.Namespace) -> tuple[str, ...]:
    out: list[str] = []
    for flag in ("lock", "evidence", "sign_key"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return tuple(out)


def _fixture(name: str) -> BenchModel:
    from dgr_engine.fixtures import ensure_fixture, lookup

    try:
        spec = lookup(name)
    except (KeyError, LookupError, ValueError) as exc:
        raise BenchModelError(f"--fixture {name}: {_message(exc)}") from None
    path = ensure_fixture(name)
    return BenchModel(
        path=path,
        label=name,
        kind="fixture",
        n_layer=spec.n_layer,
        n_embd=spec.n_embd,
        n_vocab=spec.n_vocab,
        certify_model=("--fixture", name),
    )


def _real(given: str, notice: Callable[[str], None] | None) -> BenchModel:
    from dgr_engine.models import CATALOG, ModelFetchFailed, UnknownModel, resolve_model

    try:
        path = resolve_model(given, notice=notice)
        n_layer, n_embd, n_vocab = gguf_dims(path)
        marked = fixture_mark(path) is not None
    except (UnknownModel, ModelFetchFailed) as exc:
        raise BenchModelError(f"--model {given}: {exc}") from None
    except FileNotFoundError as exc:
        raise BenchModelError(f"--model {given}: {_message(exc)}") from None
    except (OSError, KeyError, ValueError) as exc:
        raise BenchModelError(f"--model {given}: not a readable GGUF: {_message(exc)}") from None
    return BenchModel(
        path=path,
        label=given if given in CATALOG else path.name,
        kind="fixture" if marked else "real model",  # derived from the file, as certify does
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=n_vocab,
        certify_model=("--model", str(path)),
    )


def gguf_dims(path: Path) -> tuple[int, int, int]:
    """(main layers, embedding width, vocabulary size) of a GGUF, from its metadata."""
    from gguf import GGUFReader

    from dgr_engine.reference import n_layer_of

    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    n_embd = int(reader.fields[f"{arch}.embedding_length"].parts[-1][0])
    vocab = reader.fields.get(f"{arch}.vocab_size")
    if vocab is not None:
        n_vocab = int(vocab.parts[-1][0])
    else:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return n_layer_of(path), n_embd, n_vocab


def fixture_mark(path: Path) -> str | None:
    """The GGUF's ``dgr.fixture`` mark (a generated fixture's), ``None`` when it has none."""
    from gguf import GGUFReader

    from dgr_engine.certification.classify import FIXTURE_MARK_KEY

    field = GGUFReader(path).fields.get(FIXTURE_MARK_KEY)
    return None if field is None else bytes(field.parts[-1]).decode()


def _message(exc: BaseException) -> str:
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
