"""DGR-020 for a quantized GGUF: the KL divergence maths on synthetic logits, the requirements
and the gate judged by the lock's quantized thresholds, bad input refused in one line before
any work, and (slow) SmolLM2 itself, fetched through ``dgr models``, its figures finite and no
record written where the lock cannot classify it."""

from __future__ import annotations

import datetime as dt
import math
import re
import subprocess
from pathlib import Path

import attrs
import numpy as np
import pytest

from dgr_engine.baseline import gguf_copy, runs
from dgr_engine.baseline.divergence import Divergence, divergence, kl_divergence, log_softmax
from dgr_engine.baseline.errors import ArchitectureNotCovered, GgufInvalid
from dgr_engine.baseline.prompts import PromptSet, PromptSource, seeded_prompts
from dgr_engine.baseline.quantized import (
    QuantizedResult,
    check_gguf,
    prompt_length,
    quantized_record,
    requirements_of,
    run_quantized_baseline,
    write_quantized_record,
)
from dgr_engine.certification.errors import UnclassifiableModel
from dgr_engine.certification.gates import evaluate
from dgr_engine.certification.lock import QuantizedBaseline, load_lock
from dgr_engine.certification.record import RecordKind, Verdict, load_evidence
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.numerics import Numerics
from dgr_engine.tooling.processes import dgr_command
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_session.identity import EvidenceClass

LIMITS = QuantizedBaseline(
    prompt_tokens_min=256,
    kld_mean_max=0.01,
    kld_p99_max=0.1,
    top1_agreement_min=0.97,
    decode_ratio_min=1.0,
)

# -- the maths ----------------------------------------------------------------------------------


def test_log_softmax_is_float64_normalised_and_does_not_overflow() -> None:
    logits = np.array([[1000.0, 999.0, -1000.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    out = log_softmax(logits)
    assert out.dtype == np.float64 and np.all(np.isfinite(out))
    assert np.allclose(np.exp(out).sum(axis=1), 1.0, atol=1e-12)
    assert out[1] == pytest.approx([-math.log(3)] * 3)
    assert out[0, 0] - out[0, 1] == pytest.approx(1.0)


def test_kl_divergence_matches_the_closed_form_in_its_direction() -> None:
    p, q = 0.9, 0.6  # two tokens: logits log p, log(1 - p)
    ref = np.log(np.array([[p, 1 - p]]))
    got = np.log(np.array([[q, 1 - q]]))
    forward = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    backward = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    assert kl_divergence(ref, got)[0] == pytest.approx(forward, rel=1e-12)
    assert forward != pytest.approx(backward, rel=1e-3)  # the direction matters: P weights it
    assert kl_divergence(got, ref)[0] == pytest.approx(backward, rel=1e-12)


def test_the_same_distribution_diverges_by_nothing_whatever_the_shift() -> None:
    rng = np.random.default_rng(1)
    ref = rng.normal(0, 3, (5, 50))
    assert np.all(kl_divergence(ref, ref + 7.5) == pytest.approx(0.0, abs=1e-12))
    assert np.all(kl_divergence(ref, ref) >= 0.0)
    with pytest.raises(ValueError, match="shape"):
        kl_divergence(ref, ref[:, :10])


def test_divergence_gives_mean_p99_and_top1_over_every_prompts_positions() -> None:
    rng = np.random.default_rng(2)
    ref = [rng.normal(0, 3, (60, 40)), rng.normal(0, 3, (40, 40))]
    for r in ref:  # a clear top-1 everywhere: the noise below cannot flip it
        r[np.arange(len(r)), r.argmax(axis=1)] += 4.0
    got = [r + rng.normal(0, 0.05, r.shape) for r in ref]
    flip = got[1][7].copy()  # position 67: the tested side's top-1 moved to another token
    top = int(np.argmax(ref[1][7]))
    other = (top + 1) % 40
    flip[other] = ref[1][7][top] + 5.0
    got[1][7] = flip
    tokens = [(1, 2, 3), (4, 5)]
    d = divergence(ref, got, tokens, [(1, 2, 3), (4, 6)])
    per_position = kl_divergence(np.concatenate(ref), np.concatenate(got))
    assert d.positions == 100
    assert d.kld_mean == pytest.approx(per_position.mean())
    assert d.kld_p99 == pytest.approx(np.percentile(per_position, 99))
    assert d.kld_max == pytest.approx(per_position.max()) and d.kld_max > d.kld_p99
    assert int(np.argmax(per_position)) == 67  # the flipped position diverges most
    assert d.top1_agreement == pytest.approx(99 / 100)
    gaps = np.abs(np.concatenate(got) - np.concatenate(ref))
    assert d.max_abs_logit == pytest.approx(gaps.max()) and d.max_abs_logit > 5.0  # the flip
    assert not d.tokens_equal and d.first_difference == 4
    assert divergence(ref, ref, tokens, tokens).tokens_equal
    with pytest.raises(ValueError, match="number of prompts"):
        divergence(ref, got[:1], tokens, tokens)


def _div(**changes: object) -> Divergence:
    base = Divergence(
        kld_mean=0.004,
        kld_p99=0.05,
        kld_max=0.2,
        top1_agreement=0.98,
        tokens_equal=False,
        first_difference=3,
        positions=256,
    )
    return attrs.evolve(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"kld_mean": 0.0101}, "mean KLD"),
        ({"kld_p99": 0.11}, "p99 KLD"),
        ({"top1_agreement": 0.969}, "top-1"),
        ({"positions": 255}, "positions"),
        ({"kld_mean": float("nan")}, "mean KLD"),
    ],
)
def test_each_threshold_alone_fails_the_judgement_and_is_named(
    changes: dict[str, float], named: str
) -> None:
    assert _div().within(LIMITS) and _div().shortfalls(LIMITS) == []
    worse = _div(**changes)
    assert not worse.within(LIMITS)
    (short,) = worse.shortfalls(LIMITS)
    assert named in short


