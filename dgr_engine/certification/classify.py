"""The evidence class of a result, derived from facts, never passed as a flag.

* ``fixture``: the GGUF carries the fixture writers' mark (``dgr.fixture`` metadata);
* ``real-model``: not a fixture, and the GGUF's content hash is one the lock declares for a
  real model;
* ``real-hardware``: a real model on a hardware class and build (llama.cpp commit, patch stack,
  backend) that the lock declares as a hardware lane;
* ``release``: that, from a release build (a final dgr version, its release tag at the commit
  built, a tree that is exactly that commit: :mod:`~dgr_engine.certification.release`).

Anything else derives no class (:class:`~dgr_engine.certification.errors.UnclassifiableModel`):
an unmarked GGUF the lock does not name is neither a fixture nor a known real model.
"""

from __future__ import annotations

import attrs
from packaging.version import InvalidVersion, Version

from dgr_engine.certification.errors import UnclassifiableModel
from dgr_engine.certification.lane import LaneKey
from dgr_engine.certification.lock import Lock
from dgr_session.identity import EvidenceClass

FIXTURE_MARK_KEY = "dgr.fixture"
"""GGUF metadata key the fixture writers set (value: generator and fixture name)."""


@attrs.frozen
class EvidenceFacts:
    """What the class is derived from."""

    fixture_mark: str | None
    """The GGUF's ``dgr.fixture`` value, ``None`` when absent."""
    real_model: str | None
    """The lock's real model whose declared hashes include the GGUF's, if any."""
    hardware_lane: str | None
    """The lock's hardware lane naming exactly this hardware and build, if any."""
    release_build: bool
    """A release build (:func:`~dgr_engine.certification.release.release_state`): a final
    version, its tag at the commit built, nothing in the tree but that commit."""

    @property
    def evidence_class(self) -> EvidenceClass:
        """The class these facts support; :class:`UnclassifiableModel` when none."""
        if self.fixture_mark is not None:
            return EvidenceClass.FIXTURE
        if self.real_model is None:
            raise UnclassifiableModel(
                "the GGUF is not a generated fixture (no dgr.fixture mark) and the lock names "
                "no real model with its content hash: no evidence class can be derived"
            )
        if self.hardware_lane is None:
            return EvidenceClass.REAL_MODEL
        return EvidenceClass.RELEASE if self.release_build else EvidenceClass.REAL_HARDWARE


def is_release_version(version: str) -> bool:
    """A final release version: no pre-release, dev or local part (``0.1.0``, not
    ``0.1.0+source`` or ``0.2.0.dev1``)."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return not (parsed.is_prerelease or parsed.is_devrelease or parsed.local)


def derive_facts(
    lane: LaneKey, *, fixture_mark: str | None, lock: Lock, release_build: bool
) -> EvidenceFacts:
    """The facts of a result on ``lane`` under ``lock``; ``release_build``: what
    :func:`~dgr_engine.certification.release.release_state` says of the build (a clean tree
    alone is not a release)."""
    model = lock.real_model_of(lane.model_sha256)
    hardware = lock.hardware_lane_of(
        lane.hardware, lane.llama_cpp_commit, lane.patch_stack_sha256, lane.backend
    )
    return EvidenceFacts(
        fixture_mark=fixture_mark,
        real_model=None if model is None else model.name,
        hardware_lane=None if hardware is None else hardware.name,
        release_build=release_build and is_release_version(lane.dgr_version),
    )
