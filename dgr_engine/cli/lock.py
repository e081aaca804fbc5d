"""Make and edit locks: declare a real model, this machine's hardware lane, a certifier key.

  dgr lock new FILE [--from LOCK]            a new lock: LOCK's lanes, thresholds and keys
  dgr lock declare-model NAME|GGUF [--name N] [--lock FILE]
  dgr lock declare-hardware [--name N] [--lock FILE]
  dgr lock keygen KEYFILE                    a new Ed25519 certifier key (0600 PEM)
  dgr lock declare-certifier --name N --key KEYFILE [--classes real-model,real-hardware]
  dgr lock show [--lock FILE]

The lock (--lock, else $DGR_LOCK, else the checkout's certification/lock.json) declares the
comparable lanes and every threshold before any result exists (DGR-019). A real model is
declared by its GGUF's content hash (or a split manifest's hash: --sha256), with the lane its
results are judged in; a hardware lane by this machine's fingerprint, llama.cpp commit, patch
stack and backend: records of a declared model made on it are real-hardware evidence, elsewhere
real-model. Every change is a new lock with its own time (now): records made under the old one
stop counting. In a git checkout, commit the lock before certifying under it.
Exit 0: written (or shown); 2: refused, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dgr_session.identity import EvidenceClass

_LOCK_HELP = "the lock (default: $DGR_LOCK, else the checkout's certification/lock.json)"


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="lock_command", required=True, metavar="SUBCOMMAND")
    new = sub.add_parser("new", help="a new lock file", description="Write a new lock file.")
    new.add_argument("file", type=Path, metavar="FILE", help="the new lock (must not exist)")
    new.add_argument(
        "--from",
        dest="base",
        type=Path,
        default=None,
        help="the lock to start from (default: $DGR_LOCK, else the checkout's)",
    )
    model = sub.add_parser(
        "declare-model", help="declare a real model", description="Declare a real model."
    )
    model.add_argument("model", metavar="NAME|GGUF", help="a catalog name or a GGUF file")
    model.add_argument(
        "--name",
        default=None,
        help="its name in the lock (default: the catalog name, else the file's stem)",
    )
    model.add_argument(
        "--sha256",
        default=None,
        help="declare this hash (a split manifest's) instead of the file's",
    )
    hardware = sub.add_parser(
        "declare-hardware",
        help="declare this machine's hardware lane",
        description="Declare this machine's hardware class and build as a hardware lane.",
    )
    hardware.add_argument("--name", default=None, help="the lane's name (default: derived)")
    keygen = sub.add_parser(
        "keygen", help="a new certifier key", description="Write a new Ed25519 certifier key."
    )
    keygen.add_argument("key", type=Path, metavar="KEYFILE", help="where (must not exist)")
    certifier = sub.add_parser(
        "declare-certifier",
        help="trust a certifier key",
        description="Trust a certifier key for some evidence classes.",
    )
    certifier.add_argument("--name", required=True, help="the certifier's name")
    certifier.add_argument(
        "--key",
        type=Path,
        required=True,
        metavar="KEYFILE",
        help="its private key (only the public half goes in the lock)",
    )
    certifier.add_argument(
        "--classes",
        default="real-model,real-hardware",
        help="comma-separated evidence classes it may sign (default: real-model,real-hardware)",
    )
    show = sub.add_parser("show", help="print the lock's declarations", description="Show.")
    for one in (model, certifier):
        one.add_argument(
            "--note", default=None, help="a note kept with the declaration (why, whose, where)"
        )
    for one in (model, hardware, certifier, show):
        one.add_argument("--lock", type=Path, default=None, help=_LOCK_HELP)


def run(args: argparse.Namespace) -> int:
    from dgr_engine.artifacts.errors import ArtifactError
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.models import UnknownModel
    from dgr_session.errors import DgrError

    try:
        return _COMMANDS[args.lock_command](args)
    except (EvidenceError, UnknownModel, ArtifactError, DgrError, ValueError, OSError) as exc:
        text = getattr(exc, "strerror", None) if isinstance(exc, OSError) else None
        where = getattr(exc, "filename", None)
        message = f"{where}: {text}" if text and where else str(exc)
        print(f"dgr lock: {message}", file=sys.stderr)
        return 2


def _lock_path(given: Path | None) -> Path:
    """The lock file named (``--lock``), else the default one, which must load (outside a
    checkout with no ``$DGR_LOCK`` there is none: the refusal says how to name one)."""
    from dgr_engine.certification.lock import load_lock

    return given if given is not None else load_lock(None).path


def _read(path: Path) -> dict[str, Any]:
    from dgr_engine.certification.lock import load_lock

    load_lock(path)  # a lock that does not load is refused with its reason
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _written(path: Path, what: str) -> int:
    from dgr_engine.certification.lock import format_time, load_lock

    lock = load_lock(path)
    print(f"{what}")
    print(
        f"lock {path}: sha256 {lock.sha256[:16]}, locked at {format_time(lock.declared_at)}: a "
        "new lock; records made under the old one no longer count"
    )
    if not lock.committed:
        print("  it is in a git checkout: commit it before certifying under it")
    return 0


def _new(args: argparse.Namespace) -> int:
    from dgr_engine.certification.lock_edit import LockEditRefused, write_lock

    if args.file.exists():
        raise LockEditRefused(f"{args.file}: exists; 'dgr lock new' never overwrites a lock")
    base = _lock_path(args.base)
    write_lock(_read(base), args.file)
    return _written(args.file, f"new lock from {base}")


def _declare_model(args: argparse.Namespace) -> int:
    from dgr_engine.certification.lock_edit import declare_real_model, write_lock
    from dgr_engine.models import CATALOG, resolve_model
    from dgr_engine.reference import arch_of
    from dgr_engine.worker.reporting.identity import model_sha256

    path = _lock_path(args.lock)
    data = _read(path)
    gguf = resolve_model(args.model, notice=lambda text: print(text, flush=True))
    name = args.name or (args.model if args.model in CATALOG else gguf.stem)
    print(f"hashing {gguf} ...", flush=True)
    sha = args.sha256 or model_sha256(gguf).hex()
    arch = arch_of(gguf)
    write_lock(
        declare_real_model(data, name=name, arch=arch, content_sha256=sha, note=args.note), path
    )
    return _written(path, f"declared real model {name} ({arch}): content sha256 {sha}")


def _declare_hardware(args: argparse.Namespace) -> int:
    from dgr_engine.certification.lock_edit import (
        declare_hardware_lane,
        this_hardware_lane,
        write_lock,
    )

    path = _lock_path(args.lock)
    lane = this_hardware_lane(args.name)
    write_lock(declare_hardware_lane(_read(path), **lane), path)
    return _written(
        path,
        f"declared hardware lane {lane['name']}: {lane['hardware']}; llama.cpp "
        f"{lane['llama_cpp_commit'][:12]}, patch stack {lane['patch_stack_sha256'][:12]}, "
        f"{lane['backend']}",
    )


def _keygen(args: argparse.Namespace) -> int:
    from dgr_engine.certification import signing
    from dgr_engine.certification.lock_edit import new_signing_key

    key = new_signing_key(args.key)
    public = key.public_key()
    print(f"key {args.key} (0600): id {signing.key_id_of(public)}")
    print(f"public key {signing.public_key_text(public)}")
    print(
        "keep the file private; declare it with: dgr lock declare-certifier --name NAME --key "
        f"{args.key}"
    )
    return 0


def _declare_certifier(args: argparse.Namespace) -> int:
    from dgr_engine.certification import signing
    from dgr_engine.certification.lock_edit import declare_certifier, write_lock

    path = _lock_path(args.lock)
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    known = {c.value for c in EvidenceClass}
    for cls in classes:
        if cls not in known:
            raise ValueError(
                f"--classes: unknown evidence class {cls!r} (known: {', '.join(sorted(known))})"
            )
    public = signing.load_signing_key(args.key).public_key()
    write_lock(
        declare_certifier(
            _read(path), name=args.name, public_key=public, classes=classes, note=args.note
        ),
        path,
    )
    return _written(
        path,
        f"declared certifier {args.name}: key {signing.key_id_of(public)} for {', '.join(classes)}",
    )


def _show(args: argparse.Namespace) -> int:
    from dgr_engine.certification.lock import format_time, load_lock

    lock = load_lock(_lock_path(args.lock))
    print(
        f"lock {lock.path}: sha256 {lock.sha256[:16]}, locked at {format_time(lock.locked_at)}"
        f"{'' if lock.committed else ' (uncommitted)'}"
    )
    for model in lock.real_models:
        hashes = ", ".join(h[:16] for h in model.content_sha256) or "no hash declared"
        print(f"  real model {model.name} ({model.arch}): {hashes}")
    for hw in lock.hardware_lanes:
        print(
            f"  hardware lane {hw.name}: {hw.hardware}; llama.cpp {hw.llama_cpp_commit[:12]}, "
            f"patch stack {hw.patch_stack_sha256[:12]}, {hw.backend}"
        )
    for lane in lock.lanes:
        named = f", {lane.real_model}" if lane.real_model else ""
        print(
            f"  lane {lane.name}: {lane.evidence_class.value}, {lane.backend}, {lane.family}{named}"
        )
    for c in lock.certifiers:
        print(f"  certifier {c.name}: key {c.key_id} for {', '.join(x.value for x in c.classes)}")
    return 0


_COMMANDS = {
    "new": _new,
    "declare-model": _declare_model,
    "declare-hardware": _declare_hardware,
    "keygen": _keygen,
    "declare-certifier": _declare_certifier,
    "show": _show,
}
