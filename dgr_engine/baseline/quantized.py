"""DGR-020 for a quantized GGUF, which has no safetensors: whole-model llama.cpp against
``transformers`` running the same GGUF's weights dequantized to float32, teacher-forced over
seeded prompts, judged by the lock's ``thresholds.baseline_quantized``.

Order: refuse bad input before any work (no such file, not a GGUF, ``torch``/``transformers``/
``accelerate`` missing, an architecture ``transformers`` cannot load from a GGUF); make the
prompts (:mod:`~dgr_engine.baseline.prompts`, at least the lock's ``prompt_tokens_min`` in all);
run each side in its own process (:mod:`~dgr_engine.baseline.runs`); compare the next-token
distributions (:mod:`~dgr_engine.baseline.divergence`); run the negative control (a copy of the
GGUF with its RoPE base changed, which must fail the thresholds). The record, when an evidence
class can be derived, is :func:`write_quantized_record`'s.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import attrs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.baseline import gguf_copy, runs
from dgr_engine.baseline.divergence import Divergence, divergence
from dgr_engine.baseline.errors import ArchitectureNotCovered, ExtrasMissing, GgufInvalid
from dgr_engine.baseline.prompts import PromptSet, PromptSource, seeded_prompts
from dgr_engine.baseline.records import baseline_record_for, write_admitted
from dgr_engine.baseline.runner import negative_control_copy
from dgr_engine.certification.lock import Lock, QuantizedBaseline
from dgr_engine.certification.record import EvidenceRecord, Figure, Requirement, Verdict
from dgr_engine.numerics import Numerics
from dgr_engine.reference import n_layer_of
from dgr_engine.worker.reporting.identity import BuildIdentity

PROMPTS: Final = 4
DECODE_TOKENS: Final = 16
EXTRAS: Final = ("torch", "transformers", "accelerate", "gguf")
"""What the reference side imports (``transformers`` needs ``accelerate`` to load a GGUF)."""
_TRANSFORMERS_ALIASES: Final = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}
"""GGUF architecture names ``transformers`` maps to another of its own before looking them up."""

Progress = Callable[[str], None]


@attrs.frozen
class QuantizedResult:
    """Both sides' figures on one quantized GGUF, their divergence and the negative control's."""

    model: Path
    build: BuildIdentity
    """The GGUF's identity (content hash, tensor types) and the build, with the run's numerics:
    the record's lane."""
    arch: str
    n_layer: int
    numerics: Numerics
    prompts: PromptSet
    work: runs.Work
    reference: runs.SideResult
    """``transformers``, float32, the GGUF's weights dequantized."""
    llama: runs.SideResult
    """Whole-model llama.cpp on the GGUF as it is."""
    divergence: Divergence
    negative: Divergence
    """llama.cpp on the GGUF copy with a changed RoPE base, against the same reference."""
    seconds: float
    """Wall time of the whole run (both sides, the control, their loads)."""

    @property
    def decode_ratio(self) -> float:
        """llama.cpp's decode tokens/s over transformers'."""
        return self.llama.decode_rate(self.work) / self.reference.decode_rate(self.work)

    @property
    def prefill_ratio(self) -> float:
        """llama.cpp's prefill tokens/s over transformers'."""
        return self.llama.prefill_rate(self.work) / self.reference.prefill_rate(self.work)

    def parity_ok(self, limits: QuantizedBaseline) -> bool:
        """Mean KLD, its 99th percentile and top-1 within the locked thresholds."""
        return self.divergence.within(limits)

    def negative_ok(self, limits: QuantizedBaseline) -> bool:
        """The negative control failed the thresholds (the check can tell models apart)."""
        return not self.negative.within(limits)


def check_gguf(path: str | os.PathLike[str]) -> Path:
    """``path`` when it is a readable file starting with the ``GGUF`` magic;
    :class:`~dgr_engine.baseline.errors.GgufInvalid` otherwise."""
    model = Path(path)
    if not model.is_file():
        raise GgufInvalid("no such file" if not model.exists() else "not a file", path=model)
    with model.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GgufInvalid(f"not a GGUF file (it starts with {magic!r}, not b'GGUF')", path=model)
    return model


