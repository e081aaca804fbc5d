"""The capability advert a shard worker returns from ``Describe``: what the tracker routes on.

Exact compatibility is the session layer's own value objects (:class:`ModelIdentity`,
:class:`Recipe`, :class:`Lane` from ``dgr_session.identity``), so a route built from adverts
validates with ``dgr_session.route.validate_route`` unchanged (:meth:`Advert.stage_spec`). The
rest says where the stage sits (range), how much it can take (capacity, load), what its seam
costs, and how healthy it is. Serialization lives in :func:`advert_to_proto` /
:func:`advert_from_proto`, outside the classes.

Certification: a worker is ``certified`` only when an evidence record of its exact lane is
loaded (``dgr_engine.certification.registry``); the advert then names the record's evidence
class and id, and carries the signed record itself, so a client checks the certification
against its own lock (``dgr_engine.certification.verify``) instead of taking the worker's word.
Otherwise it is ``dark``, and dark lanes are unroutable. Either way it may add advice for a
client that refuses the lane: the nearest records of the classes above its own, with the lane
parts that differ, and the command that would certify it. Advice is text a client prints, so
what is read off the wire is bounded in count and length, with unprintable characters
replaced; it never makes a lane routable.
"""

from __future__ import annotations

import attrs

from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session.identity import (
    CertificationStatus,
    EvidenceClass,
    Lane,
    LaneDifference,
    ModelIdentity,
    NearestRecord,
    Recipe,
)
from dgr_session.route import StageSpec


@attrs.frozen
class LayerSpan:
    """Where the stage sits in the model."""

    layer_begin: int
    """First owned layer."""
    layer_end: int
    """One past the last owned layer."""
    is_first: bool
    """Takes token ids."""
    is_last: bool
    """Produces logits."""
    needs_token_ids: bool
    """Frames must carry the token-id sideband (first stage, hash-routed layers)."""
    mtp: bool = False
    """The last stage loaded the model's MTP block: it answers ``mtp_draft_max``."""


@attrs.frozen
class Capacity:
    """Sessions and KV the stage can still take."""

    sessions_max: int
    """Concurrent sessions (engine slots)."""
    sessions_open: int
    """Sessions open now."""
    kv_tokens_free: int
    """Free KV positions over every slot, open or not."""
    context_per_session: int
    """KV positions per session."""
    max_rows_per_forward: int
    """Most rows one forward may carry (n_batch)."""
    session_lease_seconds: float = 0.0
    """A session nobody opens or forwards for this long is closed by the stage (its next
    frame is refused as unknown: re-prefill); 0: never."""
    sessions_waiting: int = 0
    """Opens waiting in line for a free slot now (admission is first come, first served)."""
    admission_wait_seconds: float = 0.0
    """How long an open may wait in line before the stage answers busy (0: at once)."""

    @property
    def sessions_free(self) -> int:
        """Slots a new session could take now without waiting."""
        return max(self.sessions_max - self.sessions_open - self.sessions_waiting, 0)


@attrs.frozen
class Load:
    """How busy the stage is now."""

    in_flight: int
    """Forwards running or queued."""
    queued: int
    """Forwards waiting for the engine."""
    rows_per_second: float
    """Rows forwarded per second over the recent window."""
    window_seconds: float
    """Length of that window."""


@attrs.frozen
class SeamCost:
    """What crosses the seam per token, payload only (no gRPC framing)."""

    dtype: str
    """Element type of boundary and logits rows (``"f32"``)."""
    width_in: int
    """Floats per input row; 0 on the first stage (token ids)."""
    width_out: int
    """Floats per output row; ``n_vocab`` on the last stage."""
    bytes_per_token_in: int
    """Boundary row + position + token id (where sent)."""
    bytes_per_token_out: int
    """One output row."""


@attrs.frozen
class Health:
    """Reliability as the worker sees itself."""

    uptime_seconds: float
    """Since the worker started serving."""
    recent_errors: int
    """The worker's own faults in the recent window (its engine failed, a frame's deadline
    passed in its queue, non-finite output, an internal error); callers' refusals never
    count (``dgr_engine.status.is_worker_fault``)."""
    total_errors: int
    """The worker's own faults since start."""
    window_seconds: float
    """Length of the recent window."""


@attrs.frozen
class Security:
    """How the worker's channel is protected."""

    tls: bool = False
    """The channel is TLS (else plaintext: loopback, or explicitly allowed beyond)."""
    client_certificates: bool = False
    """Mutual TLS: a client needs a certificate signed by the worker's client CA."""
    chain_tls: bool = False
    """The worker dials the next stage of a chained route over TLS (``--chain-tls-*``)."""


@attrs.frozen
class DataPaths:
    """The paths a worker's frames can travel besides gRPC (``docs/data-paths.md``)."""

    frame_link_port: int = 0
    """The frame link's port on the worker's host (``worker/frame_link_server.py``); 0: not
    offered."""
    native_link_port: int = 0
    """The native link's port on the worker's host (``worker/native_link_server.py``,
    ``docs/native-path.md``); 0: not offered."""
    native_link_sealed: bool = False
    """Its links are sealed (a worker with TLS: ``wire/link_seal.py``); a clear introduction
    is refused."""


