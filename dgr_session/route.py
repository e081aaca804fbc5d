"""Stages and routes, and route validation.

A route is an ordered tuple of stages; each stage owns a contiguous layer range on one endpoint.
:func:`validate_route` checks a route before any traffic: an exact contiguous cover of
``[0, n_layer)``, the same model identity and recipe on every stage, matching boundary widths
between neighbours, and lanes certified at the evidence class the caller requires (dark lanes
are never routable). A stage's certification is the worker's word unless the caller gives a
:data:`CertificationVerifier`, which checks it against the caller's own trust (the client's
lock: ``dgr_engine.certification.verify.LockVerifier``); a stage it does not vouch for is dark.
Every violation is a typed error naming the stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from dgr_session.errors import (
    BoundaryMismatch,
    DarkLane,
    InsufficientEvidence,
    RouteIncompatible,
    RouteInvalid,
    UnverifiedCertification,
)
from dgr_session.identity import EvidenceClass, Lane, ModelIdentity, Recipe


def _non_negative(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _after_begin(inst: StageSpec, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= inst.layer_begin:
        raise ValueError(f"layer_end ({value}) must be > layer_begin ({inst.layer_begin})")


@attrs.frozen
class StageSpec:
    """One stage of a route: an endpoint serving ``[layer_begin, layer_end)`` of a model."""

    endpoint: str
    """Where the stage's worker is reached (opaque to dgr_session; the transport resolves it)."""
    layer_begin: int = attrs.field(validator=_non_negative)
    """First layer owned (inclusive)."""
    layer_end: int = attrs.field(validator=_after_begin)
    """Layer after the last one owned (exclusive)."""
    identity: ModelIdentity
    """Model the stage serves."""
    recipe: Recipe
    """Recipe the stage runs."""
    lane: Lane
    """Lane the stage runs on."""
    boundary_in: int = attrs.field(default=0, validator=_non_negative)
    """Boundary width taken per token (f32 values); 0 when the stage takes token IDs (layer 0)."""
    boundary_out: int = attrs.field(default=0, validator=_non_negative)
    """Boundary width produced per token; 0 when the stage produces logits (last layer)."""
    max_rows: int = attrs.field(default=0, validator=_non_negative)
    """Most rows (tokens) one forward may carry (the shard's batch); 0 when not known."""
    grant: bytes = attrs.field(default=b"", repr=False, eq=False)
    """The tracker's route grant for this stage, for the session and epoch the route was
    assigned to (opaque here: the transport hands it to the stage at open); empty: none."""

    @property
    def n_layers(self) -> int:
        """Number of layers the stage owns."""
        return self.layer_end - self.layer_begin


CertificationVerifier = Callable[[StageSpec], str | None]
"""Checks a certified stage's certification (``stage.lane``: record id, class, the signed
record) against the caller's own trust: ``None`` when it verifies, else why not (one line).
Given by whoever holds the trust (``dgr_engine`` holds the lock); dgr_session never sees it."""


def _stage_tuple(stages: Iterable[StageSpec]) -> tuple[StageSpec, ...]:
    return tuple(stages)


