"""Evaluate a gate of the decision order from the evidence records, against the lock.

  DGR-020  go / optimize baseline / stop        (baseline records)
  DGR-054  alpha / optimize measured bottleneck / stop   (certification records, MTP off)
  DGR-070  beta / targeted optimization / stop/rollback  (+ MTP and the certified matrix)

--class sets the evidence class evaluated at (default: the class the gate's story requires);
only records of that class or above are read, and the verdict line names the class. Records
that are refused (malformed, tampered, made under another lock or before it, unsigned, or
signed by a key the lock does not trust for their class) are listed.
Exit status: 0 for the gate's first (passing) verdict, 1 for any other, 2 on a bad lock or an
--evidence directory that does not exist.
"""

from __future__ import annotations

import argparse
import sys

from dgr_engine.cli._evidence_args import add_evidence_arguments
from dgr_session.identity import EvidenceClass


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("gate", choices=["DGR-020", "DGR-054", "DGR-070"], help="the gate")
    p.add_argument(
        "--class",
        dest="evidence_class",
        choices=[c.value for c in EvidenceClass],
        default=None,
        help="evidence class to evaluate at (default: the story's required class)",
    )
    add_evidence_arguments(p)


def run(args: argparse.Namespace) -> int:
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.certification.gates import VERDICTS, evaluate
    from dgr_engine.certification.lock import format_time, load_lock
    from dgr_engine.certification.record import default_evidence_dir, load_evidence

    try:
        lock = load_lock(args.lock)
    except EvidenceError as exc:
        print(f"dgr gate: {exc}", file=sys.stderr)
        return 2
    if args.evidence is not None and not args.evidence.is_dir():
        print(f"dgr gate: --evidence {args.evidence}: no such directory", file=sys.stderr)
        return 2
    evidence = args.evidence if args.evidence is not None else default_evidence_dir()
    loaded = load_evidence(evidence, lock)
    at = EvidenceClass(args.evidence_class) if args.evidence_class else None
    result = evaluate(args.gate, loaded.records, lock, at)
    print(result.text())
    print(
        f"  lock {lock.path} sha256 {lock.sha256[:16]} locked {format_time(lock.locked_at)}; "
        f"{len(loaded.records)} records admitted from {evidence}, {len(loaded.refused)} refused"
    )
    for refusal in loaded.refused:
        print(f"  refused: {refusal}")
    return 0 if result.verdict == VERDICTS[args.gate][0] else 1