def test_at_the_thresholds_themselves_the_judgement_passes() -> None:
    edge = _div(kld_mean=0.01, kld_p99=0.1, top1_agreement=0.97, positions=256)
    assert edge.within(LIMITS)


# -- requirements, the record and the gate (synthetic sides, a fixture's identity) -------------


def _side(rate: float) -> runs.SideResult:
    # 2 prompts x (8 - 1) decoded tokens in 14 / rate seconds: decode_rate == rate
    return runs.SideResult((), ((1,), (2,)), 1.0, 14.0 / rate, 0.1, 100 * 2**20)


def _result(
    *, parity: Divergence, negative: Divergence, llama_rate: float = 50.0
) -> QuantizedResult:
    model = ensure_fixture("tiny-llama")
    prompts = PromptSet(((5,) * 128, (6,) * 128), PromptSource.TEXT, 20)
    return QuantizedResult(
        model=model,
        build=BuildIdentity.of_model(model).with_numerics(Numerics()),
        arch="llama",
        n_layer=4,
        numerics=Numerics(),
        prompts=prompts,
        work=runs.Work(prompts.prompts, 8, 2),
        reference=_side(10.0),
        llama=_side(llama_rate),
        divergence=parity,
        negative=negative,
        seconds=3.0,
    )


FAILS = _div(kld_mean=0.5, kld_p99=3.0, top1_agreement=0.5)


def test_parity_passes_within_the_thresholds_when_the_negative_control_fails() -> None:
    result = _result(parity=_div(), negative=FAILS)
    reqs = {r.id: r for r in requirements_of(result, LIMITS)}
    assert reqs["baseline.parity"].verdict is Verdict.PASS
    assert reqs["baseline.negative_control"].verdict is Verdict.PASS
    assert reqs["baseline.speed"].verdict is Verdict.PASS  # 50 / 10 = 5.0 >= 1.0
    assert "5.00" in reqs["baseline.speed"].detail
    detail = reqs["baseline.parity"].detail
    assert "mean KLD 0.004" in detail and "differ at 3" in detail
    assert "text from the built-in corpus, seed 20" in detail


def test_a_negative_control_within_the_thresholds_fails_parity_too() -> None:
    result = _result(parity=_div(), negative=_div())
    reqs = {r.id: r for r in requirements_of(result, LIMITS)}
    assert reqs["baseline.parity"].verdict is Verdict.FAIL
    assert reqs["baseline.negative_control"].verdict is Verdict.FAIL
    assert "parity cannot tell" in reqs["baseline.parity"].detail


def test_slower_decode_than_transformers_fails_speed_only() -> None:
    result = _result(parity=_div(), negative=FAILS, llama_rate=9.0)
    reqs = {r.id: r for r in requirements_of(result, LIMITS)}
    assert reqs["baseline.speed"].verdict is Verdict.FAIL
    assert reqs["baseline.parity"].verdict is Verdict.PASS


@pytest.mark.parametrize(
    ("parity", "llama_rate", "answer"),
    [
        (_div(), 50.0, "go"),
        (_div(), 9.0, "optimize baseline"),
        (_div(top1_agreement=0.965), 50.0, "stop"),
    ],
)
def test_dgr_020_decides_from_the_quantized_record(
    parity: Divergence, llama_rate: float, answer: str, tmp_path: Path
) -> None:
    lock = load_lock(None)
    result = _result(parity=parity, negative=FAILS, llama_rate=llama_rate)
    started = dt.datetime.now(dt.UTC)
    record, path = write_quantized_record(
        result, lock=lock, evidence_dir=tmp_path, started=started, command=["test"]
    )
    assert record.kind is RecordKind.BASELINE and path.is_file()
    assert record.evidence_class is EvidenceClass.FIXTURE  # tiny-llama carries the mark
    assert record.figure("baseline.kld_mean").value == parity.kld_mean
    assert record.figure("baseline.prompts_text").value == 1.0
    verdict = evaluate(
        "DGR-020", load_evidence(tmp_path, lock).records, lock, record.evidence_class
    )
    assert verdict.verdict == answer, verdict.text()


