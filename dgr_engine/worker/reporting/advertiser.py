"""What a worker states about itself: its exact lane, certified only by a record of exactly it
(read once, at start, from ``WorkerConfig.evidence_dir`` under the lock; else dark, the log
saying why), and its capability advert (``Describe``), built from the lane, the shard's shape
and the live counts, never waiting for the engine (``docs/worker.md``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.lane import LaneKey
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.registry import LaneLookup, find_certification
from dgr_engine.engine import ShardInfo
from dgr_engine.wire import frames
from dgr_engine.wire.advert import (
    Advert,
    Capacity,
    DataPaths,
    Health,
    LayerSpan,
    Load,
    SeamCost,
    Security,
)
from dgr_engine.worker.config import WorkerConfig
from dgr_engine.worker.lifecycle.sessions import TableSnapshot
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_engine.worker.reporting.load import LoadSnapshot
from dgr_session.identity import CertificationStatus, Lane, ModelIdentity, Recipe

if TYPE_CHECKING:
    from loguru import Logger


class Advertiser:
    """One worker's lane and advert. ``sessions``, ``load`` and ``waiting`` read the live
    counts (the session table's, the load meter's, the admission line's)."""

    def __init__(
        self,
        build: BuildIdentity,
        info: ShardInfo,
        config: WorkerConfig,
        log: Logger,
        *,
        sessions: Callable[[], TableSnapshot],
        load: Callable[[], LoadSnapshot],
        waiting: Callable[[], int],
        data_paths: Callable[[], DataPaths] = DataPaths,
        mtp: bool = False,
    ) -> None:
        self.build = build
        self.mtp = mtp
        """The engine loaded the MTP block (the advert's ``span.mtp``)."""
        self.info = info
        self.config = config
        self.log = log
        self._sessions = sessions
        self._load = load
        self._waiting = waiting
        self._data_paths = data_paths
        self.lane_key: LaneKey = build.lane_key(
            arch=info.arch, n_layer=info.n_layer, context_per_session=info.n_ctx_per_session
        )
        """The exact lane this worker serves."""
        self.lane_lookup = self._find_certification()
        """Its certification (``None``: dark) and why."""

    def _find_certification(self) -> LaneLookup:
        found = self._look_in(self.config.lock_path, self.config.evidence_dir)
        if found.certification is None and self.config.own_lane is not None:
            own = self._look_in(*self.config.own_lane)
            if own.certification is not None:
                found = own
        lane = self.lane_key.lane_id[:12]
        if found.certification is None:
            self.log.info("lane {} dark: {}", lane, "; ".join(found.reasons))
        else:
            cert = found.certification
            self.log.info(
                "lane {} certified: {} evidence, record {}",
                lane,
                cert.evidence_class.value,
                cert.record_id[:12],
            )
        return found

    def _look_in(self, lock_path: Path | None, evidence: Path | None) -> LaneLookup:
        lock = None
        if lock_path is not None:
            try:
                lock = load_lock(lock_path)
            except EvidenceError as exc:
                self.log.warning("lane dark: {}", exc)
                return LaneLookup(None, (str(exc),))
        return find_certification(self.lane_key, evidence, lock=lock)

    def lane(self) -> Lane:
        """The lane with its certification (dark unless a record of exactly it was loaded),
        the nearest records of the classes above it and the command that would certify it."""
        build, cert = self.build, self.lane_lookup.certification
        return Lane(
            backend=build.backend,
            llama_cpp_commit=build.llama_cpp_commit,
            patch_stack_hash=build.patch_stack_sha256,
            dgr_version=build.dgr_version,
            hardware=build.hardware,
            certification=CertificationStatus.DARK
            if cert is None
            else CertificationStatus.CERTIFIED,
            evidence=None if cert is None else cert.evidence_class,
            lane_id=self.lane_key.lane_id,
            record_id="" if cert is None else cert.record_id,
            record="" if cert is None else cert.record_text,
            nearest=self.lane_lookup.nearest,
            certify_command=self.config.certify_command,
            family_patch_hash=bytes.fromhex(self.lane_key.family_patch_sha256),
        )

    def advert(self) -> Advert:
        """The capability advert now (never waits for the engine)."""
        info, build = self.info, self.build
        table = self._sessions()
        load = self._load()
        # token ids: the first stage's input, hash-routed layers', and a last stage's sampler's
        # history (a penalised sampler reads the tokens before each row: docs/sampling.md)
        token_bytes = 4 if (info.is_first or info.needs_token_ids or info.is_last) else 0
        return Advert(
            identity=ModelIdentity(
                content_hash=build.model_sha256,
                arch=info.arch,
                n_layer=info.n_layer,
                official_target_sha=build.official_target_sha,
            ),
            recipe=Recipe(
                quant_types=build.quant_types,
                context=info.n_ctx_per_session,
                kv_type=build.kv_type,
                flash_attn=build.flash_attn,
            ),
            lane=self.lane(),
            schema_version=frames.SCHEMA_VERSION,
            span=LayerSpan(
                layer_begin=info.layer_begin,
                layer_end=info.layer_end,
                is_first=info.is_first,
                is_last=info.is_last,
                needs_token_ids=info.needs_token_ids,
                mtp=self.mtp,
            ),
            capacity=Capacity(
                sessions_max=info.max_sessions,
                sessions_open=table.sessions_open,
                kv_tokens_free=info.max_sessions * info.n_ctx_per_session - table.kv_tokens_used,
                context_per_session=info.n_ctx_per_session,
                max_rows_per_forward=info.n_batch,
                session_lease_seconds=self.config.session_lease_seconds or 0.0,
                sessions_waiting=self._waiting(),
                admission_wait_seconds=self.config.admission_wait_seconds,
            ),
            load=Load(
                in_flight=load.in_flight,
                queued=load.queued,
                rows_per_second=load.rows_per_second,
                window_seconds=load.window_seconds,
            ),
            seam=SeamCost(
                dtype="f32",
                width_in=info.in_width,
                width_out=info.out_width,
                bytes_per_token_in=4 * info.in_width + 4 + token_bytes,
                bytes_per_token_out=4 * info.out_width,
            ),
            artifacts=build.artifacts,
            security=Security(
                tls=self.config.tls is not None,
                client_certificates=self.config.tls is not None and self.config.tls.mutual,
                chain_tls=self.config.chain_tls is not None,
            ),
            data_paths=self._data_paths(),
            health=Health(
                uptime_seconds=load.uptime_seconds,
                recent_errors=load.recent_errors,
                total_errors=load.total_errors,
                window_seconds=load.window_seconds,
            ),
        )
