"""DGR-070's MTP record: DeepSeek V4's MTP block drafting through routes of workers, one record.

  dgr mtp [--fixture v4-12-mtp | --model FILE.gguf] [--stages 2 3 12] [--no-record]

Serves the model (a DeepSeek V4 GGUF with an MTP block) as in-process workers at each stage
count, runs one greedy session drafting with MTP over the relay, a chain and a ring on each,
and judges the three MTP requirements of DGR-070 (docs/speculative.md): the ownership
contract as served (only the last stage loads and advertises the block), the implementation
(tokens equal the whole model's plain greedy tokens everywhere) and the benchmark (drafts per
pass, the last stage's cost per draft, acceptance: on a random-weight fixture acceptance says
nothing, and the record says so). Writes an MTP record when an evidence class can be derived
(a dgr fixture, or a real model the lock names), signed by --sign-key's certifier key (default:
the fixture certifier, fixture evidence only), and prints DGR-070's verdict at its class.
Exit 0: every MTP requirement passes; 1: one does not; 2: refused (bad input, lock).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from dgr_engine.argtypes import int_in
from dgr_engine.cli._evidence_args import add_evidence_arguments, add_sign_key_argument

FIXTURE = "v4-12-mtp"


def configure(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group()
    model.add_argument("--fixture", default=None, help=f"a V4 fixture (default {FIXTURE})")
    model.add_argument("--model", type=Path, default=None, help="a DeepSeek V4 GGUF with MTP")
    p.add_argument(
        "--stages",
        type=int_in(2, 64),
        nargs="+",
        default=[2, 3, 12],
        help="stage counts of the routes (default 2 3 12)",
    )
    p.add_argument(
        "--tokens", type=int_in(2, 512), default=24, help="tokens per session (default 24)"
    )
    p.add_argument(
        "--no-record", action="store_true", help="print the figures only; write no record"
    )
    add_evidence_arguments(p)
    add_sign_key_argument(p)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from dgr_engine.baseline.records import baseline_record_for, write_admitted
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.certification.gates import evaluate
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.certification.record import (
        RecordKind,
        default_evidence_dir,
        load_evidence,
    )
    from dgr_engine.certification.signing import load_signing_key
    from dgr_engine.errors import EngineError
    from dgr_engine.fixtures import ensure_fixture
    from dgr_engine.gguf_check import check_gguf
    from dgr_engine.speculative.mtp_figures import OPTIONS, TRANSPORTS, measure_mtp
    from dgr_engine.speculative.mtp_record import mtp_figures, mtp_requirements
    from dgr_engine.worker.reporting.identity import BuildIdentity

    started = dt.datetime.now(dt.UTC)
    fixture = (args.fixture or FIXTURE) if args.model is None else None
    try:
        key = None if args.sign_key is None else load_signing_key(args.sign_key)
        lock = load_lock(args.lock)
        path = args.model if fixture is None else ensure_fixture(fixture)
        header = check_gguf(path)  # a missing file, or no GGUF: one line, nothing run
        n_layer = header.n_main_layers
        if not header.owns_mtp_block((0, n_layer)):
            raise ValueError(f"{Path(path).name}: not a DeepSeek V4 model with an MTP block")
        too_many = [n for n in args.stages if n > n_layer]
        if too_many:
            raise ValueError(f"stage counts {too_many} exceed the model's {n_layer} layers")
        _say(f"{Path(path).name}: {n_layer} layers; MTP drafts over {', '.join(TRANSPORTS)}")
        run_ = measure_mtp(path, tuple(args.stages), n_tokens=args.tokens, fixture=fixture)
    except (EvidenceError, EngineError, ValueError, OSError, RuntimeError) as exc:
        print(f"dgr mtp: {exc}", file=sys.stderr)
        return 2
    for stages, f in sorted(run_.items()):
        ms = f["draft_ms_per_token"]
        _say(
            f"  {stages} stages: tokens equal plain greedy {f['tokens_equal']}, "
            f"{f['passes']} passes, {f['drafted']} drafted, {f['accepted']} accepted, "
            f"{'-' if ms is None else f'{ms:.3f}'} ms a draft on the last stage, block on "
            f"stages {[i for i, on in enumerate(f['mtp_loaded']) if on]}"
        )
    requirements = mtp_requirements(run_, fixture=fixture is not None, transports=TRANSPORTS)
    for req in requirements:
        _say(f"  {req.verdict.value:<12} {req.id}: {req.detail}")
    ok = all(req.verdict.value == "pass" for req in requirements)
    if args.no_record:
        _say("no record written (--no-record)")
        return 0 if ok else 1
    evidence = args.evidence if args.evidence is not None else default_evidence_dir()
    argv = ["dgr", "mtp", *(["--model", str(path)] if fixture is None else ["--fixture", fixture])]
    argv += ["--stages", *map(str, args.stages), "--tokens", str(args.tokens)]
    build = BuildIdentity.of_model(path)
    try:
        record, written = write_admitted(
            lambda: baseline_record_for(
                build,
                arch="deepseek4",
                n_layer=n_layer,
                context=OPTIONS.n_ctx_per_session,
                figures=mtp_figures(run_),
                requirements=requirements,
                lock=lock,
                started=started,
                command=argv,
                kind=RecordKind.MTP,
            ),
            lock=lock,
            evidence_dir=evidence,
            started=started,
            key=key,
        )
    except EvidenceError as exc:
        print(f"dgr mtp: no record written: {exc}", file=sys.stderr)
        return 2
    _say(f"record {written} ({record.evidence_class.value} evidence)")
    verdict = evaluate(
        "DGR-070", load_evidence(evidence, lock).records, lock, record.evidence_class
    )
    print(verdict.text())
    return 0 if ok else 1
