"""Your own model in one command: the lane a spawned route runs, certified under your own lock.

A command that spawns its workers (``--spawn``) and names no lock or evidence of its own (no
``--lock``/``--evidence``, no ``$DGR_LOCK``/``$DGR_EVIDENCE_DIR``) runs the lane of its model on
this machine, which must be certified before any session is routed over it. In order:

1. a record of the lane under the default lock in the default evidence directory (the lanes the
   project certified): nothing changes;
2. else a record under the **operator's own lock for this model**: the user of this machine is
   the operator of their own machine. Each model has its own folder,
   ``<operator home>/models/<name>-<12 hex of its hash>/`` (its ``lock.json`` and
   ``evidence/``), so declaring a second model never invalidates the records of the first (a
   record counts only under the exact lock it was made under); one certifier key,
   ``<operator home>/certifier.pem`` (0600), signs for all of them. The operator home is
   ``$DGR_OPERATOR_HOME``, else ``$XDG_CONFIG_HOME/dgr/operator`` (default
   ``~/.config/dgr/operator``): never inside the checkout, and never the checkout's lock;
3. else, when asked (``--certify``; a clear yes on a terminal; or ``dgr certify --model M``
   alone): that lock is made once from the default lock (its thresholds, lanes and models),
   declaring the model by its content hash, this machine's hardware lane and the key, and the
   lane is certified with progress (llama.cpp RPC off, as the demo does), then used as in 2;
4. else the command is refused in one line naming the one command that fixes it.

A generated fixture is never an operator's model: its records are fixture evidence under the
default lock (``dgr certify --fixture NAME``).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

import attrs

from dgr_engine.certification import lock_edit
from dgr_engine.certification.classify import FIXTURE_MARK_KEY
from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.lane import LaneKey
from dgr_engine.certification.lock import LOCK_ENV, Lock, load_lock
from dgr_engine.certification.record import EVIDENCE_DIR_ENV, default_evidence_dir
from dgr_engine.certification.registry import find_certification
from dgr_engine.cli._demo_operator import operator_lock
from dgr_engine.cli._lane_certify import certify_or_reuse
from dgr_engine.errors import EngineError
from dgr_engine.gguf_check import check_gguf
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.peer_build import PeerUse
from dgr_session.errors import DgrError
from dgr_session.identity import EvidenceClass

__all__ = [
    "OPERATOR_HOME_ENV",
    "OwnLane",
    "OwnLaneFailed",
    "OwnLaneRefused",
    "OwnModel",
    "applies",
    "certify_own_model",
    "held_own_lane",
    "operator_home",
    "own_model",
    "settle_own_lane",
    "terminal_yes",
]

OPERATOR_HOME_ENV = "DGR_OPERATOR_HOME"
"""Environment variable naming the operator home (else ``$XDG_CONFIG_HOME/dgr/operator``)."""
STATEMENT = (
    "An operator lock made by dgr for one model of the operator's own (a command run with "
    "--certify, or 'dgr certify --model M' with no lock named) from the default lock: the user "
    "of this machine is the operator of their own machine. It declares the model by content "
    "hash, this machine's hardware lane and the operator's own certifier key (certifier.pem in "
    "the operator home), trusted for real-model and real-hardware records. Thresholds are the "
    "default lock's, decided before any result."
)
_CHECKOUT = Path(__file__).resolve().parents[2]

Say = Callable[[str], None]


class OwnLaneRefused(DgrError, ValueError):
    """The lane of the operator's model is certified nowhere that counts, or could not be
    certified now: one line, naming the command that fixes it when there is one."""


class OwnLaneFailed(OwnLaneRefused):
    """The lane of the operator's model was certified now and a correctness requirement failed:
    its record says which."""


def operator_home() -> Path:
    """``$DGR_OPERATOR_HOME``, else ``$XDG_CONFIG_HOME/dgr/operator`` (default
    ``~/.config/dgr/operator``)."""
    env = os.environ.get(OPERATOR_HOME_ENV)
    if env:
        return Path(env)
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "dgr" / "operator"


@attrs.frozen
class OwnModel:
    """A model as its operator declares it."""

    path: Path
    name: str
    """The default lock's name for it when it declares its hash, else from its GGUF."""
    arch: str
    sha256: str
    """Its content hash (the lane's)."""
    folder: Path
    """``<operator home>/models/<name>-<12 hex>``: its lock and evidence."""

    @property
    def lock_path(self) -> Path:
        return self.folder / "lock.json"

    @property
    def evidence(self) -> Path:
        return self.folder / "evidence"


@attrs.frozen
class OwnLane:
    """Where the records of a spawned route's lane are: the lock and evidence its workers load
    and its client checks against."""

    lock: Path
    evidence: Path


def applies(*, lock: Path | None, evidence: Path | None, model: Path) -> bool:
    """Whether the operator's own lock may stand in for a lane of ``model`` on this machine: a
    model that is no generated fixture, with no lock or evidence named on the command line or
    in the environment."""
    if lock is not None or evidence is not None:
        return False
    if os.environ.get(LOCK_ENV) or os.environ.get(EVIDENCE_DIR_ENV):
        return False
    try:
        return FIXTURE_MARK_KEY not in check_gguf(model).strings
    except EngineError:
        return False  # not a GGUF: the route's own checks say so


def own_model(path: Path, lane: LaneKey, base: Lock) -> OwnModel:
    """``path`` (whose lane is ``lane``) as its operator declares it."""
    header = check_gguf(path)
    declared = base.real_model_of(lane.model_sha256)
    if declared is not None:
        name = declared.name
    else:
        name = lock_edit.slug(header.strings.get("general.name") or path.stem)
    folder = operator_home() / "models" / f"{lock_edit.slug(name)}-{lane.model_sha256[:12]}"
    return OwnModel(path, name, header.arch, lane.model_sha256, folder)