@attrs.frozen
class Advert:
    """Everything one shard worker tells the tracker about itself."""

    identity: ModelIdentity
    """Which model (GGUF content hash, arch, n_layer)."""
    recipe: Recipe
    """Quant types, context, KV type."""
    lane: Lane
    """Backend, llama.cpp commit, patch stack, dgr version, hardware, certification."""
    schema_version: int
    """Wire schema the worker speaks."""
    span: LayerSpan
    capacity: Capacity
    load: Load
    seam: SeamCost
    health: Health
    artifacts: str = ""
    """How a split model's files were checked before loading (``verified at start-up``,
    ``trusted state of <time>``); empty for a single GGUF (hashed whole at start-up)."""
    security: Security = Security()
    data_paths: DataPaths = DataPaths()

    def stage_spec(self, endpoint: str) -> StageSpec:
        """This stage as a route element at ``endpoint``."""
        return StageSpec(
            endpoint=endpoint,
            layer_begin=self.span.layer_begin,
            layer_end=self.span.layer_end,
            identity=self.identity,
            recipe=self.recipe,
            lane=self.lane,
            boundary_in=self.seam.width_in,
            boundary_out=0 if self.span.is_last else self.seam.width_out,
            max_rows=self.capacity.max_rows_per_forward,
        )


# --- conversion --------------------------------------------------------------------------------

_STATUS_TO_PB = {
    CertificationStatus.DARK: pb.LANE_STATUS_DARK,
    CertificationStatus.CERTIFIED: pb.LANE_STATUS_CERTIFIED,
}
_EVIDENCE_TO_PB = {
    None: pb.EVIDENCE_CLASS_UNSPECIFIED,
    EvidenceClass.FIXTURE: pb.EVIDENCE_CLASS_FIXTURE,
    EvidenceClass.REAL_MODEL: pb.EVIDENCE_CLASS_REAL_MODEL,
    EvidenceClass.REAL_HARDWARE: pb.EVIDENCE_CLASS_REAL_HARDWARE,
    EvidenceClass.RELEASE: pb.EVIDENCE_CLASS_RELEASE,
}
_EVIDENCE_FROM_PB = {v: k for k, v in _EVIDENCE_TO_PB.items()}
_DTYPE_TO_PB = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()}


def advert_to_proto(advert: Advert) -> pb.Advert:
    """The advert as the ``dgr.shard.v1.Advert`` message."""
    ident, recipe, lane = advert.identity, advert.recipe, advert.lane
    return pb.Advert(
        compatibility=pb.Compatibility(
            model_sha256=ident.content_hash,
            arch=ident.arch,
            n_layer=ident.n_layer,
            official_target_sha=ident.official_target_sha or "",
            quant_types=recipe.quant_types,
            context=recipe.context,
            kv_type=recipe.kv_type,
            flash_attn=recipe.flash_attn,
            backend=lane.backend,
            llama_cpp_commit=lane.llama_cpp_commit,
            patch_stack_sha256=lane.patch_stack_hash,
            family_patch_sha256=lane.family_patch_hash,
            dgr_version=lane.dgr_version,
            hardware=lane.hardware,
            schema_version=advert.schema_version,
            artifacts=advert.artifacts,
        ),
        range=pb.LayerRange(**attrs.asdict(advert.span)),
        capacity=pb.Capacity(**attrs.asdict(advert.capacity)),
        load=pb.Load(**attrs.asdict(advert.load)),
        seam=pb.SeamCost(
            dtype=_DTYPE_TO_PB[advert.seam.dtype],
            width_in=advert.seam.width_in,
            width_out=advert.seam.width_out,
            bytes_per_token_in=advert.seam.bytes_per_token_in,
            bytes_per_token_out=advert.seam.bytes_per_token_out,
        ),
        health=pb.Health(**attrs.asdict(advert.health)),
        certification=pb.Certification(
            status=_STATUS_TO_PB[lane.certification],
            evidence=_EVIDENCE_TO_PB[lane.evidence],
            lane_id=lane.lane_id,
            record_id=lane.record_id,
            record=lane.record,
            nearest=[
                pb.NearestRecord(
                    record_id=near.record_id,
                    evidence=_EVIDENCE_TO_PB[near.evidence],
                    differences=[pb.LaneDifference(**attrs.asdict(d)) for d in near.differences],
                )
                for near in lane.nearest
            ],
            certify_command=lane.certify_command,
        ),
        security=pb.Security(**attrs.asdict(advert.security)),
        data_paths=pb.DataPaths(**attrs.asdict(advert.data_paths)),
    )


_MOST_NEAREST, _MOST_DIFFERENCES, _MOST_TEXT, _MOST_COMMAND = 8, 32, 512, 2048
"""Bounds on the advice read off the wire (a lane has 16 parts and 4 classes)."""


