"""New locks from old ones: an operator declares a real model, a hardware lane or a certifier.

Every function here is pure over the lock's JSON (a ``dict``) and returns a new ``dict``; only
:func:`write_lock` touches the disk. A lock that changes is a new lock (its hash changes, so
every record made under the old one stops counting) with its own time: :func:`write_lock` sets
``locked_at`` to now unless told otherwise, and writes atomically, so a reader sees the old lock
or the new one, never half of either. The result is checked by
:func:`~dgr_engine.certification.lock.load_lock`'s own rules before it replaces anything.

* :func:`declare_real_model`: a real model by its GGUF content hash (or a split manifest's
  hash), and the comparable lane its results are judged in;
* :func:`declare_hardware_lane`: an exact hardware class and build (this machine's:
  :func:`this_hardware_lane`) on which a declared model's records count as real-hardware;
* :func:`declare_certifier`: a key trusted to sign records of some classes
  (:func:`new_signing_key` makes one).
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dgr_engine.certification import signing
from dgr_engine.certification.errors import EvidenceInvalid
from dgr_engine.certification.lock import LOCK_SCHEMA, family_of, format_time, load_lock
from dgr_session.identity import EvidenceClass

_HEX64 = re.compile(r"[0-9a-f]{64}")
REAL_CLASSES = (EvidenceClass.REAL_MODEL, EvidenceClass.REAL_HARDWARE)
"""What an operator's certifier signs by default (release needs a release build and key)."""


class LockEditRefused(EvidenceInvalid):
    """A declaration the lock cannot take (a bad hash, a name that clashes, ...)."""


def _items(data: Mapping[str, Any], name: str) -> list[dict[str, Any]]:
    items = data.get(name, [])
    if not isinstance(items, list):
        raise LockEditRefused(f"{name}: not a list in the lock", field=name)
    return items