def require_reference(arch: str, path: Path) -> None:
    """The reference side can run: its packages are installed and ``transformers`` loads
    ``arch`` from a GGUF (:class:`ExtrasMissing`, :class:`ArchitectureNotCovered`)."""
    missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        raise ExtrasMissing(
            f"{', '.join(missing)} not installed: pip install 'dgr[baseline]' (torch, "
            "transformers and accelerate, which transformers needs to load a GGUF)"
        )
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    loadable = set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}
    if arch not in loadable and _TRANSFORMERS_ALIASES.get(arch) not in loadable:
        raise ArchitectureNotCovered(
            f"transformers cannot load architecture {arch!r} from a GGUF (it loads: "
            f"{', '.join(sorted(loadable))})",
            path=path,
        )


def prompt_length(min_tokens: int, n_prompts: int) -> int:
    """Tokens per prompt so that ``n_prompts`` of them reach ``min_tokens`` in all."""
    return max(1, math.ceil(min_tokens / n_prompts))


def run_quantized_baseline(
    gguf: str | os.PathLike[str],
    *,
    min_tokens: int,
    numerics: Numerics | None = None,
    n_prompts: int = PROMPTS,
    n_decode: int = DECODE_TOKENS,
    threads: int = 2,
    work_dir: str | os.PathLike[str] | None = None,
    progress: Progress = lambda _text: None,
) -> QuantizedResult:
    """Runs both sides and the negative control over prompts of at least ``min_tokens`` in all
    (the lock's ``prompt_tokens_min``); no record (see :func:`write_quantized_record`)."""
    began = time.perf_counter()
    if n_decode < 2 or n_prompts < 1 or min_tokens < 1 or threads < 1:
        raise ValueError("n_decode >= 2, n_prompts >= 1, min_tokens >= 1, threads >= 1")
    model = check_gguf(gguf)
    arch = str(gguf_copy.read_value(model, "general.architecture"))
    require_reference(arch, model)
    numerics = numerics if numerics is not None else Numerics()
    progress(f"hashing {model}")
    build = BuildIdentity.of_model(model).with_numerics(numerics)
    n_layer = n_layer_of(model)
    prompts = seeded_prompts(model, n_prompts, prompt_length(min_tokens, n_prompts))
    work = runs.Work(prompts.prompts, n_decode, threads)
    progress(
        f"transformers (CPU, float32 dequantized from the GGUF, {threads} threads): "
        f"{prompts.text()}"
    )
    reference = runs.in_child(runs.run_transformers_gguf, str(model), work)
    progress(f"whole-model llama.cpp ({numerics}, {n_layer} layers): the same prompts")
    llama = runs.in_child(runs.run_llama, str(model), numerics, work)
    result = divergence(reference.logits, llama.logits, reference.tokens, llama.tokens)
    with tempfile.TemporaryDirectory(prefix="dgr-baseline-", dir=work_dir) as tmp:
        progress("negative control: the same GGUF with its RoPE base changed")
        changed = negative_control_copy(model, arch, Path(tmp) / "negative.gguf")
        wrong = runs.in_child(runs.run_llama, str(changed), numerics, work)
    negative = divergence(reference.logits, wrong.logits, reference.tokens, wrong.tokens)
    return QuantizedResult(
        model=model,
        build=build,
        arch=arch,
        n_layer=n_layer,
        numerics=numerics,
        prompts=prompts,
        work=work,
        reference=reference,
        llama=llama,
        divergence=result,
        negative=negative,
        seconds=time.perf_counter() - began,
    )


