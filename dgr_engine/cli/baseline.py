"""DGR-020's baseline: safetensors (transformers) against whole-model llama.cpp, one record.

  dgr baseline HF_DIR [--gguf FILE] [--kv-type f32 --flash-attn off]
  dgr baseline --fixture hf-llama-gqa

Converts HF_DIR with llama.cpp's own convert_hf_to_gguf.py at the pinned commit (unless --gguf
names the converted file), runs transformers on the CPU in float32 and the whole model in
llama.cpp on the same prompts (teacher-forced logits at every position, greedy tokens, decode and
prefill speed, peak memory, each side in its own process), runs the negative control (the GGUF
with its RoPE base changed must fail parity), writes a baseline record when an evidence class
can be derived (a dgr fixture, or a real model the lock names), signed by --sign-key's
certifier key (default: the fixture certifier, fixture evidence only), and prints DGR-020's
verdict.
Exit 0: go; 1: optimize baseline or stop; 2: refused (bad input, lock, extras missing).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from dgr_engine.cli._evidence_args import add_evidence_arguments, add_sign_key_argument
from dgr_engine.numerics import FLASH_ATTN_MODES, KV_TYPES, Numerics


def configure(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("hf_dir", nargs="?", type=Path, help="a Hugging Face model directory")
    model.add_argument("--fixture", help="a converter-made fixture by name (built if missing)")
    p.add_argument("--gguf", type=Path, help="the GGUF converted from HF_DIR (default: convert)")
    p.add_argument("--kv-type", choices=KV_TYPES, default=KV_TYPES[0], help="KV cache type")
    p.add_argument(
        "--flash-attn", choices=FLASH_ATTN_MODES, default=FLASH_ATTN_MODES[0], help="mode"
    )
    p.add_argument("--threads", type=int, default=2, help="threads of each side (default 2)")
    p.add_argument(
        "--no-record", action="store_true", help="print the figures only; write no record"
    )
    add_evidence_arguments(p)
    add_sign_key_argument(p)


def run(args: argparse.Namespace) -> int:
    from dgr_engine.baseline.errors import BaselineError
    from dgr_engine.baseline.runner import (
        requirements_of,
        run_baseline,
        write_baseline_record,
    )
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.certification.gates import evaluate
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.certification.record import default_evidence_dir, load_evidence
    from dgr_engine.certification.signing import load_signing_key
    from dgr_engine.fixtures.converted import ensure_converted

    def say(text: str) -> None:
        print(text, flush=True)

    started = dt.datetime.now(dt.UTC)
    try:
        key = None if args.sign_key is None else load_signing_key(args.sign_key)
        lock = load_lock(args.lock)
        hf_dir, gguf = args.hf_dir, args.gguf
        if args.fixture is not None:
            fixture = ensure_converted(args.fixture)
            hf_dir, gguf = fixture.hf_dir, fixture.gguf
        numerics = Numerics(args.kv_type, args.flash_attn)
        result = run_baseline(
            hf_dir, gguf=gguf, numerics=numerics, threads=args.threads, progress=say
        )
    except (BaselineError, EvidenceError, ValueError, OSError) as exc:
        print(f"dgr baseline: {exc}", file=sys.stderr)
        return 2
    work, c = result.work, result.comparison
    say(
        f"logits: max |d| {c.max_abs:.3g}, max rel {c.max_rel:.3g}, top-1 agreement "
        f"{c.top1_agreement:.3f} over {c.positions} positions; smallest top-1/top-2 margin "
        f"{c.min_margin:.3g} (error/margin {c.margin_ratio:.3g}); greedy tokens "
        f"{'equal' if c.tokens_equal else f'differ at {c.first_difference}'}"
    )
    say(
        f"speed (tok/s, llama.cpp / transformers): decode {result.llama.decode_rate(work):.0f} / "
        f"{result.reference.decode_rate(work):.0f} = {result.decode_ratio:.2f}, prefill "
        f"{result.llama.prefill_rate(work):.0f} / {result.reference.prefill_rate(work):.0f} = "
        f"{result.prefill_ratio:.2f}; peak RSS {result.llama.peak_rss_bytes / 2**20:.0f} / "
        f"{result.reference.peak_rss_bytes / 2**20:.0f} MiB"
    )
    for req in requirements_of(result, lock.thresholds):
        say(f"  {req.verdict.value:<12} {req.id}: {req.detail}")
    if args.no_record:
        return 0
    evidence = args.evidence if args.evidence is not None else default_evidence_dir()
    argv = ["dgr", "baseline", str(hf_dir), "--kv-type", args.kv_type]
    argv += ["--flash-attn", args.flash_attn, "--threads", str(args.threads)]
    try:
        record, path = write_baseline_record(
            result, lock=lock, evidence_dir=evidence, started=started, command=argv, key=key
        )
    except EvidenceError as exc:
        print(f"dgr baseline: no record: {exc}", file=sys.stderr)
        return 2
    say(f"record {path} ({record.evidence_class.value} evidence)")
    verdict = evaluate(
        "DGR-020", load_evidence(evidence, lock).records, lock, record.evidence_class
    )
    say(verdict.text())
    return 0 if verdict.verdict == "go" else 1
