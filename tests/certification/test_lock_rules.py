"""DGR-019: the lock is read strictly, hashed canonically, and decides which records count."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dgr_engine.certification.errors import EvidenceInvalid, LockMismatch, LockNotCommitted
from dgr_engine.certification.lock import load_lock
from dgr_engine.models import lookup
from dgr_session.identity import EvidenceClass
from tests.harness import EvidenceKit

REPO_LOCK = Path(__file__).resolve().parents[2] / "certification" / "lock.json"


def test_the_repo_lock_parses() -> None:
    lock = load_lock(REPO_LOCK)
    assert lock.thresholds.speed.stage_counts == (2, 3, 4)
    assert 10 in lock.thresholds.layout_stage_counts
    assert "60d8d70770c6776ff598c94bb586a859a38244f1" in {
        m.official_target_sha for m in lock.real_models
    }
    smollm2 = lock.real_model_of(lookup("smollm2-135m-instruct").sha256)
    assert smollm2 is not None and smollm2.arch == "llama"
    gemma3 = lock.real_model_of(lookup("gemma3-270m").sha256)
    assert gemma3 is not None and gemma3.arch == "gemma3"
    assert {"smollm2-135m-instruct-cpu", "gemma3-270m-cpu"} <= {lane.name for lane in lock.lanes}
    assert lock.hardware_lanes and all(h.backend == "cpu" for h in lock.hardware_lanes)
    real = [c for c in lock.certifiers if EvidenceClass.REAL_HARDWARE in c.classes]
    assert real and all(EvidenceClass.FIXTURE not in c.classes for c in real)
    quantized = lock.thresholds.quantized
    assert (quantized.kld_mean_max, quantized.kld_p99_max) == (0.01, 0.1)
    assert (quantized.top1_agreement_min, quantized.prompt_tokens_min) == (0.97, 256)
    assert {lane.name for lane in lock.lanes} >= {"fixture-dense-cpu", "fixture-v4-cpu"}


def test_the_hash_is_of_the_canonical_form(kit: EvidenceKit) -> None:
    first = kit.lock.sha256
    data = json.loads(kit.lock_path.read_text())
    kit.lock_path.write_text(json.dumps(dict(reversed(list(data.items()))), indent=7))
    assert load_lock(kit.lock_path).sha256 == first  # whitespace and key order do not count
    edited = kit.edit_lock(lambda d: d["thresholds"]["speed"].update(decode_ratio_min=0.5))
    assert edited.sha256 != first  # a threshold does


def _set(path: str, value: Any) -> Any:
    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for part in parents:
            data = data[part]
        if value is _DELETE:
            del data[last]
        else:
            data[last] = value

    return edit


_DELETE = object()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set("schema", "dgr.lock/2"), "schema"),
        (_set("thresholds.speed.decode_ratio_min", _DELETE), "thresholds.speed.decode_ratio_min"),
        (_set("thresholds.speed.decode_ratio_min", "0.8"), "thresholds.speed.decode_ratio_min"),
        (_set("thresholds.speed.decode_ratio_min", True), "thresholds.speed.decode_ratio_min"),
        (_set("thresholds.recovery.max_seconds", -1), "thresholds.recovery.max_seconds"),
        (_set("thresholds.layouts.stage_counts", []), "thresholds.layouts.stage_counts"),
        (_set("thresholds.parity.split_vs_whole", "close"), "thresholds.parity.split_vs_whole"),
        (_set("beta_matrix", ["nowhere"]), "beta_matrix"),
        (_set("locked_at", "2026-12-01T14:30:00"), "locked_at"),
        (lambda d: d["lanes"][0].update({"class": "rumour"}), "lanes[0].class"),
        (lambda d: d["lanes"][2].update(real_model="llama-9"), "lanes[2].real_model"),
    ],
)
def test_a_bad_lock_is_refused_naming_the_file_and_field(
    kit: EvidenceKit, edit: Any, field: str
) -> None:
    with pytest.raises(EvidenceInvalid) as refused:
        kit.edit_lock(edit)
    assert refused.value.field == field
    assert str(kit.lock_path) in str(refused.value) and field in str(refused.value)


@pytest.mark.parametrize("text", ["", "{", '{"schema": "dgr.lock/1", "locked_at": ', "[]"])
def test_a_truncated_or_non_object_lock_is_refused(kit: EvidenceKit, text: str) -> None:
    kit.lock_path.write_text(text)
    with pytest.raises(EvidenceInvalid, match=str(kit.lock_path)):
        load_lock(kit.lock_path)


def test_admit_refuses_another_lock_and_earlier_starts(kit: EvidenceKit) -> None:
    lock = kit.lock
    at = lock.locked_at
    lock.admit(lock.sha256, at, path=None)
    lock.admit(lock.sha256, at + dt.timedelta(days=1), path=None)
    with pytest.raises(LockMismatch) as other:
        lock.admit("ee" * 32, at, path=Path("r.json"))
    assert other.value.field == "lock_sha256"
    assert ("ee" * 8) in str(other.value) and lock.sha256[:16] in str(other.value)
    with pytest.raises(LockMismatch) as early:
        lock.admit(lock.sha256, at - dt.timedelta(seconds=1), path=Path("r.json"))
    assert early.value.field == "started_at" and "before the lock's time" in str(early.value)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
        check=True,
        capture_output=True,
        timeout=30,
    )


def test_the_lock_time_comes_from_git_when_it_is_committed(kit: EvidenceKit) -> None:
    assert kit.lock.committed and kit.lock.commit_time is None  # not in a checkout
    repo = kit.root
    _git(repo, "init", "-q")
    untracked = load_lock(kit.lock_path)
    assert not untracked.committed
    with pytest.raises(LockNotCommitted):
        untracked.require_committed()
    _git(repo, "add", "lock.json")
    _git(repo, "commit", "-q", "-m", "lock")
    committed = load_lock(kit.lock_path)
    assert committed.committed and committed.commit_time is not None
    committed.require_committed()
    assert committed.locked_at == max(committed.declared_at, committed.commit_time)
    kit.lock_path.write_text(kit.lock_path.read_text().replace("0.8", "0.7", 1))
    modified = load_lock(kit.lock_path)
    assert not modified.committed
    with pytest.raises(LockNotCommitted, match="uncommitted"):
        modified.require_committed()
