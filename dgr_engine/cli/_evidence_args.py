"""The ``--evidence``, ``--lock`` and ``--sign-key`` options the certification-aware programs
share."""

from __future__ import annotations

import argparse
from pathlib import Path

EVIDENCE_HELP = (
    "certification records (default: $DGR_EVIDENCE_DIR, else the checkout's evidence/, "
    "else ~/.cache/dgr/evidence)"
)


def add_evidence_arguments(p: argparse.ArgumentParser, *, lock: bool = True) -> None:
    """Adds ``--evidence DIR`` and, unless ``lock`` is false, ``--lock FILE``."""
    p.add_argument("--evidence", type=Path, default=None, help=EVIDENCE_HELP)
    if lock:
        p.add_argument(
            "--lock", type=Path, default=None, help="the lock (default: certification/lock.json)"
        )


SIGN_KEY_HELP = (
    "the certifier's Ed25519 private key (unencrypted PEM) that signs the record (default: the "
    "fixture certifier, whose key is public: fixture evidence only)"
)


def add_sign_key_argument(p: argparse.ArgumentParser) -> None:
    """Adds ``--sign-key FILE`` (read with
    :func:`~dgr_engine.certification.signing.load_signing_key`)."""
    p.add_argument("--sign-key", type=Path, default=None, metavar="FILE", help=SIGN_KEY_HELP)
