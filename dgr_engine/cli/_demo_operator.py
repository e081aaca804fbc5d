"""The demo's operator lock: the user of this machine as the operator of their own machine.

Where no record of the demo's lane counts under the repo's lock (another machine's CPU, another
build), the demo certifies the lane itself, and real-model evidence needs a lock that declares
the model and a certifier key that lock trusts. :func:`operator_lock` keeps both in the demo's
own folder (``$DGR_CACHE_DIR/demo``, else ``~/.cache/dgr/demo``; never in the checkout): a lock
made from the repo's (its thresholds, lanes and models) that also declares the model by its
content hash, this machine's hardware lane and the operator's key (``certifier.pem``, 0600),
for real-model and real-hardware records. A lock already there that declares all of that is
kept as it is, so its records stay valid; anything else is replaced by a new lock, with its
own time (records made under the old one stop counting, as for any new lock).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.certification import lock_edit, signing
from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.lock import Lock, load_lock
from dgr_session.identity import EvidenceClass

OPERATOR_NAME = "this-machine-operator"
"""The certifier name the demo's operator key is declared under."""
STATEMENT = (
    "An operator lock made by 'dgr demo' from the repository's lock: the user of this machine "
    "is the operator of their own machine. It declares the demo's real model by content hash, "
    "this machine's hardware lane and the operator's own certifier key (certifier.pem beside "
    "this file), trusted for real-model and real-hardware records. Thresholds are the "
    "repository's, decided before any result."
)


@attrs.frozen
class OperatorLock:
    """The demo's operator lock, its key and where its records go."""

    lock: Lock
    key: Ed25519PrivateKey = attrs.field(repr=False)
    key_path: Path
    evidence: Path
    """Records made under this lock (``home/evidence`` unless told otherwise)."""
    new: bool
    """A new lock was written now (nothing made under an older one counts)."""


def demo_home() -> Path:
    """The demo's own folder: ``$DGR_CACHE_DIR/demo``, else ``~/.cache/dgr/demo``."""
    cache = os.environ.get("DGR_CACHE_DIR")
    return (Path(cache) if cache else Path.home() / ".cache" / "dgr") / "demo"


def _signing_key(path: Path) -> Ed25519PrivateKey:
    if path.exists():
        return signing.load_signing_key(path)
    return lock_edit.new_signing_key(path)


def _declares(
    lock: Lock, data: dict[str, Any], base: dict[str, Any], sha256: str, key_id: str
) -> bool:
    """Whether the lock at hand already says everything the demo needs, with the repo's
    thresholds."""
    lane = lock_edit.this_hardware_lane()
    certifier = lock.certifier(key_id)
    return (
        data.get("thresholds") == base.get("thresholds")
        and lock.real_model_of(sha256) is not None
        and lock.hardware_lane_of(
            lane["hardware"], lane["llama_cpp_commit"], lane["patch_stack_sha256"], lane["backend"]
        )
        is not None
        and certifier is not None
        and set(lock_edit.REAL_CLASSES) <= set(certifier.classes)
    )


def operator_lock(
    base: Lock,
    home: Path,
    *,
    name: str,
    arch: str,
    sha256: str,
    evidence: Path | None = None,
    key_path: Path | None = None,
    statement: str = STATEMENT,
) -> OperatorLock:
    """The operator lock in ``home`` declaring the real model ``name`` (``arch``, GGUF content
    hash ``sha256``), this machine's hardware lane and the operator's key (``key_path``,
    default ``home/certifier.pem``; made 0600 when missing), made from ``base`` (the repo's
    lock) when there is none that does; :class:`EvidenceError` (one line) when it cannot be
    made."""
    key_path = key_path if key_path is not None else home / "certifier.pem"
    key = _signing_key(key_path)
    key_id = signing.key_id_of(key.public_key())
    base_data = json.loads(base.path.read_text())
    path = home / "lock.json"
    records = evidence if evidence is not None else home / "evidence"
    if path.is_file():
        try:
            held = load_lock(path)
            if _declares(held, json.loads(path.read_text()), base_data, sha256, key_id):
                return OperatorLock(held, key, key_path, records, new=False)
        except (EvidenceError, ValueError):
            pass  # unreadable or outdated: a new lock replaces it
    data = dict(base_data, statement=statement)
    data = lock_edit.declare_real_model(data, name=name, arch=arch, content_sha256=sha256)
    lane = lock_edit.this_hardware_lane()
    if (
        base.hardware_lane_of(
            lane["hardware"], lane["llama_cpp_commit"], lane["patch_stack_sha256"], lane["backend"]
        )
        is None
    ):
        data = lock_edit.declare_hardware_lane(data, **lane)
    data = lock_edit.declare_certifier(
        data, name=OPERATOR_NAME, public_key=key.public_key(), classes=lock_edit.REAL_CLASSES
    )
    lock_edit.write_lock(data, path)
    return OperatorLock(load_lock(path), key, key_path, records, new=True)


def expected_class(lock: Lock) -> EvidenceClass:
    """The class a record of the demo's lane gets under ``lock`` on this machine: real-hardware
    when the lock declares this machine's hardware lane, else real-model."""
    lane = lock_edit.this_hardware_lane()
    here = lock.hardware_lane_of(
        lane["hardware"], lane["llama_cpp_commit"], lane["patch_stack_sha256"], lane["backend"]
    )
    return EvidenceClass.REAL_MODEL if here is None else EvidenceClass.REAL_HARDWARE