def test_a_real_model_the_lock_does_not_name_gets_no_record(tmp_path: Path) -> None:
    lock = load_lock(None)
    unmarked = tmp_path / "unmarked.gguf"  # a GGUF without the fixture mark: not a fixture
    gguf_copy.copy_with(ensure_fixture("tiny-llama"), unmarked, {}, without=["dgr.fixture"])
    result = attrs.evolve(
        _result(parity=_div(), negative=FAILS),
        model=unmarked,
        build=BuildIdentity.of_model(unmarked).with_numerics(Numerics()),
    )
    assert result.build.fixture_mark is None
    with pytest.raises(UnclassifiableModel):
        quantized_record(result, lock=lock, started=dt.datetime.now(dt.UTC), command=["t"])
    evidence = tmp_path / "evidence"
    with pytest.raises(UnclassifiableModel):
        write_quantized_record(
            result, lock=lock, evidence_dir=evidence, started=dt.datetime.now(dt.UTC), command=[]
        )
    assert not evidence.exists() or not any(evidence.rglob("*.json"))


# -- prompts and bad input ----------------------------------------------------------------------


def test_prompts_reach_the_locked_minimum_and_are_seeded() -> None:
    assert prompt_length(256, 4) * 4 >= 256 and prompt_length(257, 4) * 4 >= 257
    model = ensure_fixture("tiny-llama")  # no tokenizer: seeded random ids
    one, two = seeded_prompts(model, 4, 64), seeded_prompts(model, 4, 64)
    assert one == two and one.tokens == 256 and one.source is PromptSource.RANDOM_IDS
    assert len(set(one.prompts)) == 4
    assert seeded_prompts(model, 4, 64, seed=21) != one


def test_a_missing_file_or_a_non_gguf_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(GgufInvalid, match="no such file"):
        check_gguf(tmp_path / "absent.gguf")
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(GgufInvalid, match="not a GGUF"):
        run_quantized_baseline(text, min_tokens=8)
    assert check_gguf(ensure_fixture("tiny-llama")).is_file()


def test_an_architecture_transformers_cannot_load_is_named() -> None:
    with pytest.raises(ArchitectureNotCovered, match="'deepseek4'"):
        run_quantized_baseline(ensure_fixture("tiny-v4"), min_tokens=8)


def _baseline(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [dgr_command(), "baseline", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "smollm3"], "the catalog has: gemma3-270m, smollm2-135m-instruct"),
        (["--model", "/nonexistent/model.gguf"], "no such file"),
        (["--model", "smollm2-135m-instruct", "--gguf", "x.gguf"], "--gguf goes with HF_DIR"),
    ],
)
def test_command_line_mistakes_are_one_line_and_exit_2(argv: list[str], says: str) -> None:
    done = _baseline(*argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_file_that_is_not_a_gguf_is_one_line_and_exit_2(tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    done = _baseline("--model", str(text))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "not a GGUF file" in done.stderr and str(text) in done.stderr


# -- the real model ------------------------------------------------------------------------------

SMOLLM2 = "smollm2-135m-instruct"
FIGURE = re.compile(
    r"mean KLD (\S+) nats, p99 (\S+), max (\S+), top-1 (\S+) over (\d+) positions; greedy "
    r"tokens (equal|differ at \d+)"
)


@pytest.mark.slow  # fetches SmolLM2 once (about 94 MiB), then both sides and the control, ~1 min
def test_smollm2_figures_are_finite_and_no_record_is_written_without_its_declaration(
    tmp_path: Path,
) -> None:
    fetched = subprocess.run(
        [dgr_command(), "models", "fetch", SMOLLM2], capture_output=True, text=True, timeout=900
    )
    assert fetched.returncode == 0, fetched.stderr
    model = Path(fetched.stdout.strip())
    lock = load_lock(None)
    declared = lock.real_model_of(BuildIdentity.of_model(model).model_sha256.hex()) is not None
    evidence = tmp_path / "evidence"
    argv = ["--model", SMOLLM2, "--evidence", str(evidence)]
    done = _baseline(*argv, timeout=900)
    figures = FIGURE.search(done.stdout)
    assert figures is not None, done.stdout + done.stderr
    mean, p99, top, top1, positions = (float(x) for x in figures.groups()[:5])
    assert all(math.isfinite(x) for x in (mean, p99, top, top1))
    assert 0.0 <= mean <= p99 <= top and 0.0 <= top1 <= 1.0
    assert positions >= lock.thresholds.quantized.prompt_tokens_min
    assert "text from the built-in corpus" in done.stdout
    assert re.search(r"decode \S+ / \S+ = \d+\.\d+", done.stdout)
    for rid in ("baseline.parity", "baseline.speed", "baseline.negative_control"):
        assert re.search(rf"(pass|fail)\s+{rid}:", done.stdout), rid
    if declared:  # the repo's lock names SmolLM2: real evidence, which needs the operator's
        # key (not given here), so the figures are printed and nothing is written
        assert done.returncode == 2, done.stderr
        assert "no record written" in done.stderr and "--sign-key" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1
        assert not evidence.exists() or not any(evidence.rglob("*.json"))
    else:
        assert done.returncode == 2 and "no record written" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1
        assert not evidence.exists() or not any(evidence.rglob("*.json"))