def _advice(text: str, most: int = _MOST_TEXT) -> str:
    """Worker-given text fit for one line of a client's error: unprintable characters (line
    breaks, terminal escapes) replaced, cut at ``most`` characters."""
    clean = "".join(c if c.isprintable() else "?" for c in text[: most + 1])
    return clean if len(clean) <= most else f"{clean[: most - 1]}…"


def _nearest_from_proto(certification: pb.Certification) -> tuple[NearestRecord, ...]:
    """The advice's nearest records; an entry without a known class is dropped (advice only)."""
    found = []
    for near in certification.nearest[:_MOST_NEAREST]:
        evidence = _EVIDENCE_FROM_PB.get(near.evidence)
        if evidence is None:
            continue
        differences = [
            LaneDifference(_advice(d.part, 64), _advice(d.value), _advice(d.recorded))
            for d in near.differences[:_MOST_DIFFERENCES]
        ]
        found.append(NearestRecord(_advice(near.record_id, 64), evidence, differences))
    return tuple(found)


def advert_from_proto(msg: pb.Advert) -> Advert:
    """The advert of a ``dgr.shard.v1.Advert`` message. A lane status other than CERTIFIED
    reads as dark (fail closed); ``ValueError`` if the message is not a valid advert."""
    c = msg.compatibility
    certified = msg.certification.status == pb.LANE_STATUS_CERTIFIED
    if msg.seam.dtype not in _DTYPE_FROM_PB or msg.certification.evidence not in _EVIDENCE_FROM_PB:
        raise ValueError(f"advert with an unknown dtype or evidence class: {msg.seam}")
    return Advert(
        identity=ModelIdentity(
            content_hash=c.model_sha256,
            arch=c.arch,
            n_layer=c.n_layer,
            official_target_sha=c.official_target_sha or None,
        ),
        recipe=Recipe(
            quant_types=tuple(c.quant_types),
            context=c.context,
            kv_type=c.kv_type,
            flash_attn=c.flash_attn or "auto",  # a worker older than the field ran llama.cpp's
        ),
        lane=Lane(
            backend=c.backend,
            llama_cpp_commit=c.llama_cpp_commit,
            patch_stack_hash=c.patch_stack_sha256,
            family_patch_hash=c.family_patch_sha256,
            dgr_version=c.dgr_version,
            hardware=c.hardware,
            certification=CertificationStatus.CERTIFIED if certified else CertificationStatus.DARK,
            evidence=_EVIDENCE_FROM_PB[msg.certification.evidence] if certified else None,
            lane_id=msg.certification.lane_id,
            record_id=msg.certification.record_id if certified else "",
            record=msg.certification.record if certified else "",
            nearest=_nearest_from_proto(msg.certification),
            certify_command=_advice(msg.certification.certify_command, _MOST_COMMAND),
        ),
        schema_version=c.schema_version,
        artifacts=c.artifacts,
        security=Security(
            tls=msg.security.tls,
            client_certificates=msg.security.client_certificates,
            chain_tls=msg.security.chain_tls,
        ),
        data_paths=DataPaths(
            frame_link_port=msg.data_paths.frame_link_port,
            native_link_port=msg.data_paths.native_link_port,
            native_link_sealed=msg.data_paths.native_link_sealed,
        ),
        span=LayerSpan(
            layer_begin=msg.range.layer_begin,
            layer_end=msg.range.layer_end,
            is_first=msg.range.is_first,
            is_last=msg.range.is_last,
            needs_token_ids=msg.range.needs_token_ids,
            mtp=msg.range.mtp,
        ),
        capacity=Capacity(
            sessions_max=msg.capacity.sessions_max,
            sessions_open=msg.capacity.sessions_open,
            kv_tokens_free=msg.capacity.kv_tokens_free,
            context_per_session=msg.capacity.context_per_session,
            max_rows_per_forward=msg.capacity.max_rows_per_forward,
            session_lease_seconds=msg.capacity.session_lease_seconds,
            sessions_waiting=msg.capacity.sessions_waiting,
            admission_wait_seconds=msg.capacity.admission_wait_seconds,
        ),
        load=Load(
            in_flight=msg.load.in_flight,
            queued=msg.load.queued,
            rows_per_second=msg.load.rows_per_second,
            window_seconds=msg.load.window_seconds,
        ),
        seam=SeamCost(
            dtype=_DTYPE_FROM_PB[msg.seam.dtype],
            width_in=msg.seam.width_in,
            width_out=msg.seam.width_out,
            bytes_per_token_in=msg.seam.bytes_per_token_in,
            bytes_per_token_out=msg.seam.bytes_per_token_out,
        ),
        health=Health(
            uptime_seconds=msg.health.uptime_seconds,
            recent_errors=msg.health.recent_errors,
            total_errors=msg.health.total_errors,
            window_seconds=msg.health.window_seconds,
        ),
    )
