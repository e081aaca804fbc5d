"""Operators' locks: 'dgr lock' declares a real model, a hardware lane and a certifier into a new
lock, each change a new lock with its own time; a refused change writes nothing."""

from __future__ import annotations

import datetime as dt
import json
import stat
from pathlib import Path
from typing import Any

import pytest

from dgr_engine.certification import signing
from dgr_engine.certification.classify import derive_facts
from dgr_engine.certification.errors import EvidenceInvalid
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.lock_edit import (
    LockEditRefused,
    declare_certifier,
    declare_hardware_lane,
    declare_real_model,
    new_signing_key,
    this_hardware_lane,
    write_lock,
)
from dgr_engine.cli import main
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_session.identity import EvidenceClass
from tests.harness import REPO

REPO_LOCK = REPO / "certification" / "lock.json"
SHA_A = "a" * 64
SHA_B = "b" * 64


@pytest.fixture
def base() -> dict[str, Any]:
    """The repo's lock without its hardware lanes (it declares this machine's)."""
    data: dict[str, Any] = json.loads(REPO_LOCK.read_text())
    data["hardware_lanes"] = []
    return data


def test_a_model_is_declared_by_hash_with_its_comparable_lane(base: dict[str, Any]) -> None:
    one = declare_real_model(base, name="m", arch="llama", content_sha256=SHA_A.upper())
    two = declare_real_model(one, name="m", arch="llama", content_sha256=SHA_B)
    model = next(m for m in two["real_models"] if m["name"] == "m")
    assert model["content_sha256"] == [SHA_A, SHA_B]  # a second file of the same model
    lanes = [lane for lane in two["lanes"] if lane.get("real_model") == "m"]
    assert lanes == [
        {
            "name": "m-cpu",
            "class": "real-model",
            "backend": "cpu",
            "family": "dense",
            "real_model": "m",
        }
    ]
    assert "m" not in {m["name"] for m in base["real_models"]}  # pure: the input is unchanged


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda d: declare_real_model(d, name="m", arch="llama", content_sha256="abc"), "hex"),
        (
            lambda d: declare_real_model(
                declare_real_model(d, name="m", arch="llama", content_sha256=SHA_A),
                name="other",
                arch="llama",
                content_sha256=SHA_A,
            ),
            "already the real model 'm'",
        ),
        (
            lambda d: declare_real_model(
                declare_real_model(d, name="m", arch="llama", content_sha256=SHA_A),
                name="m",
                arch="qwen2",
                content_sha256=SHA_B,
            ),
            "declared as 'llama'",
        ),
        (
            lambda d: declare_certifier(
                d, name="x", public_key=signing.FIXTURE_CERTIFIER.public_key()
            ),
            "fixture evidence only",
        ),
    ],
)
def test_a_declaration_the_lock_cannot_take_is_refused(
    base: dict[str, Any], edit: Any, why: str
) -> None:
    with pytest.raises(LockEditRefused, match=why):
        edit(base)


def test_one_hardware_and_build_has_one_name(base: dict[str, Any]) -> None:
    lane = this_hardware_lane("first")
    data = declare_hardware_lane(base, **lane)
    again = declare_hardware_lane(data, **lane)  # the same name: replaced, not doubled
    assert [h["name"] for h in again["hardware_lanes"]].count("first") == 1
    with pytest.raises(LockEditRefused, match="'first' already declares"):
        declare_hardware_lane(data, **{**lane, "name": "second"})


def test_this_hardware_lane_is_what_a_worker_here_states() -> None:
    lane = this_hardware_lane()
    build = BuildIdentity.of_model(ensure_fixture("tiny-llama"))
    assert lane["hardware"] == build.hardware
    assert lane["llama_cpp_commit"] == build.llama_cpp_commit
    assert lane["patch_stack_sha256"] == build.patch_stack_sha256.hex()
    assert lane["backend"] == build.backend
    assert lane["name"].startswith("cpu-")