def held_own_lane(model_sha256: str) -> OwnLane | None:
    """The operator's own lock and evidence for the model of content hash ``model_sha256``,
    if made (``dgr certify --model M`` or ``--certify``): what a ``dgr worker`` of that model
    with no lock or evidence named looks in when the defaults certify no lane of it."""
    for folder in sorted((operator_home() / "models").glob(f"*-{model_sha256[:12]}")):
        if (folder / "lock.json").is_file():
            return OwnLane(folder / "lock.json", folder / "evidence")
    return None


def _certified(lane: LaneKey, evidence: Path, lock: Lock, required: EvidenceClass) -> Path | None:
    found = find_certification(lane, evidence, lock=lock)
    cert = found.certification
    if cert is None or not cert.evidence_class.satisfies(required):
        return None
    return cert.path


def settle_own_lane(
    model: Path,
    options: EngineOptions,
    required: EvidenceClass,
    *,
    certify_now: bool,
    say: Say,
    rpc: PeerUse = PeerUse.OFF,
    ask: Callable[[str], bool] | None = None,
) -> OwnLane | None:
    """Where the records of ``model``'s lane with ``options`` are (``None``: the defaults
    certify it at ``required``, nothing changes), certifying it under the operator's lock first
    with ``certify_now`` or when ``ask`` (a question to the user: a terminal's clear yes)
    answers True (llama.cpp RPC beside it as ``rpc`` says); :class:`OwnLaneRefused`, naming
    the commands that fix it, when no record counts and none may be made."""
    from dgr_engine.certify.runner import lane_of

    try:
        base = load_lock()
    except EvidenceError as exc:
        raise OwnLaneRefused(f"no usable lock: {exc}") from None
    lane = lane_of(model, options)
    if _certified(lane, default_evidence_dir(), base, required) is not None:
        return None
    own = own_model(model, lane, base)
    if own.lock_path.is_file():
        try:
            held = load_lock(own.lock_path)
        except EvidenceError:
            held = None  # unreadable or outdated: certifying makes a new one
        if held is not None:
            record = _certified(lane, own.evidence, held, required)
            if record is not None:
                say(f"lane {lane.lane_id[:12]} certified under your operator lock: {record}")
                return OwnLane(own.lock_path, own.evidence)
    question = (
        f"no record of the lane of {model.name} on this machine counts: certify it now under "
        f"your own operator lock ({own.folder}; about a minute for a small model)? [y/N] "
    )
    if not certify_now and not (ask is not None and ask(question)):
        certify = " ".join(["dgr certify --model", str(model), *options.lane_argv()])
        raise OwnLaneRefused(
            f"no record of the lane of {model.name} on this machine (lane "
            f"{lane.lane_id[:12]}) counts at {required.value} evidence: certify it once under "
            f"your own operator lock with '{certify}' (about a minute for a small model), or "
            "add --certify to this command"
        )
    certify_own_model(own, base, options, say, rpc=rpc)
    return OwnLane(own.lock_path, own.evidence)


def terminal_yes(question: str) -> bool:
    """Asks ``question`` on the terminal (standard error), when standard input and error both
    are one: True only for a clear yes (``y`` or ``yes``); False without a terminal, for
    anything else, and at the end of input."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return False
    print(question, end="", file=sys.stderr, flush=True)
    try:
        answer = sys.stdin.readline()
    except (OSError, KeyboardInterrupt):
        return False
    return answer.strip().lower() in ("y", "yes")


def certify_own_model(
    own: OwnModel, base: Lock, options: EngineOptions, say: Say, *, rpc: PeerUse = PeerUse.OFF
) -> None:
    """Makes (or keeps) the operator's lock for ``own`` from ``base`` (the default lock) and
    certifies its lane under it (:func:`settle_own_lane` found no record that counts);
    :class:`OwnLaneRefused` when it cannot or the lane fails."""
    home = operator_home()
    if home.resolve().is_relative_to(_CHECKOUT) and (_CHECKOUT / "dgr_engine").is_dir():
        raise OwnLaneRefused(
            f"the operator home {home} is inside the checkout {_CHECKOUT}: set "
            f"${OPERATOR_HOME_ENV} to a folder outside it"
        )
    try:
        operator = operator_lock(
            base,
            own.folder,
            name=own.name,
            arch=own.arch,
            sha256=own.sha256,
            evidence=own.evidence,
            key_path=home / "certifier.pem",
            statement=STATEMENT,
        )
    except (EvidenceError, ValueError, OSError) as exc:
        raise OwnLaneRefused(f"cannot make the operator lock in {own.folder}: {exc}") from None
    state = "new" if operator.new else "kept"
    say(
        f"certify   {own.name} ({own.arch}, sha256 {own.sha256[:16]}) on this machine under "
        f"your operator lock {own.lock_path} ({state}; key {operator.key_path})"
    )
    try:
        code = asyncio.run(
            certify_or_reuse(
                own.path,
                options,
                operator.lock,
                own.evidence,
                False,  # settle_own_lane looked for a record already
                key=operator.key,
                rpc=rpc,
                say=say,
            )
        )
    except KeyboardInterrupt:
        raise OwnLaneRefused("certification interrupted: every worker stopped") from None
    except (EvidenceError, DgrError, ValueError, OSError) as exc:
        raise OwnLaneRefused(f"cannot certify the lane: {exc}") from None
    if code != 0:
        raise OwnLaneFailed(
            f"the lane of {own.path.name} did not pass certification: not routing over it "
            f"(records in {own.evidence})"
        )