def slug(text: str) -> str:
    """Lower case, ``[a-z0-9-]`` only: a name for a lane."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def declare_real_model(
    data: Mapping[str, Any],
    *,
    name: str,
    arch: str,
    content_sha256: str,
    backend: str = "cpu",
    official_target_sha: str = "",
    note: str | None = None,
) -> dict[str, Any]:
    """``data`` with the real model ``name`` declaring ``content_sha256`` among its weights
    (added to an existing declaration of that name, which must have the same architecture),
    and a comparable lane ``<name>-<backend>`` for its real-model and real-hardware results."""
    sha = content_sha256.lower()
    if not _HEX64.fullmatch(sha):
        raise LockEditRefused(
            f"content_sha256: {content_sha256!r} is not a hex SHA-256", field="content_sha256"
        )
    out = copy.deepcopy(dict(data))
    models = _items(out, "real_models")
    for other in models:
        if other.get("name") != name and sha in other.get("content_sha256", []):
            raise LockEditRefused(
                f"real_models: {sha[:16]} is already the real model {other.get('name')!r}'s",
                field="real_models",
            )
    model = next((m for m in models if m.get("name") == name), None)
    if model is None:
        model = {"name": name, "arch": arch, "official_target_sha": official_target_sha}
        model["content_sha256"] = []
        models.append(model)
    elif model.get("arch") != arch:
        raise LockEditRefused(
            f"real_models: {name!r} is declared as {model.get('arch')!r}, not {arch!r}",
            field="real_models",
        )
    if sha not in model["content_sha256"]:
        model["content_sha256"].append(sha)
    if note is not None:
        model["note"] = note
    out["real_models"] = models
    lanes = _items(out, "lanes")
    if not any(lane.get("real_model") == name and lane.get("backend") == backend for lane in lanes):
        lanes.append(
            {
                "name": f"{slug(name)}-{backend}",
                "class": EvidenceClass.REAL_MODEL.value,
                "backend": backend,
                "family": family_of(arch),
                "real_model": name,
            }
        )
    out["lanes"] = lanes
    return out


def declare_hardware_lane(
    data: Mapping[str, Any],
    *,
    name: str,
    hardware: str,
    llama_cpp_commit: str,
    patch_stack_sha256: str,
    backend: str,
) -> dict[str, Any]:
    """``data`` with the hardware lane ``name`` (replacing a lane of that name; refused when
    another name already declares exactly this hardware and build)."""
    out = copy.deepcopy(dict(data))
    lane = {
        "name": name,
        "hardware": hardware,
        "llama_cpp_commit": llama_cpp_commit,
        "patch_stack_sha256": patch_stack_sha256,
        "backend": backend,
    }
    lanes = [h for h in _items(out, "hardware_lanes") if h.get("name") != name]
    fields = ("hardware", "llama_cpp_commit", "patch_stack_sha256", "backend")
    for other in lanes:
        if all(other.get(f) == lane[f] for f in fields):
            raise LockEditRefused(
                f"hardware_lanes: {other.get('name')!r} already declares this hardware and build",
                field="hardware_lanes",
            )
    out["hardware_lanes"] = [*lanes, lane]
    return out


def declare_certifier(
    data: Mapping[str, Any],
    *,
    name: str,
    public_key: Ed25519PublicKey,
    classes: Iterable[EvidenceClass | str] = REAL_CLASSES,
    note: str | None = None,
) -> dict[str, Any]:
    """``data`` with the certifier ``name`` trusted for ``classes`` (replacing one of that name
    or that key)."""
    wanted = [EvidenceClass(c).value for c in classes]
    if not wanted:
        raise LockEditRefused("certifiers: a certifier must be trusted for a class")
    key_text = signing.public_key_text(public_key)
    if signing.key_id_of(public_key) == signing.FIXTURE_CERTIFIER_ID and wanted != ["fixture"]:
        raise LockEditRefused(
            "certifiers: the fixture certifier's private key is public: it may vouch for "
            "fixture evidence only",
            field="certifiers",
        )
    out = copy.deepcopy(dict(data))
    kept = [
        c
        for c in _items(out, "certifiers")
        if c.get("name") != name and c.get("public_key") != key_text
    ]
    entry: dict[str, Any] = {"name": name, "public_key": key_text, "classes": wanted}
    if note is not None:
        entry["note"] = note
    out["certifiers"] = [*kept, entry]
    return out


def this_hardware_lane(name: str | None = None) -> dict[str, str]:
    """The hardware lane of this machine and the build dgr's binding was made from (CPU):
    the fields :func:`declare_hardware_lane` takes. ``name`` defaults to one derived from the
    fingerprint (``cpu-<arch>-<model>-<8 hex of the fingerprint>``)."""
    from dgr_engine._binding import LLAMA_COMMIT, PATCH_STACK_SHA256
    from dgr_engine.certification.hardware import hardware_fingerprint

    hardware = hardware_fingerprint()
    machine, _, rest = hardware.partition(" | ")
    model = rest.partition(" | ")[0]
    digest = hashlib.sha256(hardware.encode()).hexdigest()[:8]
    return {
        "name": name or f"cpu-{slug(machine)}-{slug(model)}-{digest}",
        "hardware": hardware,
        "llama_cpp_commit": LLAMA_COMMIT,
        "patch_stack_sha256": PATCH_STACK_SHA256.hex(),
        "backend": "cpu",
    }


def write_lock(
    data: Mapping[str, Any], path: str | os.PathLike[str], *, locked_at: dt.datetime | None = None
) -> Path:
    """Write ``data`` as the lock at ``path`` with ``locked_at`` (default: now), atomically,
    after checking it as :func:`~dgr_engine.certification.lock.load_lock` would; returns the
    path. Nothing is replaced when the check fails."""
    out = dict(data)
    out["schema"] = out.get("schema", LOCK_SCHEMA)
    out["locked_at"] = format_time(locked_at or dt.datetime.now(dt.UTC))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(out, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".lock-", suffix=".json", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        load_lock(tmp)  # its own rules: a lock that would not load replaces nothing
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def new_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """A fresh Ed25519 certifier key, written to ``path`` as an unencrypted PEM readable by
    its owner only (``0600``); refuses to overwrite a file."""
    target = Path(path)
    key = Ed25519PrivateKey.generate()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise LockEditRefused(f"{target}: exists; a key is never overwritten") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(signing.private_pem(key))
    return key
