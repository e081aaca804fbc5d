"""What a stage serves and runs on: model identity, recipe and lane (value objects).

Two stages may sit in one route only if their model identity and recipe are equal; a lane may
carry traffic only if it is certified. These are plain frozen values: validation of a route lives
in :mod:`dgr_session.route`, serialization lives with whoever serializes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs


def short_hex(value: bytes) -> str:
    """Render bytes as a short hex string for reprs (first 6 bytes, then an ellipsis)."""
    text = value.hex()
    return f"<{text[:12]}…>" if len(text) > 12 else f"<{text}>"


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


class EvidenceClass(enum.StrEnum):
    """What kind of evidence backs a certification. Classes never stand in for each other."""

    FIXTURE = "fixture"
    REAL_MODEL = "real-model"
    REAL_HARDWARE = "real-hardware"
    RELEASE = "release"

    @property
    def rank(self) -> int:
        """Position in ``fixture < real-model < real-hardware < release``: each class holds the
        facts of the ones below it (a real-hardware record is a real-model record made on the
        exact hardware and build its lane names), never the other way round."""
        return _EVIDENCE_RANK[self]

    def satisfies(self, required: EvidenceClass) -> bool:
        """True when evidence of this class meets a requirement of class ``required``."""
        return _EVIDENCE_RANK[self] >= _EVIDENCE_RANK[required]


_EVIDENCE_RANK = {evidence: rank for rank, evidence in enumerate(EvidenceClass)}


class CertificationStatus(enum.StrEnum):
    """Whether a lane may carry traffic. Compiling a lane does not certify it."""

    #: Built (maybe tested) but not certified: unroutable.
    DARK = "dark"
    #: Holds a certification record; see the lane's evidence class for what backs it.
    CERTIFIED = "certified"


@attrs.frozen
class ModelIdentity:
    """Exactly which model a stage serves. Equal identities are required along a route."""

    content_hash: bytes = attrs.field(repr=short_hex)
    """GGUF content hash (or the split manifest's hash for split GGUFs)."""
    arch: str
    """GGUF architecture name, e.g. ``"llama"`` or ``"deepseek4"``."""
    n_layer: int = attrs.field(validator=_positive)
    """Number of main layers; a route covers ``[0, n_layer)``."""
    official_target_sha: str | None = None
    """Upstream model revision (git SHA) the GGUF was converted from, where known."""


@attrs.frozen
class Recipe:
    """How the model is quantized and run. Equal recipes are required along a route."""

    quant_types: tuple[str, ...] = attrs.field(converter=_str_tuple)
    """Quantization types present in the GGUF, e.g. ``("Q4_K", "Q6_K")``."""
    context: int = attrs.field(validator=_positive)
    """Context length (KV positions) every stage provides per session."""
    kv_type: str = "f16"
    """KV cache element type."""
    flash_attn: str = "auto"
    """Flash-attention mode (``auto``, ``off``, ``on``)."""


@attrs.frozen
class LaneDifference:
    """One part in which a lane differs from a certification record's lane."""

    part: str
    """The part's name (a lane field: ``context_per_session``, ``hardware``, ...)."""
    value: str
    """The lane's value, as text."""
    recorded: str
    """The record's value, as text."""

    def __str__(self) -> str:
        return f"{self.part} {_brief(self.value)} (nearest record: {_brief(self.recorded)})"


def _brief(text: str, most: int = 40) -> str:
    return text if len(text) <= most else f"{text[: most - 1]}…"


def _difference_tuple(values: Iterable[LaneDifference]) -> tuple[LaneDifference, ...]:
    return tuple(values)


@attrs.frozen
class NearestRecord:
    """The certification record of another lane nearest to a lane that no record of one class
    certifies: what a worker found among its records, for a client to say what differs."""

    record_id: str
    """The record's id."""
    evidence: EvidenceClass
    """Its evidence class."""
    differences: tuple[LaneDifference, ...] = attrs.field(converter=_difference_tuple)
    """The parts in which the lane differs from the record's, in the lane's field order."""

    def describe(self) -> str:
        """One line: the record and every difference."""
        parts = ", ".join(map(str, self.differences)) or "nothing (another lane id)"
        return f"the nearest {self.evidence.value} record {self.record_id[:12]} differs in {parts}"


def _nearest_tuple(values: Iterable[NearestRecord]) -> tuple[NearestRecord, ...]:
    return tuple(values)


def _check_evidence(
    inst: Lane, _attribute: attrs.Attribute[EvidenceClass | None], value: EvidenceClass | None
) -> None:
    if inst.certification is CertificationStatus.CERTIFIED and value is None:
        raise ValueError("a certified lane needs an evidence class")


@attrs.frozen
class Lane:
    """Backend x build x hardware a stage runs on, with its certification."""

    backend: str
    """Compute backend: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"vulkan"``, ``"metal"``."""
    llama_cpp_commit: str
    """Exact llama.cpp commit the worker was built from."""
    patch_stack_hash: bytes = attrs.field(repr=short_hex)
    """Hash of the applied base patch stack (``patches/`` without the family patches)."""
    dgr_version: str
    """dgr version of the worker."""
    hardware: str
    """Hardware class (fingerprint) the stage runs on, e.g. a CPU model and its instruction-set
    flags, or a GPU name, driver and compute capability."""
    certification: CertificationStatus = CertificationStatus.DARK
    """Certification status; only certified lanes are routable."""
    evidence: EvidenceClass | None = attrs.field(default=None, validator=_check_evidence)
    """Class of the evidence behind the certification (required when certified)."""
    lane_id: str = ""
    """Content hash of the lane's canonical form (backend, build, hardware, model, recipe),
    computed by whoever built the lane; ``""`` when not known."""
    record_id: str = ""
    """Id of the certification record behind a certified lane; ``""`` when dark."""
    record: str = attrs.field(default="", eq=False, repr=False)
    """The certifying record as the worker sent it (its signed JSON), opaque here: a client
    checks it against its own lock with a ``CertificationVerifier`` given to route validation
    (``dgr_session.route``) rather than taking the worker's word; ``""`` when dark or not
    sent."""
    nearest: tuple[NearestRecord, ...] = attrs.field(
        default=(), converter=_nearest_tuple, eq=False, repr=False
    )
    """For each evidence class above the lane's own (every class when dark), the nearest
    record of that class under the worker's lock, if any: what a refusal names as differing
    (``dgr_session.route``). Advice, not trust: it certifies nothing."""
    certify_command: str = attrs.field(default="", eq=False, repr=False)
    """The command that would certify the lane, run on the worker's machine (``dgr certify``
    with the worker's model and lane options); ``""`` when not known."""
    family_patch_hash: bytes = attrs.field(default=b"", repr=short_hex)
    """Hash of the family patches of the stage's architecture (``patches/`` whose header names
    it); ``b""`` when the architecture runs on the base stack alone."""

    @property
    def certified(self) -> bool:
        """True when the lane holds a certification."""
        return self.certification is CertificationStatus.CERTIFIED

    def nearest_at(self, required: EvidenceClass) -> NearestRecord | None:
        """The nearest record whose class meets ``required`` (fewest differences, then the
        lowest such class), or ``None``."""
        meeting = [n for n in self.nearest if n.evidence.satisfies(required)]
        return min(meeting, key=lambda n: (len(n.differences), n.evidence.rank), default=None)
