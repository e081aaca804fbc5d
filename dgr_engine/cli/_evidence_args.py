"""The ``--evidence`` and ``--lock`` options the certification-aware programs share."""

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