@attrs.frozen
class Route:
    """An ordered list of stages meant to cover ``[0, n_layer)`` exactly once.

    Construction checks nothing beyond non-emptiness; call :func:`validate_route` (sessions do so
    for every route they are assigned).
    """

    stages: tuple[StageSpec, ...] = attrs.field(converter=_stage_tuple)
    """Stages in forward order: stage 0 takes tokens, the last produces logits."""

    @stages.validator
    def _non_empty(self, _attribute: attrs.Attribute[object], value: tuple[StageSpec, ...]) -> None:
        if not value:
            raise RouteInvalid("a route needs at least one stage")

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def identity(self) -> ModelIdentity:
        """Model identity of the first stage (equal on all stages of a valid route)."""
        return self.stages[0].identity

    @property
    def recipe(self) -> Recipe:
        """Recipe of the first stage (equal on all stages of a valid route)."""
        return self.stages[0].recipe

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Endpoints in stage order."""
        return tuple(stage.endpoint for stage in self.stages)


def validate_route(
    route: Route,
    *,
    identity: ModelIdentity | None = None,
    recipe: Recipe | None = None,
    min_context: int = 0,
    min_rows: int = 0,
    required_evidence: EvidenceClass = EvidenceClass.REAL_HARDWARE,
    verify_certification: CertificationVerifier | None = None,
) -> Route:
    """Check ``route`` and return it unchanged, or raise the first violation found.

    ``identity`` and ``recipe``, when given, are what the caller needs (a session pins them from
    its first route); otherwise the first stage's are required of the rest. ``min_context`` is the
    number of KV positions the caller will use, ``min_rows`` the most rows it will send in one
    forward (its prefill chunk). Checks run stage by stage, in order:

    * :class:`RouteIncompatible`: identity, recipe, context or rows per forward differ from what
      is needed, or a
      stage runs another build than the first stage (llama.cpp commit or patch-stack hash: the
      boundary format and the numerics), or one whose patch stack is unknown (empty hash);
    * :class:`RouteInvalid`: a gap, an overlap, or a cover that does not end at ``n_layer``;
    * :class:`BoundaryMismatch`: neighbours' widths differ, or the first stage does not take
      tokens (width 0 in) or the last does not produce logits (width 0 out);
    * :class:`DarkLane`: an uncertified lane; :class:`InsufficientEvidence` (a ``DarkLane``): a
      lane certified by evidence below ``required_evidence`` (default ``real-hardware``: a
      fixture or real-model certification does not make a lane routable for production);
      :class:`UnverifiedCertification` (a ``DarkLane``): with ``verify_certification``, a stage
      whose certification it does not vouch for (the caller's lock, not the worker's word).
    """
    want_identity = identity if identity is not None else route.stages[0].identity
    want_recipe = recipe if recipe is not None else route.stages[0].recipe
    n_layer = want_identity.n_layer
    last = len(route.stages) - 1
    expected_begin = 0
    want_commit = route.stages[0].lane.llama_cpp_commit
    want_patches = route.stages[0].lane.patch_stack_hash
    want_family = route.stages[0].lane.family_patch_hash
    for index, stage in enumerate(route.stages):
        # ``is``: the common case (one object for the whole route) skips attrs' field compare
        if stage.identity is not want_identity and stage.identity != want_identity:
            raise _at(
                RouteIncompatible,
                index,
                stage,
                f"serves {stage.identity!r}, need {want_identity!r}",
            )
        if stage.recipe is not want_recipe and stage.recipe != want_recipe:
            raise _at(
                RouteIncompatible, index, stage, f"runs {stage.recipe!r}, need {want_recipe!r}"
            )
        lane = stage.lane
        if not lane.patch_stack_hash:
            raise _at(RouteIncompatible, index, stage, "unknown patch stack (empty hash)")
        if lane.llama_cpp_commit != want_commit or lane.patch_stack_hash != want_patches:
            message = (
                f"runs llama.cpp {lane.llama_cpp_commit[:12]} + patches "
                f"{lane.patch_stack_hash.hex()[:12]}, stage 0 runs "
                f"{want_commit[:12]} + {want_patches.hex()[:12]}"
            )
            raise _at(RouteIncompatible, index, stage, message)
        if lane.family_patch_hash != want_family:
            message = (
                f"runs the {stage.identity.arch} family patch "
                f"{lane.family_patch_hash.hex()[:12] or 'none'}, stage 0 runs "
                f"{want_family.hex()[:12] or 'none'}"
            )
            raise _at(RouteIncompatible, index, stage, message)
        if 0 < stage.max_rows < min_rows:
            message = f"takes at most {stage.max_rows} rows per forward, {min_rows} needed"
            raise _at(RouteIncompatible, index, stage, message)
        if stage.recipe.context < min_context:
            message = (
                f"context {stage.recipe.context} < {min_context} positions needed (the prompt"
                " and the new tokens): start the workers with a bigger --ctx (a lane of its own,"
                " to certify at that context) or use a shorter prompt or fewer new tokens"
            )
            raise _at(RouteIncompatible, index, stage, message)
        if stage.layer_begin != expected_begin:
            kind = "gap" if stage.layer_begin > expected_begin else "overlap"
            message = f"{kind}: starts at layer {stage.layer_begin}, expected {expected_begin}"
            raise _at(RouteInvalid, index, stage, message)
        if stage.layer_end > n_layer:
            message = f"ends at layer {stage.layer_end} > n_layer {n_layer}"
            raise _at(RouteInvalid, index, stage, message)
        if index == last and stage.layer_end != n_layer:
            message = f"last stage ends at layer {stage.layer_end}, not n_layer {n_layer}"
            raise _at(RouteInvalid, index, stage, message)
        if index == 0 and stage.boundary_in != 0:
            message = f"first stage must take token IDs (width 0), has width {stage.boundary_in}"
            raise _at(BoundaryMismatch, index, stage, message)
        if index == last and stage.boundary_out != 0:
            message = f"last stage must produce logits (width 0), has width {stage.boundary_out}"
            raise _at(BoundaryMismatch, index, stage, message)
        if index > 0:
            produced = route.stages[index - 1].boundary_out
            if produced == 0 or produced != stage.boundary_in:
                message = f"takes width {stage.boundary_in}, stage {index - 1} produces {produced}"
                raise _at(BoundaryMismatch, index, stage, message)
        _check_certified(stage, index, required_evidence, verify_certification)
        expected_begin = stage.layer_end
    return route


def _at(cls: type[RouteInvalid], index: int, stage: StageSpec, message: str) -> RouteInvalid:
    return cls(
        message,
        stage_index=index,
        endpoint=stage.endpoint,
        layers=(stage.layer_begin, stage.layer_end),
    )


def _check_certified(
    stage: StageSpec,
    index: int,
    required: EvidenceClass,
    verify: CertificationVerifier | None,
) -> None:
    lane = stage.lane
    if not lane.certified or lane.evidence is None:
        message = f"{_where(lane)} is dark: no certification record matches it"
        raise _dark(DarkLane, index, stage, required, message)
    if verify is not None:
        why = verify(stage)
        if why is not None:
            message = (
                f"{_where(lane)} advertises {lane.evidence.value} certification (record "
                f"{lane.record_id[:12] or '?'}) that does not verify under the client's trust: "
                f"{why}"
            )
            raise _dark(UnverifiedCertification, index, stage, required, message)
    if not lane.evidence.satisfies(required):
        message = (
            f"{_where(lane)} is certified with {lane.evidence.value} evidence (record "
            f"{lane.record_id[:12] or '?'}); this route requires {required.value}"
        )
        raise _dark(InsufficientEvidence, index, stage, required, message)


def _dark(
    cls: type[DarkLane], index: int, stage: StageSpec, required: EvidenceClass, message: str
) -> DarkLane:
    """A certification refusal: ``message``, then what the advert says of the nearest record
    at ``required`` (the parts that differ) and of the command that would certify the lane
    (not for a lane certified below ``required``: the command would make the same class)."""
    lane = stage.lane
    nearest = lane.nearest_at(required)
    if nearest is not None:
        message += f"; {nearest.describe()}"
    elif lane.nearest or lane.certify_command:  # the worker looked, and found none
        message += f"; the worker has no {required.value} record of any lane"
    if lane.certify_command and cls is not InsufficientEvidence:  # (it would certify it again)
        message += (
            f"; to certify this lane, run on the worker's machine: {lane.certify_command}"
            " (then restart the worker)"
        )
    return cls(
        message,
        stage_index=index,
        endpoint=stage.endpoint,
        layers=(stage.layer_begin, stage.layer_end),
        nearest=nearest,
        certify_command=lane.certify_command,
    )


def _where(lane: Lane) -> str:
    hardware = lane.hardware if len(lane.hardware) <= 32 else f"{lane.hardware[:31]}…"
    return f"lane {lane.lane_id[:12] or '?'} ({lane.backend}/{hardware})"
