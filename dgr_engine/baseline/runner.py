"""DGR-020's runner: safetensors (``transformers``, CPU, float32) against whole-model llama.cpp
on the same prompts, the negative control, the record and the gate's verdict.

Order: refuse bad input before any work (no config or weights, an architecture not covered, a
GGUF whose metadata disagrees with the config); convert when no GGUF is given; run each side in
its own process; compare; run the negative control (a copy of the GGUF with the RoPE base
changed, which must fail parity); then, when an evidence class can be derived and the lock
admits it, write a baseline record and evaluate DGR-020 from the records.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import attrs
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gguf import GGUFValueType

from dgr_engine.baseline import converter, gguf_copy, metadata_check, runs
from dgr_engine.baseline.compare import Comparison, compare
from dgr_engine.baseline.records import baseline_record_for, write_admitted
from dgr_engine.certification.lock import Lock, Thresholds
from dgr_engine.certification.record import EvidenceRecord, Figure, Requirement, Verdict
from dgr_engine.numerics import Numerics
from dgr_engine.reference import n_layer_of
from dgr_engine.worker.reporting.identity import BuildIdentity

PROMPTS: Final = 2
PROMPT_TOKENS: Final = 24
DECODE_TOKENS: Final = 16
NEGATIVE_ROPE_FACTOR: Final = 1.5
"""The negative control multiplies the RoPE base by this."""

Progress = Callable[[str], None]


@attrs.frozen
class BaselineResult:
    """Both sides' figures, their comparison and the negative control's."""

    hf_dir: Path
    build: BuildIdentity
    """The GGUF's identity (content hash, tensor types, fixture mark) and the build, with the
    run's numerics: the record's lane."""
    arch: str
    n_layer: int
    numerics: Numerics
    work: runs.Work
    reference: runs.SideResult
    llama: runs.SideResult
    comparison: Comparison
    negative: Comparison
    """llama.cpp on the GGUF copy with a changed RoPE base, against the same reference."""
    convert_seconds: float | None
    """Seconds the conversion took (``None``: the GGUF was given)."""

    @property
    def decode_ratio(self) -> float:
        """llama.cpp's decode tokens/s over transformers'."""
        return self.llama.decode_rate(self.work) / self.reference.decode_rate(self.work)

    @property
    def prefill_ratio(self) -> float:
        """llama.cpp's prefill tokens/s over transformers'."""
        return self.llama.prefill_rate(self.work) / self.reference.prefill_rate(self.work)

    def parity_ok(self, limits: Thresholds) -> bool:
        """Within the locked tolerance, every top-1 and greedy token equal."""
        return _within(self.comparison, limits)

    def negative_ok(self, limits: Thresholds) -> bool:
        """The negative control failed parity (the check can tell models apart)."""
        return not _within(self.negative, limits)


def _within(c: Comparison, limits: Thresholds) -> bool:
    return (
        c.max_abs <= limits.baseline_max_abs_logit
        and c.top1_agreement >= limits.baseline_top1_agreement_min
        and c.tokens_equal
    )


def prompts_for(
    vocab: int, n: int = PROMPTS, length: int = PROMPT_TOKENS
) -> tuple[tuple[int, ...], ...]:
    """Seeded prompts over the vocabulary (ids below 3 are left out: usually special tokens)."""
    rng = np.random.default_rng(20)
    low = 3 if vocab > 3 else 0
    return tuple(tuple(int(t) for t in rng.integers(low, vocab, length)) for _ in range(n))


def run_baseline(
    hf_dir: str | os.PathLike[str],
    *,
    gguf: str | os.PathLike[str] | None = None,
    numerics: Numerics | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    n_prompts: int = PROMPTS,
    prompt_tokens: int = PROMPT_TOKENS,
    n_decode: int = DECODE_TOKENS,
    threads: int = 2,
    progress: Progress = lambda _text: None,
) -> BaselineResult:
    """Runs both sides and the negative control; no record (see :func:`baseline_record`).

    ``gguf``: the converted model (else ``hf_dir`` is converted, f32, into a temporary
    directory, under ``work_dir`` when given, removed afterwards)."""
    hf = Path(hf_dir)
    numerics = numerics if numerics is not None else Numerics()
    config = converter.read_config(hf)
    arch = converter.covered_arch(config, path=hf)
    vocab = int(config.get("vocab_size", 0))
    if vocab < 4 or n_decode < 2 or n_prompts < 1 or prompt_tokens < 1:
        raise ValueError("vocab_size >= 4, n_decode >= 2, n_prompts >= 1, prompt_tokens >= 1")
    with tempfile.TemporaryDirectory(prefix="dgr-baseline-", dir=work_dir) as tmp:
        convert_seconds = None
        if gguf is None:
            progress(f"converting {hf} with llama.cpp's convert_hf_to_gguf.py (f32)")
            model = Path(tmp) / "model.gguf"
            convert_seconds = converter.convert(hf, model, outtype="f32", model_name=hf.name)
        else:
            model = Path(gguf)
        metadata_check.check(model, config, arch)
        build = BuildIdentity.of_model(model).with_numerics(numerics)
        n_layer = n_layer_of(model)
        work = runs.Work(prompts_for(vocab, n_prompts, prompt_tokens), n_decode, threads)
        progress(f"transformers (CPU, float32, {threads} threads): {n_prompts} prompts")
        reference = runs.in_child(runs.run_transformers, str(hf), work)
        progress(f"whole-model llama.cpp ({numerics}): the same prompts")
        llama = runs.in_child(runs.run_llama, str(model), numerics, work)
        comparison = compare(reference.logits, llama.logits, reference.tokens, llama.tokens)
        progress(f"negative control: RoPE base x{NEGATIVE_ROPE_FACTOR:g}")
        changed = negative_control_copy(model, arch, Path(tmp) / "negative.gguf")
        wrong = runs.in_child(runs.run_llama, str(changed), numerics, work)
        negative = compare(reference.logits, wrong.logits, reference.tokens, wrong.tokens)
        return BaselineResult(
            hf_dir=hf,
            build=build,
            arch=arch,
            n_layer=n_layer,
            numerics=numerics,
            work=work,
            reference=reference,
            llama=llama,
            comparison=comparison,
            negative=negative,
            convert_seconds=convert_seconds,
        )


SWA_ROPE_BASE_DEFAULT: Final = 10000.0
"""llama.cpp's RoPE base of sliding-window layers when the GGUF names none
(``{arch}.rope.freq_base_swa``)."""


def negative_control_copy(model: Path, arch: str, out: Path) -> Path:
    """A copy of ``model`` with its RoPE base multiplied by :data:`NEGATIVE_ROPE_FACTOR`; for a
    model with a sliding window, that of its sliding-window layers too (Gemma 3 keeps it apart,
    and most of its layers use it)."""
    changed: dict[str, tuple[float, GGUFValueType]] = {}
    key = f"{arch}.rope.freq_base"
    base = gguf_copy.read_value(model, key)
    value = float(base) * NEGATIVE_ROPE_FACTOR if base is not None else 10000.0 * 1.5
    changed[key] = (value, GGUFValueType.FLOAT32)
    if gguf_copy.read_value(model, f"{arch}.attention.sliding_window"):
        key = f"{arch}.rope.freq_base_swa"
        base = gguf_copy.read_value(model, key)
        value = float(base if base is not None else SWA_ROPE_BASE_DEFAULT) * NEGATIVE_ROPE_FACTOR
        changed[key] = (value, GGUFValueType.FLOAT32)
    return gguf_copy.copy_with(model, out, dict(changed))


def figures_of(result: BaselineResult) -> list[Figure]:
    """Every figure of the run, with its unit."""
    c, n, work = result.comparison, result.negative, result.work
    out = [
        Figure("baseline.max_abs_logit", c.max_abs, "logit"),
        Figure("baseline.max_rel_logit", c.max_rel, "ratio"),
        Figure("baseline.top1_agreement", c.top1_agreement, "share"),
        Figure("baseline.min_margin", c.min_margin, "logit"),
        Figure("baseline.margin_ratio", min(c.margin_ratio, 1e9), "ratio"),  # a 0 margin: 1e9
        Figure("baseline.tokens_equal", float(c.tokens_equal), "bool"),
        Figure("baseline.positions", float(c.positions), "count"),
        Figure("negative.max_abs_logit", n.max_abs, "logit"),
        Figure("negative.top1_agreement", n.top1_agreement, "share"),
        Figure("speed.llama_decode", result.llama.decode_rate(work), "tok/s", "decode"),
        Figure("speed.transformers_decode", result.reference.decode_rate(work), "tok/s", "decode"),
        Figure("speed.decode_ratio", result.decode_ratio, "ratio", "decode"),
        Figure("speed.llama_prefill", result.llama.prefill_rate(work), "tok/s", "prefill"),
        Figure(
            "speed.transformers_prefill", result.reference.prefill_rate(work), "tok/s", "prefill"
        ),
        Figure("speed.prefill_ratio", result.prefill_ratio, "ratio", "prefill"),
        Figure("memory.llama_peak_rss", result.llama.peak_rss_bytes / 2**20, "MiB"),
        Figure("memory.transformers_peak_rss", result.reference.peak_rss_bytes / 2**20, "MiB"),
    ]
    if result.convert_seconds is not None:
        out.append(Figure("convert.seconds", result.convert_seconds, "s"))
    return out


def requirements_of(result: BaselineResult, limits: Thresholds) -> list[Requirement]:
    """``baseline.parity`` (which needs the negative control to fail) and ``baseline.speed``."""
    c = result.comparison
    parity = result.parity_ok(limits) and result.negative_ok(limits)
    detail = (
        f"max |d logit| {c.max_abs:.3g} (locked <= {limits.baseline_max_abs_logit:g}), top-1 "
        f"{c.top1_agreement:.3f} (>= {limits.baseline_top1_agreement_min:g}), greedy tokens "
        f"{'equal' if c.tokens_equal else f'differ at {c.first_difference}'}, {result.numerics}"
    )
    if not result.negative_ok(limits):
        detail += "; the negative control (RoPE base changed) passed too: parity cannot tell"
    speed = result.decode_ratio >= limits.baseline_decode_ratio_min
    return [
        Requirement("baseline.parity", Verdict.PASS if parity else Verdict.FAIL, detail),
        Requirement(
            "baseline.speed",
            Verdict.PASS if speed else Verdict.FAIL,
            f"llama.cpp/transformers decode {result.decode_ratio:.2f} "
            f"(locked >= {limits.baseline_decode_ratio_min:g}), prefill {result.prefill_ratio:.2f}",
        ),
        Requirement(
            "baseline.negative_control",
            Verdict.PASS if result.negative_ok(limits) else Verdict.FAIL,
            f"RoPE base x{NEGATIVE_ROPE_FACTOR:g}: max |d logit| {result.negative.max_abs:.3g}, "
            f"top-1 {result.negative.top1_agreement:.3f}",
        ),
    ]


def baseline_record(
    result: BaselineResult,
    *,
    lock: Lock,
    started: dt.datetime,
    command: Sequence[str],
) -> EvidenceRecord:
    """The DGR-020 record of ``result``. Raises
    :class:`~dgr_engine.certification.errors.UnclassifiableModel` for a GGUF that is neither a
    dgr fixture nor a real model the lock names, and ``LockMismatch`` when the lock declares
    no comparable lane for it."""
    context = max(len(p) for p in result.work.prompts) + result.work.n_decode
    return baseline_record_for(
        result.build,
        arch=result.arch,
        n_layer=result.n_layer,
        context=context,
        figures=figures_of(result),
        requirements=requirements_of(result, lock.thresholds),
        lock=lock,
        started=started,
        command=command,
    )


def write_baseline_record(
    result: BaselineResult,
    *,
    lock: Lock,
    evidence_dir: str | os.PathLike[str],
    started: dt.datetime,
    command: Sequence[str],
    key: Ed25519PrivateKey | None = None,
) -> tuple[EvidenceRecord, Path]:
    """:func:`baseline_record`, admitted by the lock and written, signed by ``key`` (default:
    the fixture certifier, fixture evidence only); returns it and its path."""
    return write_admitted(
        lambda: baseline_record(result, lock=lock, started=started, command=command),
        lock=lock,
        evidence_dir=evidence_dir,
        started=started,
        key=key,
    )
