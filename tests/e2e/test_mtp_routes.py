"""MTP drafts through routes of workers (``docs/speculative.md``): ``tiny-v4-mtp`` served by
in-process workers in 2, 3 and 6 stages (its every layer a stage), one greedy session with MTP
drafts over the relay, a chain and a ring on each: the tokens are the whole model's plain
greedy tokens, the last stage alone loaded and advertised the block, it drafted every pass and
its drafts were verified (random weights: acceptance says nothing, the tokens everything). And
``dgr generate --speculate mtp``, greedy and seeded-sampled, over the relay and a ring: the
text of plain decoding with the same sampler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgr_engine.certification.record import EVIDENCE_DIR_ENV
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.speculative.mtp_figures import TRANSPORTS, layout_of, measure_mtp
from tests import harness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mtp_evidence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture's lanes certified as a user would (``dgr certify``)."""
    root = tmp_path_factory.mktemp("mtp") / "evidence"
    root.mkdir()
    harness.certify(root, "tiny-v4-mtp")
    return root


def test_layouts_cover_the_model() -> None:
    assert layout_of(6, 2) == [(0, 3), (3, 6)]
    assert layout_of(6, 6) == [(i, i + 1) for i in range(6)]
    with pytest.raises(ValueError):
        layout_of(6, 7)


def test_mtp_drafts_keep_plain_greedy_tokens_over_every_transport(mtp_evidence: Path) -> None:
    figures = measure_mtp(ensure_fixture("tiny-v4-mtp"), (2, 3, 6), evidence=mtp_evidence)
    assert sorted(figures) == [2, 3, 6]
    for stages, f in figures.items():
        assert f["tokens_equal"], (stages, {k: f[k]["error"] for k in TRANSPORTS})
        assert f["contract_ok"] and f["mtp_loaded"] == [False] * (stages - 1) + [True]
        for kind in TRANSPORTS:
            run = f[kind]
            assert run["tokens"] == f["expected_tokens"], (stages, kind)
            assert run["drafter"] == "mtp"  # on a ring, the last stage's MTP block
            assert run["passes"] > 0 and run["drafted"] > 0, (stages, kind)
            assert run["mtp_drafts_made"] > 0
        assert f["draft_ms_per_token"] is not None and f["draft_ms_per_token"] > 0


SAMPLED = ("--temperature", "0.8", "--top-p", "0.95", "--min-p", "0.01", "--seed", "11")
"""A seeded sampler (``docs/sampling.md``): with MTP drafts, its tokens stay plain sampling's."""


@pytest.mark.parametrize("sampling", [(), SAMPLED], ids=["greedy", "sampled"])
def test_dgr_generate_speculate_mtp_prints_exactly_the_plain_text(
    mtp_evidence: Path, sampling: tuple[str, ...]
) -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", **{EVIDENCE_DIR_ENV: str(mtp_evidence)})

    def dgr(*args: str) -> subprocess.CompletedProcess[str]:
        base = ["generate", "--spawn", "3", "--fixture", "tiny-v4-mtp", "-n", "16", *sampling]
        base += ["--require", "fixture", "--quiet", "--prompt", "one two three"]
        return subprocess.run(
            [sys.executable, "-m", "dgr_engine.cli", *base, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            stdin=subprocess.DEVNULL,
        )

    plain = dgr("--speculate", "off")
    assert plain.returncode == 0, plain.stderr
    if sampling:  # the seed decides: not the greedy text
        assert plain.stdout != dgr("--speculate", "off", "--temperature", "0").stdout
    for transport in ("relay", "ring"):
        fast = dgr("--speculate", "mtp", "--draft-max", "3", "--transport", transport)
        assert fast.returncode == 0, fast.stderr
        assert fast.stdout == plain.stdout, (transport, fast.stdout, plain.stdout)
        line = next(s for s in fast.stderr.splitlines() if s.startswith("speculation "))
        words = line.split()
        assert words[1] in ("mtp:", "ring:"), line
        assert int(words[words.index("drafted") - 1]) > 0, line
