"""The demo's operator lock: made once from the repo's lock with the model, this machine's
hardware lane and the operator's key; kept while it declares them; replaced when it does not."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from dgr_engine.certification import signing
from dgr_engine.certification.lock import load_lock
from dgr_engine.cli._demo_operator import OPERATOR_NAME, expected_class, operator_lock
from dgr_session.identity import EvidenceClass

SHA = "ab" * 32


def make(home: Path):  # type: ignore[no-untyped-def]
    return operator_lock(load_lock(), home, name="demo-model", arch="llama", sha256=SHA)


def test_a_new_operator_lock_declares_the_model_this_machine_and_the_key(tmp_path: Path) -> None:
    made = make(tmp_path)
    assert made.new and made.lock.path == tmp_path / "lock.json"
    assert made.evidence == tmp_path / "evidence"
    assert stat.S_IMODE(made.key_path.stat().st_mode) == 0o600
    lock = made.lock
    model = lock.real_model_of(SHA)
    assert model is not None and model.name == "demo-model"
    certifier = lock.certifier(signing.key_id_of(made.key.public_key()))
    assert certifier is not None and certifier.name == OPERATOR_NAME
    assert set(certifier.classes) == {EvidenceClass.REAL_MODEL, EvidenceClass.REAL_HARDWARE}
    assert expected_class(lock) is EvidenceClass.REAL_HARDWARE
    assert lock.committed  # outside any checkout: its own time is its time
    repo = load_lock()
    assert lock.thresholds == repo.thresholds and lock.sha256 != repo.sha256


def test_a_lock_that_declares_everything_is_kept(tmp_path: Path) -> None:
    first = make(tmp_path)
    again = make(tmp_path)
    assert not again.new and again.lock.sha256 == first.lock.sha256
    assert signing.key_id_of(again.key.public_key()) == signing.key_id_of(first.key.public_key())


def test_a_lock_that_no_longer_declares_the_model_is_replaced(tmp_path: Path) -> None:
    first = make(tmp_path)
    data = json.loads(first.lock.path.read_text())
    data["real_models"] = [m for m in data["real_models"] if m["name"] != "demo-model"]
    data["lanes"] = [lane for lane in data["lanes"] if lane.get("real_model") != "demo-model"]
    first.lock.path.write_text(json.dumps(data))
    again = make(tmp_path)
    assert again.new and again.lock.real_model_of(SHA) is not None
    # the key is the operator's: kept, never overwritten
    assert signing.key_id_of(again.key.public_key()) == signing.key_id_of(first.key.public_key())