def test_a_written_lock_has_its_own_time_and_a_refused_one_replaces_nothing(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    path = tmp_path / "lock.json"
    when = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    write_lock(base, path, locked_at=when)
    first = load_lock(path)
    assert first.declared_at == when and first.committed  # outside a checkout: its own time
    broken = {
        **base,
        "lanes": [
            *base["lanes"],
            {
                "name": "x",
                "class": "real-model",
                "backend": "cpu",
                "family": "dense",
                "real_model": "undeclared",
            },
        ],
    }
    with pytest.raises(EvidenceInvalid, match="not a declared real model"):
        write_lock(broken, path)
    assert load_lock(path).sha256 == first.sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock.json"]  # no temporary left


def test_a_key_is_private_and_never_overwritten(tmp_path: Path) -> None:
    key = new_signing_key(tmp_path / "k.pem")
    assert stat.S_IMODE((tmp_path / "k.pem").stat().st_mode) == 0o600
    loaded = signing.load_signing_key(tmp_path / "k.pem")
    assert signing.key_id_of(loaded.public_key()) == signing.key_id_of(key.public_key())
    with pytest.raises(LockEditRefused, match="never overwritten"):
        new_signing_key(tmp_path / "k.pem")


def test_an_operator_lock_made_by_the_commands_derives_real_hardware(
    tmp_path: Path, base: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    lock_path, key = tmp_path / "op" / "lock.json", tmp_path / "op.pem"
    model = ensure_fixture("tiny-llama")
    theirs = write_lock(base, tmp_path / "base.json")
    steps = [
        ["new", str(lock_path), "--from", str(theirs)],
        ["declare-model", str(model), "--name", "tiny", "--lock", str(lock_path)],
        ["declare-hardware", "--name", "here", "--lock", str(lock_path)],
        ["keygen", str(key)],
        ["declare-certifier", "--name", "op", "--key", str(key), "--lock", str(lock_path)],
        ["declare-certifier", "--name", "op", "--key", str(key), "--note", "rotated"]
        + ["--lock", str(lock_path)],  # the same name again: replaced, with its note
    ]
    for step in steps:
        assert main(["lock", *step]) == 0, step
    out = capsys.readouterr().out
    assert "records made under the old one no longer count" in out
    lock = load_lock(lock_path)
    build = BuildIdentity.of_model(model)
    lane = build.lane_key(arch="llama", n_layer=4, context_per_session=256)
    facts = derive_facts(lane, fixture_mark=None, lock=lock, release_build=False)
    assert (facts.real_model, facts.hardware_lane) == ("tiny", "here")
    assert facts.evidence_class is EvidenceClass.REAL_HARDWARE
    certifier = lock.certifier(signing.key_id_of(signing.load_signing_key(key).public_key()))
    assert certifier is not None and certifier.classes == (
        EvidenceClass.REAL_MODEL,
        EvidenceClass.REAL_HARDWARE,
    )
    ops = [c for c in json.loads(lock_path.read_text())["certifiers"] if c["name"] == "op"]
    assert [c.get("note") for c in ops] == ["rotated"]
    assert main(["lock", "show", "--lock", str(lock_path)]) == 0
    shown = capsys.readouterr().out
    assert "real model tiny (llama)" in shown and "hardware lane here" in shown


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["declare-model", "no-such-model"], "the catalog has: gemma3-270m, smollm2-135m-instruct"),
        (["declare-model", "/nonexistent/x.gguf"], "no such GGUF file"),
        (["declare-hardware", "--lock", "/nonexistent/lock.json"], "cannot read the lock"),
        (["new", str(REPO_LOCK)], "never overwrites a lock"),
        (["declare-certifier", "--name", "x", "--key", "/nonexistent.pem"], "nonexistent"),
    ],
)
def test_a_mistake_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = REPO_LOCK.read_bytes()
    assert main(["lock", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dgr lock: ") and err.count("\n") == 1 and message in err, err
    assert REPO_LOCK.read_bytes() == before


def test_an_unknown_class_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock_path, key = tmp_path / "lock.json", tmp_path / "k.pem"
    assert main(["lock", "new", str(lock_path), "--from", str(REPO_LOCK)]) == 0
    assert main(["lock", "keygen", str(key)]) == 0
    before = lock_path.read_bytes()
    argv = [
        "declare-certifier",
        "--name",
        "x",
        "--key",
        str(key),
        "--classes",
        "gold",
        "--lock",
        str(lock_path),
    ]
    assert main(["lock", *argv]) == 2
    assert "unknown evidence class 'gold'" in capsys.readouterr().err
    assert lock_path.read_bytes() == before