def figures_of(result: QuantizedResult) -> list[Figure]:
    """Every figure of the run, with its unit."""
    d, n, work = result.divergence, result.negative, result.work
    return [
        Figure("baseline.kld_mean", d.kld_mean, "nats"),
        Figure("baseline.kld_p99", d.kld_p99, "nats"),
        Figure("baseline.kld_max", d.kld_max, "nats"),
        Figure("baseline.top1_agreement", d.top1_agreement, "share"),
        Figure("baseline.max_abs_logit", d.max_abs_logit, "logit"),
        Figure("baseline.tokens_equal", float(d.tokens_equal), "bool"),
        Figure(
            "baseline.first_difference",
            float(-1 if d.first_difference is None else d.first_difference),
            "index",  # -1: equal
        ),
        Figure("baseline.positions", float(d.positions), "count"),
        Figure("baseline.prompts", float(len(result.prompts.prompts)), "count"),
        Figure("baseline.prompts_text", float(result.prompts.source is PromptSource.TEXT), "bool"),
        Figure("negative.kld_mean", n.kld_mean, "nats"),
        Figure("negative.kld_p99", n.kld_p99, "nats"),
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
        Figure("load.llama_seconds", result.llama.load_seconds, "s"),
        Figure("load.transformers_seconds", result.reference.load_seconds, "s"),
        Figure("baseline.seconds", result.seconds, "s"),
    ]


def requirements_of(result: QuantizedResult, limits: QuantizedBaseline) -> list[Requirement]:
    """``baseline.parity`` (the quantized thresholds, and the negative control must fail them),
    ``baseline.speed`` and ``baseline.negative_control``."""
    d = result.divergence
    short = d.shortfalls(limits)
    parity = not short and result.negative_ok(limits)
    detail = (
        f"quantized GGUF against its weights dequantized in transformers: mean KLD "
        f"{d.kld_mean:.3g} nats (locked <= {limits.kld_mean_max:g}), p99 {d.kld_p99:.3g} "
        f"(<= {limits.kld_p99_max:g}), top-1 {d.top1_agreement:.3f} "
        f"(>= {limits.top1_agreement_min:g}) over {d.positions} positions "
        f"(>= {limits.prompt_tokens_min}); greedy tokens "
        f"{'equal' if d.tokens_equal else f'differ at {d.first_difference}'} (reported); "
        f"prompts: {result.prompts.text()}; {result.numerics}"
    )
    if short:
        detail += f"; outside: {', '.join(short)}"
    if not result.negative_ok(limits):
        detail += "; the negative control (RoPE base changed) passed too: parity cannot tell"
    speed = result.decode_ratio >= limits.decode_ratio_min
    work = result.work
    return [
        Requirement("baseline.parity", Verdict.PASS if parity else Verdict.FAIL, detail),
        Requirement(
            "baseline.speed",
            Verdict.PASS if speed else Verdict.FAIL,
            f"decode {result.llama.decode_rate(work):.1f} tok/s (llama.cpp) / "
            f"{result.reference.decode_rate(work):.1f} (transformers, float32) = "
            f"{result.decode_ratio:.2f} (locked >= {limits.decode_ratio_min:g}), "
            f"{work.threads} threads each",
        ),
        Requirement(
            "baseline.negative_control",
            Verdict.PASS if result.negative_ok(limits) else Verdict.FAIL,
            f"RoPE base changed: mean KLD {result.negative.kld_mean:.3g} nats, p99 "
            f"{result.negative.kld_p99:.3g}, top-1 {result.negative.top1_agreement:.3f}",
        ),
    ]


def quantized_record(
    result: QuantizedResult, *, lock: Lock, started: dt.datetime, command: Sequence[str]
) -> EvidenceRecord:
    """The DGR-020 record of ``result`` (``UnclassifiableModel`` for a GGUF the lock does not
    name and that is not a dgr fixture)."""
    return baseline_record_for(
        result.build,
        arch=result.arch,
        n_layer=result.n_layer,
        context=max(len(p) for p in result.work.prompts) + result.work.n_decode,
        figures=figures_of(result),
        requirements=requirements_of(result, lock.thresholds.quantized),
        lock=lock,
        started=started,
        command=command,
    )


def write_quantized_record(
    result: QuantizedResult,
    *,
    lock: Lock,
    evidence_dir: str | os.PathLike[str],
    started: dt.datetime,
    command: Sequence[str],
    key: Ed25519PrivateKey | None = None,
) -> tuple[EvidenceRecord, Path]:
    """:func:`quantized_record`, admitted by the lock and written, signed by ``key``."""
    return write_admitted(
        lambda: quantized_record(result, lock=lock, started=started, command=command),
        lock=lock,
        evidence_dir=evidence_dir,
        started=started,
        key=key,
    )
