"""Certify a lane on this machine: run its scenarios over real workers, write its record.

The lane is the model (--model or --fixture), this build, this machine's hardware class and
the recipe (the engine options below; the context per session is part of the lane). The
evidence class is derived from facts: a generated fixture gives fixture evidence, whatever
anyone claims. The record goes to EVIDENCE/<class>/<lane-id>/<record-id>.json, signed by the
certifier key --sign-key names (an unencrypted Ed25519 PEM; default: the fixture certifier,
whose private half is public, so it signs fixture evidence only); the lock must trust the key
for the derived class, or nothing runs. With --reuse, a passing record of exactly this lane
under this lock is reused instead of running again.

With no --lock, --evidence or --sign-key named (nor $DGR_LOCK, $DGR_EVIDENCE_DIR), a model that
is no generated fixture is certified under your own operator lock for it instead, made once
outside the checkout (~/.config/dgr/operator: dgr_engine/cli/_own_model.py), unless a record
under the default lock or that lock already counts; generate, chat, serve and worker find it
by themselves (docs/serve.md, "Your own model"). llama.cpp RPC then runs only with --rpc build.

--rpc says when llama.cpp RPC with the route's split (llama-bench and one ggml-rpc-server per
further stage, built from the pinned, patched llama.cpp and cached in <cache>/peers) runs beside
each speed layout, for speed.vs_rpc: 'auto' (default) when the peers are cached, or when the
evidence is real-model or above (built first if missing, with progress: a cold build is about
12 minutes on 2 cores), else speed.vs_rpc is not-measured with the reason and the command that
builds them; 'build' always (built first if missing; exit 2 when they cannot be); 'off' never
(quick demo certifications).

Exit status: 0 when every correctness requirement passed (parity, per-stage execution,
isolation, bounded failure, resources; speed is reported, and judged by 'dgr gate'), 1 when
one failed, 2 when nothing could be certified (a missing model or one that is no GGUF, no lock,
an unclassifiable model), its reason in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from dgr_engine.cli._evidence_args import add_evidence_arguments, add_sign_key_argument
from dgr_engine.cli._lane_certify import certify_or_reuse
from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.cli._own_model import OwnLaneFailed, OwnLaneRefused, applies, settle_own_lane
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.errors import EngineError
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.peer_build import PeerUse
from dgr_session.identity import EvidenceClass


def configure(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model", help="a catalog name (dgr models list; fetched when missing) or a GGUF file"
    )
    model.add_argument("--fixture", help="a generated fixture by name (built if missing)")
    EngineOptions.add_arguments(p)
    add_evidence_arguments(p)
    add_sign_key_argument(p)
    p.add_argument(
        "--reuse",
        action="store_true",
        help="reuse a passing record of exactly this lane under this lock if there is one",
    )
    p.add_argument(
        "--rpc",
        choices=[use.value for use in PeerUse],
        default=PeerUse.AUTO.value,
        help="run llama.cpp RPC with the same split for speed.vs_rpc: auto (when its peers are "
        "cached, or built for real-model evidence), build (always, built if missing), off",
    )
    p.add_argument("--verbose", action="store_true", help="log to stderr")


def run(args: argparse.Namespace) -> int:
    from dgr_engine.certification.errors import EvidenceError, UnclassifiableModel
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.certification.record import default_evidence_dir
    from dgr_engine.certification.signing import load_signing_key
    from dgr_engine.fixtures import ensure_fixture
    from dgr_engine.gguf_check import check_gguf
    from dgr_engine.models import resolve_model
    from dgr_engine.tooling.peer_build import PeersUnavailable
    from dgr_session.errors import DgrError

    if args.verbose:
        log_to_stderr("INFO")
    try:
        key = None if args.sign_key is None else load_signing_key(args.sign_key)
        lock = load_lock(args.lock)
        model = (
            resolve_model(args.model, notice=lambda text: print(text, flush=True))
            if args.model is not None
            else ensure_fixture(args.fixture)
        )
        check_gguf(model)  # a file that is no GGUF, or a truncated one: one line, nothing run
    except (EvidenceError, DgrError, LookupError, ValueError, OSError) as exc:
        print(f"dgr certify: {exc}", file=sys.stderr)
        return 2
    options = EngineOptions.from_args(args)
    if args.sign_key is None and applies(lock=args.lock, evidence=args.evidence, model=model):
        # llama.cpp RPC only when asked by name: 'auto' would build it first for real evidence
        rpc = PeerUse(args.rpc) if args.rpc != PeerUse.AUTO.value else PeerUse.OFF
        return _certify_own_model(model, options, rpc)
    evidence = args.evidence if args.evidence is not None else default_evidence_dir()
    try:
        with sigterm_as_interrupt():
            return asyncio.run(
                certify_or_reuse(
                    model, options, lock, evidence, args.reuse, key=key, rpc=PeerUse(args.rpc)
                )
            )
    except KeyboardInterrupt:
        print("interrupted: every worker stopped, no record written", file=sys.stderr)
        return 130
    except UnclassifiableModel as exc:
        print(
            f"dgr certify: {exc}; to certify it as a real model, declare it in a new lock: "
            f"dgr lock declare-model {args.model or model} --lock {lock.path}",
            file=sys.stderr,
        )
        return 2
    except (EvidenceError, DgrError, ValueError, OSError, PeersUnavailable) as exc:
        print(f"dgr certify: {exc}", file=sys.stderr)
        return 2


def _certify_own_model(model: Path, options: EngineOptions, rpc: PeerUse) -> int:
    """``dgr certify --model M`` with no lock, evidence or key named, on a model that is no
    fixture: its lane certified under the operator's own lock for it, unless a record under
    the defaults or that lock already counts at real-hardware evidence, what ``generate``,
    ``chat`` and ``serve`` require by default (:mod:`dgr_engine.cli._own_model`)."""
    try:
        with sigterm_as_interrupt():
            own = settle_own_lane(
                model, options, EvidenceClass.REAL_HARDWARE, certify_now=True, say=_print, rpc=rpc
            )
    except (OwnLaneRefused, EngineError) as exc:
        print(f"dgr certify: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, OwnLaneFailed) else 2
    if own is None:
        print("a record of this lane under the default lock already counts: nothing to do")
    else:
        print(f"your operator lock {own.lock} certifies this lane; records in {own.evidence}")
    return 0


def _print(text: str) -> None:
    print(text, flush=True)
