"""DGR-020's baseline: safetensors (transformers) against whole-model llama.cpp, one record;
or, for a quantized GGUF (no safetensors), transformers on the same GGUF's weights dequantized.

  dgr baseline HF_DIR [--gguf FILE] [--kv-type f32 --flash-attn off]
  dgr baseline --fixture hf-llama-gqa
  dgr baseline --model smollm2-135m-instruct | --model FILE.gguf [--no-record]

Converts HF_DIR with llama.cpp's own convert_hf_to_gguf.py at the pinned commit (unless --gguf
names the converted file), runs transformers on the CPU in float32 and the whole model in
llama.cpp on the same prompts (teacher-forced logits at every position, greedy tokens, decode and
prefill speed, peak memory, each side in its own process), runs the negative control (the GGUF
with its RoPE base changed must fail parity), writes a baseline record when an evidence class
can be derived (a dgr fixture, or a real model the lock names), signed by --sign-key's
certifier key (default: the fixture certifier, fixture evidence only), and prints DGR-020's
verdict.
--model NAME|PATH (a catalog name of dgr models, fetched and verified, or a GGUF file): the
two sides are transformers in float32 on the GGUF's weights dequantized and whole-model
llama.cpp on the GGUF as it is, teacher-forced on seeded text prompts; figures are the mean and
99th percentile of the KL divergence of their next-token distributions and top-1 agreement,
judged by the lock's thresholds.baseline_quantized.
Exit 0: go; 1: optimize baseline or stop; 2: refused (bad input, lock, extras missing).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from dgr_engine.argtypes import int_in
from dgr_engine.cli._evidence_args import add_evidence_arguments, add_sign_key_argument
from dgr_engine.numerics import FLASH_ATTN_MODES, KV_TYPES, Numerics

if TYPE_CHECKING:
    from dgr_engine.certification.lock import Lock
    from dgr_engine.certification.record import EvidenceRecord


@attrs.frozen
class BaselineSettings:
    """``dgr baseline``'s command line, read once at its edge (:meth:`from_args`)."""

    hf_dir: Path | None
    """``HF_DIR``: a Hugging Face model directory."""
    fixture: str | None
    """``--fixture``: a converter-made fixture by name."""
    model: str | None
    """``--model``: a quantized GGUF, a catalog name or a file (the quantized baseline)."""
    gguf: Path | None
    """``--gguf``: the GGUF converted from :attr:`hf_dir` (``None``: convert it)."""
    kv_type: str
    """``--kv-type``: the KV cache type."""
    flash_attn: str
    """``--flash-attn``: the flash-attention mode."""
    threads: int
    """``--threads``: threads of each side."""
    record: bool
    """Write a record (``--no-record``: print the figures only)."""
    evidence: Path | None
    """``--evidence``: where the record goes (``None``: the default directory)."""
    lock: Path | None
    """``--lock``: the lock (``None``: the default one)."""
    sign_key: Path | None
    """``--sign-key``: the certifier key that signs the record (``None``: the fixture's)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BaselineSettings:
        """The settings :func:`configure` parsed."""
        return cls(
            hf_dir=args.hf_dir,
            fixture=args.fixture,
            model=args.model,
            gguf=args.gguf,
            kv_type=args.kv_type,
            flash_attn=args.flash_attn,
            threads=args.threads,
            record=not args.no_record,
            evidence=args.evidence,
            lock=args.lock,
            sign_key=args.sign_key,
        )


def configure(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("hf_dir", nargs="?", type=Path, help="a Hugging Face model directory")
    model.add_argument("--fixture", help="a converter-made fixture by name (built if missing)")
    model.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="a quantized GGUF: a catalog name (dgr models list) or a file; against its own "
        "weights dequantized in transformers",
    )
    p.add_argument("--gguf", type=Path, help="the GGUF converted from HF_DIR (default: convert)")
    p.add_argument("--kv-type", choices=KV_TYPES, default=KV_TYPES[0], help="KV cache type")
    p.add_argument(
        "--flash-attn", choices=FLASH_ATTN_MODES, default=FLASH_ATTN_MODES[0], help="mode"
    )
    p.add_argument(
        "--threads", type=int_in(1, 1024), default=2, help="threads of each side (default 2)"
    )
    p.add_argument(
        "--no-record", action="store_true", help="print the figures only; write no record"
    )
    add_evidence_arguments(p)
    add_sign_key_argument(p)


def run(args: argparse.Namespace) -> int:
    settings = BaselineSettings.from_args(args)
    if settings.model is not None:
        if settings.gguf is not None:
            print("dgr baseline: --gguf goes with HF_DIR, not with --model", file=sys.stderr)
            return 2
        return _run_quantized(settings, settings.model)
    return _run_hf(settings)


def _say(text: str) -> None:
    print(text, flush=True)


def _model_path(spec: str) -> Path:
    """The GGUF ``spec`` names: a catalog model (fetched and verified, with progress) or a
    file. Raises ``UnknownModel`` for a name that is neither, ``ModelFetchFailed``,
    ``StorageRefused``."""
    from dgr_engine.cli._progress import progress_printer
    from dgr_engine.models import CATALOG, fetch_model, lookup
    from dgr_engine.models.fetch import models_root

    if spec not in CATALOG and (Path(spec).exists() or "/" in spec or spec.endswith(".gguf")):
        return Path(spec)  # a file (checked by the runner: there, and a GGUF)
    model = lookup(spec)  # UnknownModel lists the catalog
    root = models_root(None)
    report, finish = progress_printer("verify")
    try:
        path, _report = fetch_model(
            model,
            root,
            progress=report,
            notice=lambda text: print(f"dgr baseline: {text}", file=sys.stderr),
        )
    finally:
        finish()
    return path


def _run_quantized(settings: BaselineSettings, model: str) -> int:
    from dgr_engine.artifacts.errors import ArtifactError
    from dgr_engine.artifacts.storage import StorageRefused
    from dgr_engine.baseline.errors import BaselineError
    from dgr_engine.baseline.quantized import (
        requirements_of,
        run_quantized_baseline,
        write_quantized_record,
    )
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.certification.signing import load_signing_key
    from dgr_engine.models import ModelFetchFailed, UnknownModel

    started = dt.datetime.now(dt.UTC)
    try:
        key = None if settings.sign_key is None else load_signing_key(settings.sign_key)
        lock = load_lock(settings.lock)
        limits = lock.thresholds.quantized
        gguf = _model_path(model)
        result = run_quantized_baseline(
            gguf,
            min_tokens=limits.prompt_tokens_min,
            numerics=Numerics(settings.kv_type, settings.flash_attn),
            threads=settings.threads,
            progress=_say,
        )
    except (
        BaselineError,
        EvidenceError,
        UnknownModel,
        ModelFetchFailed,
        StorageRefused,
        ArtifactError,
        ValueError,
        OSError,
    ) as exc:
        print(f"dgr baseline: {exc}", file=sys.stderr)
        return 2
    work, d = result.work, result.divergence
    _say(f"next-token distributions: {d.text()}")
    _say(f"negative control (RoPE base changed): {result.negative.text()}")
    _say(
        f"speed (tok/s, llama.cpp / transformers): decode {result.llama.decode_rate(work):.1f} / "
        f"{result.reference.decode_rate(work):.1f} = {result.decode_ratio:.2f}, prefill "
        f"{result.llama.prefill_rate(work):.0f} / {result.reference.prefill_rate(work):.0f} = "
        f"{result.prefill_ratio:.2f}; peak RSS {result.llama.peak_rss_bytes / 2**20:.0f} / "
        f"{result.reference.peak_rss_bytes / 2**20:.0f} MiB; {result.seconds:.0f} s in all"
    )
    for req in requirements_of(result, limits):
        _say(f"  {req.verdict.value:<12} {req.id}: {req.detail}")
    if not settings.record:
        _say("no record written (--no-record)")
        return 0
    return _record_and_verdict(
        settings,
        lock,
        ["--model", model],
        lambda evidence, argv: write_quantized_record(
            result, lock=lock, evidence_dir=evidence, started=started, command=argv, key=key
        ),
    )


def _run_hf(settings: BaselineSettings) -> int:
    from dgr_engine.baseline.errors import BaselineError
    from dgr_engine.baseline.runner import (
        requirements_of,
        run_baseline,
        write_baseline_record,
    )
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.certification.signing import load_signing_key
    from dgr_engine.fixtures.converted import ensure_converted

    say = _say
    started = dt.datetime.now(dt.UTC)
    try:
        key = None if settings.sign_key is None else load_signing_key(settings.sign_key)
        lock = load_lock(settings.lock)
        hf_dir, gguf = settings.hf_dir, settings.gguf
        if settings.fixture is not None:
            fixture = ensure_converted(settings.fixture)
            hf_dir, gguf = fixture.hf_dir, fixture.gguf
        assert hf_dir is not None  # the parser requires HF_DIR, --fixture or --model
        numerics = Numerics(settings.kv_type, settings.flash_attn)
        result = run_baseline(
            hf_dir, gguf=gguf, numerics=numerics, threads=settings.threads, progress=say
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
    if not settings.record:
        return 0
    return _record_and_verdict(
        settings,
        lock,
        [str(hf_dir)],
        lambda evidence, argv: write_baseline_record(
            result, lock=lock, evidence_dir=evidence, started=started, command=argv, key=key
        ),
    )


def _record_and_verdict(
    settings: BaselineSettings,
    lock: Lock,
    model_argv: list[str],
    write: Callable[[Path, list[str]], tuple[EvidenceRecord, Path]],
) -> int:
    """Writes the run's record with ``write(evidence_dir, command)`` and prints DGR-020's
    verdict from the records there: 0 for go, 1 otherwise, 2 when no record could be
    written (its reason in one line)."""
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.certification.gates import evaluate
    from dgr_engine.certification.record import default_evidence_dir, load_evidence

    evidence = settings.evidence if settings.evidence is not None else default_evidence_dir()
    argv = ["dgr", "baseline", *model_argv, "--kv-type", settings.kv_type]
    argv += ["--flash-attn", settings.flash_attn, "--threads", str(settings.threads)]
    try:
        record, path = write(evidence, argv)
    except EvidenceError as exc:
        print(f"dgr baseline: no record written: {exc}", file=sys.stderr)
        return 2
    _say(f"record {path} ({record.evidence_class.value} evidence)")
    verdict = evaluate(
        "DGR-020", load_evidence(evidence, lock).records, lock, record.evidence_class
    )
    _say(verdict.text())
    return 0 if verdict.verdict == "go" else 1
