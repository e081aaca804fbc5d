"""Hostile evidence (issue 28): forged, re-hashed, re-signed and mis-classed records, and
release claims without a release. Each is refused with its reason while the honest record
beside it still loads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import attrs
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.certification.classify import derive_facts
from dgr_engine.certification.errors import EvidenceInvalid, ReleaseUnproven, SignatureRefused
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import (
    Requirement,
    Verdict,
    load_evidence,
    load_record,
    write_record,
)
from dgr_engine.certification.registry import find_certification
from dgr_engine.certification.release import CHECKOUT, release_state
from dgr_engine.certification.signing import (
    FIXTURE_CERTIFIER,
    FIXTURE_CERTIFIER_ID,
    key_id_of,
    private_pem,
    public_key_text,
)
from dgr_session.identity import EvidenceClass
from tests.harness import EvidenceKit

REPO = Path(__file__).resolve().parents[2]


def forged(record: Any) -> Any:
    """What the hostile pass did: context 256 -> 512, every verdict "pass" (the signature kept,
    as ``attrs.evolve`` keeps it)."""
    return attrs.evolve(
        record,
        lane=attrs.evolve(record.lane, context_per_session=512),
        requirements=[Requirement(r.id, Verdict.PASS, r.detail) for r in record.requirements],
    )


def refusal(path: Path, lock: Any, **kwargs: Any) -> SignatureRefused:
    with pytest.raises(SignatureRefused) as refused:
        load_record(path, lock, **kwargs)
    assert refused.value.field == "signature" and str(path) in str(refused.value)
    return refused.value


def test_a_forged_record_rehashed_with_dgrs_writer_is_refused(kit: EvidenceKit) -> None:
    honest = kit.record(failing=("isolation.sessions",))
    good = kit.write(honest)
    assert load_record(good, kit.lock).signature is not None
    fake = forged(load_record(good, kit.lock))
    assert fake.record_id != honest.record_id and fake.lane_id != honest.lane_id
    path = write_record(fake, kit.root / "evidence")  # dgr's own writer: a new id, placed right
    err = refusal(path, kit.lock)
    assert (err.reason, err.key_id) == ("bad signature", FIXTURE_CERTIFIER_ID)
    assert "does not verify under key" in str(err)
    loaded = load_evidence(kit.root / "evidence", kit.lock)
    assert loaded.paths == (good,) and [e.reason for e in loaded.refused] == ["bad signature"]  # type: ignore[attr-defined]
    lookup = find_certification(fake.lane, kit.root / "evidence", lock=kit.lock)
    assert lookup.certification is None
    assert any("bad signature" in r for r in lookup.reasons)


def test_an_unsigned_record_is_refused(kit: EvidenceKit) -> None:
    path = write_record(kit.record(), kit.root / "evidence")
    assert json.loads(path.read_text())["signature"] is None
    assert refusal(path, kit.lock).reason == "unsigned"


def test_a_record_signed_by_an_unknown_key_is_refused(kit: EvidenceKit) -> None:
    stranger = Ed25519PrivateKey.generate()
    path = kit.write(kit.record(), key=stranger)
    err = refusal(path, kit.lock)
    assert (err.reason, err.key_id) == ("unknown key", key_id_of(stranger.public_key()))
    assert err.key_id in str(err) and "does not declare" in str(err)


def test_a_signature_taken_from_another_record_is_refused(kit: EvidenceKit) -> None:
    first = load_record(kit.write(kit.record()), kit.lock)
    other = kit.record(family="v4")
    path = write_record(attrs.evolve(other, signature=first.signature), kit.root / "evidence")
    assert refusal(path, kit.lock).reason == "bad signature"


def real_hardware_lock(kit: EvidenceKit) -> Any:
    lane = kit.lane()

    def edit(data: dict[str, Any]) -> None:
        data["real_models"][0]["content_sha256"] = [lane.model_sha256]
        data["hardware_lanes"] = [
            {
                "name": "test-cpu",
                "hardware": lane.hardware,
                "llama_cpp_commit": lane.llama_cpp_commit,
                "patch_stack_sha256": lane.patch_stack_sha256,
                "backend": lane.backend,
            }
        ]

    return kit.edit_lock(edit)


def test_the_fixture_key_cannot_vouch_for_real_hardware(kit: EvidenceKit) -> None:
    lock = real_hardware_lock(kit)
    facts = derive_facts(kit.lane(), fixture_mark=None, lock=lock, release_build=False)
    record = kit.record(facts=facts, lock_sha256=lock.sha256)
    assert record.evidence_class is EvidenceClass.REAL_HARDWARE
    path = kit.write(record, key=FIXTURE_CERTIFIER)
    err = refusal(path, lock)
    assert (err.reason, err.key_id) == ("key not trusted for class", FIXTURE_CERTIFIER_ID)
    assert "trusted for fixture, not real-hardware" in str(err)
    lookup = find_certification(kit.lane(), kit.root / "evidence", lock=lock)
    assert lookup.certification is None
    honest = attrs.evolve(record, command=("dgr", "certify", "--sign-key", "KEY"))
    kit.write(honest)  # the operator's key, which the lock trusts for real-hardware
    lookup = find_certification(kit.lane(), kit.root / "evidence", lock=lock)
    assert lookup.certification is not None
    assert lookup.certification.evidence_class is EvidenceClass.REAL_HARDWARE
    assert any("key not trusted for class" in r for r in lookup.reasons)  # the forgery still


def test_the_lock_never_trusts_the_public_fixture_key_beyond_fixture(kit: EvidenceKit) -> None:
    def widen(data: dict[str, Any]) -> None:
        data["certifiers"][0]["classes"] = ["fixture", "real-hardware"]

    with pytest.raises(EvidenceInvalid) as refused:
        kit.edit_lock(widen)
    assert refused.value.field == "certifiers[0].classes"
    assert "fixture evidence only" in str(refused.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"public_key": "not-a-key"}, "certifiers[0].public_key"),
        ({"classes": ["vibes"]}, "certifiers[0].classes"),
        ({"classes": []}, "certifiers[0].classes"),
    ],
)
def test_a_bad_certifier_is_refused(kit: EvidenceKit, change: dict[str, Any], field: str) -> None:
    with pytest.raises(EvidenceInvalid) as refused:
        kit.edit_lock(lambda d: d["certifiers"][0].update(change))
    assert refused.value.field == field


def test_the_repos_records_verify_under_the_repos_lock() -> None:
    lock = load_lock(REPO / "certification" / "lock.json")
    fixture = lock.certifier(FIXTURE_CERTIFIER_ID)
    assert fixture is not None and fixture.classes == (EvidenceClass.FIXTURE,)
    for certifier in lock.certifiers:  # no key whose private half is in the repo vouches more
        assert certifier is fixture or EvidenceClass.FIXTURE not in certifier.classes
        assert EvidenceClass.RELEASE not in certifier.classes
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "grep", "-l", "BEGIN PRIVATE KEY"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout.split()
    assert all(not path.endswith((".pem", ".key", ".json")) for path in tracked), tracked
    loaded = load_evidence(REPO / "evidence", lock)
    assert loaded.records and not loaded.refused, [str(e) for e in loaded.refused]
    for record in loaded.records:
        assert record.signature is not None
        signer = lock.certifier(record.signature.key_id)
        assert signer is not None and record.evidence_class in signer.classes
        assert (signer is fixture) == (record.evidence_class is EvidenceClass.FIXTURE)
        assert not record.facts.release_build


# --- release needs a release -------------------------------------------------------------------


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30, check=True
    )
    return done.stdout.strip()


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    """A git checkout with one commit and a .gitignore that ignores built modules."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.invalid")
    git(repo, "config", "user.name", "t")
    (repo / "setup.py").write_text("# dgr\n")
    (repo / ".gitignore").write_text("*.so\n__pycache__/\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "release candidate")
    return repo


def test_a_clean_checkout_at_a_final_version_without_a_tag_is_no_release(
    checkout: Path, kit: EvidenceKit
) -> None:
    state = release_state("0.1.0", checkout)
    assert state.commit == git(checkout, "rev-parse", "HEAD") and state.dirty == ()
    assert not state.is_release and any("no release tag v0.1.0" in r for r in state.reasons)
    lock = real_hardware_lock(kit)
    facts = derive_facts(kit.lane(), fixture_mark=None, lock=lock, release_build=state.is_release)
    assert facts.evidence_class is EvidenceClass.REAL_HARDWARE  # at most
    git(checkout, "tag", "v0.2.0")
    assert not release_state("0.1.0", checkout).is_release  # another version's tag
    git(checkout, "tag", "v0.1.0")
    assert release_state("0.1.0", checkout).is_release
    assert not release_state("0.1.0+source", checkout).is_release


@pytest.mark.parametrize(
    ("name", "what"),
    [("notes.txt", "untracked"), ("dgr_engine/_native.abi3.so", "built output (ignored)")],
)
def test_an_untracked_file_or_a_built_output_makes_the_tree_dirty(
    checkout: Path, name: str, what: str
) -> None:
    git(checkout, "tag", "v0.1.0")
    cache = checkout / "__pycache__" / "x.cpython-311.pyc"
    cache.parent.mkdir()
    cache.write_bytes(b"cache")  # the tools' caches never count
    assert release_state("0.1.0", checkout).is_release
    (checkout / name).parent.mkdir(parents=True, exist_ok=True)
    (checkout / name).write_bytes(b"x")
    state = release_state("0.1.0", checkout)
    assert not state.is_release, what
    assert any(name.split("/")[0] in p for p in state.dirty), state.dirty


def test_this_checkout_derives_no_release() -> None:
    from dgr_engine.worker.reporting.identity import dgr_version

    state = release_state(dgr_version(), CHECKOUT)
    assert state.commit is not None  # the suite runs from a checkout
    assert not state.is_release, state


def test_a_release_claim_is_checked_not_taken_from_the_file(
    checkout: Path, kit: EvidenceKit
) -> None:
    lock = real_hardware_lock(kit)
    facts = derive_facts(kit.lane(), fixture_mark=None, lock=lock, release_build=True)
    head = git(checkout, "rev-parse", "HEAD")
    record = kit.record(facts=facts, lock_sha256=lock.sha256, dgr_commit=head)
    assert record.evidence_class is EvidenceClass.RELEASE
    path = kit.write(record)  # the releaser's key
    with pytest.raises(ReleaseUnproven) as refused:
        load_record(path, lock, checkout=checkout)
    assert refused.value.field == "facts.release_build" and "no release tag" in str(refused.value)
    git(checkout, "tag", "v0.1.0")
    assert load_record(path, lock, checkout=checkout).evidence_class is EvidenceClass.RELEASE
    dirty = kit.write(attrs.evolve(record, dgr_commit=head + "+dirty"))
    with pytest.raises(ReleaseUnproven, match="not a clean, known commit"):
        load_record(dirty, lock, checkout=checkout)
    by_operator = kit.write(record, kit.root / "other", key=kit.operator)
    assert refusal(by_operator, lock, checkout=checkout).reason == "key not trusted for class"


# --- dgr certify --sign-key --------------------------------------------------------------------


@pytest.mark.slow  # starts worker processes
def test_sign_key_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    from dgr_engine.tooling.processes import dgr_command

    rsa_like = tmp_path / "garbage.pem"
    rsa_like.write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    for key, says in [
        (tmp_path / "missing.pem", "cannot read"),
        (rsa_like, "not an unencrypted PEM private key"),
    ]:
        done = subprocess.run(
            [dgr_command(), "certify", "--fixture", "tiny-llama", "--sign-key", str(key)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and str(key) in lines[0], done.stderr


@pytest.mark.slow  # starts worker processes
def test_certify_refuses_a_key_the_lock_does_not_trust_before_running(tmp_path: Path) -> None:
    from dgr_engine.tooling.processes import dgr_command

    stranger = tmp_path / "stranger.pem"
    stranger.write_bytes(private_pem(Ed25519PrivateKey.generate()))
    evidence = tmp_path / "evidence"
    done = subprocess.run(
        [
            *(dgr_command(), "certify", "--fixture", "tiny-llama"),
            *("--sign-key", str(stranger), "--evidence", str(evidence)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "does not declare the signing key" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not evidence.exists()


@pytest.mark.slow  # starts worker processes
def test_certify_signs_with_the_key_given(tmp_path: Path, kit: EvidenceKit) -> None:
    from dgr_engine.tooling.processes import dgr_command

    ours = Ed25519PrivateKey.generate()
    lock = kit.edit_lock(
        lambda d: d["certifiers"].append(
            {
                "name": "our-fixture-key",
                "public_key": public_key_text(ours.public_key()),
                "classes": ["fixture"],
            }
        )
    )
    key_file = tmp_path / "ours.pem"
    key_file.write_bytes(private_pem(ours))
    evidence = tmp_path / "evidence"
    base = [dgr_command(), "certify", "--fixture", "tiny-llama", "--evidence", str(evidence)]
    base += ["--lock", str(kit.lock_path)]
    operator = tmp_path / "operator.pem"
    operator.write_bytes(private_pem(kit.operator))  # trusted for real classes, not fixture
    done = subprocess.run(
        [*base, "--sign-key", str(operator)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "not fixture evidence" in done.stderr, done.stderr
    done = subprocess.run(
        [*base, "--sign-key", str(key_file)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"signed by key {key_id_of(ours.public_key())} (our-fixture-key)" in done.stdout
    (record,) = load_evidence(evidence, lock).records
    assert record.signature is not None and record.signature.key_id == key_id_of(ours.public_key())
    assert "--sign-key" in record.command and str(key_file) not in record.command
