from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]

class LaneStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANE_STATUS_UNSPECIFIED: _ClassVar[LaneStatus]
    LANE_STATUS_DARK: _ClassVar[LaneStatus]
    LANE_STATUS_CERTIFIED: _ClassVar[LaneStatus]

class EvidenceClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVIDENCE_CLASS_UNSPECIFIED: _ClassVar[EvidenceClass]
    EVIDENCE_CLASS_FIXTURE: _ClassVar[EvidenceClass]
    EVIDENCE_CLASS_REAL_MODEL: _ClassVar[EvidenceClass]
    EVIDENCE_CLASS_REAL_HARDWARE: _ClassVar[EvidenceClass]
    EVIDENCE_CLASS_RELEASE: _ClassVar[EvidenceClass]

class RowKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_KIND_UNSPECIFIED: _ClassVar[RowKind]
    ROW_KIND_PREFILL: _ClassVar[RowKind]
    ROW_KIND_DECODE: _ClassVar[RowKind]
    ROW_KIND_REPLAY: _ClassVar[RowKind]

class OutputKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_KIND_UNSPECIFIED: _ClassVar[OutputKind]
    OUTPUT_KIND_BOUNDARY: _ClassVar[OutputKind]
    OUTPUT_KIND_LOGITS: _ClassVar[OutputKind]
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType
LANE_STATUS_UNSPECIFIED: LaneStatus
LANE_STATUS_DARK: LaneStatus
LANE_STATUS_CERTIFIED: LaneStatus
EVIDENCE_CLASS_UNSPECIFIED: EvidenceClass
EVIDENCE_CLASS_FIXTURE: EvidenceClass
EVIDENCE_CLASS_REAL_MODEL: EvidenceClass
EVIDENCE_CLASS_REAL_HARDWARE: EvidenceClass
EVIDENCE_CLASS_RELEASE: EvidenceClass
ROW_KIND_UNSPECIFIED: RowKind
ROW_KIND_PREFILL: RowKind
ROW_KIND_DECODE: RowKind
ROW_KIND_REPLAY: RowKind
OUTPUT_KIND_UNSPECIFIED: OutputKind
OUTPUT_KIND_BOUNDARY: OutputKind
OUTPUT_KIND_LOGITS: OutputKind

class UsageRequest(_message.Message):
    __slots__ = ("session_id", "session_secret", "grant", "held", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: bytes
    grant: bytes
    held: bool
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ..., grant: _Optional[bytes] = ..., held: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class UsageRecord(_message.Message):
    __slots__ = ("session_id", "epoch", "layer_begin", "layer_end", "forwards", "rows_prefill", "rows_decode", "rows_replay", "bytes_in", "bytes_out", "engine_seconds", "rows_draft", "rows_rejected", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ROWS_DECODE_FIELD_NUMBER: _ClassVar[int]
    ROWS_REPLAY_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    ROWS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    layer_begin: int
    layer_end: int
    forwards: int
    rows_prefill: int
    rows_decode: int
    rows_replay: int
    bytes_in: int
    bytes_out: int
    engine_seconds: float
    rows_draft: int
    rows_rejected: int
    sampling: Sampling
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., forwards: _Optional[int] = ..., rows_prefill: _Optional[int] = ..., rows_decode: _Optional[int] = ..., rows_replay: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., engine_seconds: _Optional[float] = ..., rows_draft: _Optional[int] = ..., rows_rejected: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class UsageReply(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[UsageRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[UsageRecord, _Mapping]]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Expectations(_message.Message):
    __slots__ = ("schema_version", "model_sha256", "layer_begin", "layer_end", "boundary_width")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    model_sha256: bytes
    layer_begin: int
    layer_end: int
    boundary_width: int
    def __init__(self, schema_version: _Optional[int] = ..., model_sha256: _Optional[bytes] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., boundary_width: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Compatibility(_message.Message):
    __slots__ = ("model_sha256", "arch", "n_layer", "official_target_sha", "quant_types", "context", "kv_type", "backend", "llama_cpp_commit", "patch_stack_sha256", "dgr_version", "hardware", "schema_version", "flash_attn", "artifacts", "family_patch_sha256")
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    N_LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFICIAL_TARGET_SHA_FIELD_NUMBER: _ClassVar[int]
    QUANT_TYPES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_TYPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LLAMA_CPP_COMMIT_FIELD_NUMBER: _ClassVar[int]
    PATCH_STACK_SHA256_FIELD_NUMBER: _ClassVar[int]
    DGR_VERSION_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    FLASH_ATTN_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    FAMILY_PATCH_SHA256_FIELD_NUMBER: _ClassVar[int]
    model_sha256: bytes
    arch: str
    n_layer: int
    official_target_sha: str
    quant_types: _containers.RepeatedScalarFieldContainer[str]
    context: int
    kv_type: str
    backend: str
    llama_cpp_commit: str
    patch_stack_sha256: bytes
    dgr_version: str
    hardware: str
    schema_version: int
    flash_attn: str
    artifacts: str
    family_patch_sha256: bytes
    def __init__(self, model_sha256: _Optional[bytes] = ..., arch: _Optional[str] = ..., n_layer: _Optional[int] = ..., official_target_sha: _Optional[str] = ..., quant_types: _Optional[_Iterable[str]] = ..., context: _Optional[int] = ..., kv_type: _Optional[str] = ..., backend: _Optional[str] = ..., llama_cpp_commit: _Optional[str] = ..., patch_stack_sha256: _Optional[bytes] = ..., dgr_version: _Optional[str] = ..., hardware: _Optional[str] = ..., schema_version: _Optional[int] = ..., flash_attn: _Optional[str] = ..., artifacts: _Optional[str] = ..., family_patch_sha256: _Optional[bytes] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("layer_begin", "layer_end", "is_first", "is_last", "needs_token_ids", "mtp")
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    IS_FIRST_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    NEEDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    layer_begin: int
    layer_end: int
    is_first: bool
    is_last: bool
    needs_token_ids: bool
    mtp: bool
    def __init__(self, layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., is_first: _Optional[bool] = ..., is_last: _Optional[bool] = ..., needs_token_ids: _Optional[bool] = ..., mtp: _Optional[bool] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("sessions_max", "sessions_open", "kv_tokens_free", "context_per_session", "max_rows_per_forward", "session_lease_seconds", "sessions_waiting", "admission_wait_seconds")
    SESSIONS_MAX_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OPEN_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FREE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_PER_FORWARD_FIELD_NUMBER: _ClassVar[int]
    SESSION_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_WAITING_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sessions_max: int
    sessions_open: int
    kv_tokens_free: int
    context_per_session: int
    max_rows_per_forward: int
    session_lease_seconds: float
    sessions_waiting: int
    admission_wait_seconds: float
    def __init__(self, sessions_max: _Optional[int] = ..., sessions_open: _Optional[int] = ..., kv_tokens_free: _Optional[int] = ..., context_per_session: _Optional[int] = ..., max_rows_per_forward: _Optional[int] = ..., session_lease_seconds: _Optional[float] = ..., sessions_waiting: _Optional[int] = ..., admission_wait_seconds: _Optional[float] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("in_flight", "queued", "rows_per_second", "window_seconds")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    queued: int
    rows_per_second: float
    window_seconds: float
    def __init__(self, in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., rows_per_second: _Optional[float] = ..., window_seconds: _Optional[float] = ...) -> None: ...

class SeamCost(_message.Message):
    __slots__ = ("dtype", "width_in", "width_out", "bytes_per_token_in", "bytes_per_token_out")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_IN_FIELD_NUMBER: _ClassVar[int]
    WIDTH_OUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_OUT_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    width_in: int
    width_out: int
    bytes_per_token_in: int
    bytes_per_token_out: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., width_in: _Optional[int] = ..., width_out: _Optional[int] = ..., bytes_per_token_in: _Optional[int] = ..., bytes_per_token_out: _Optional[int] = ...) -> None: ...

class Health(_message.Message):
    __slots__ = ("uptime_seconds", "recent_errors", "total_errors", "window_seconds")
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    uptime_seconds: float
    recent_errors: int
    total_errors: int
    window_seconds: float
    def __init__(self, uptime_seconds: _Optional[float] = ..., recent_errors: _Optional[int] = ..., total_errors: _Optional[int] = ..., window_seconds: _Optional[float] = ...) -> None: ...

class Certification(_message.Message):
    __slots__ = ("status", "evidence", "lane_id", "record_id", "record", "nearest", "certify_command")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    NEAREST_FIELD_NUMBER: _ClassVar[int]
    CERTIFY_COMMAND_FIELD_NUMBER: _ClassVar[int]
    status: LaneStatus
    evidence: EvidenceClass
    lane_id: str
    record_id: str
    record: str
    nearest: _containers.RepeatedCompositeFieldContainer[NearestRecord]
    certify_command: str
    def __init__(self, status: _Optional[_Union[LaneStatus, str]] = ..., evidence: _Optional[_Union[EvidenceClass, str]] = ..., lane_id: _Optional[str] = ..., record_id: _Optional[str] = ..., record: _Optional[str] = ..., nearest: _Optional[_Iterable[_Union[NearestRecord, _Mapping]]] = ..., certify_command: _Optional[str] = ...) -> None: ...

class NearestRecord(_message.Message):
    __slots__ = ("record_id", "evidence", "differences")
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    record_id: str
    evidence: EvidenceClass
    differences: _containers.RepeatedCompositeFieldContainer[LaneDifference]
    def __init__(self, record_id: _Optional[str] = ..., evidence: _Optional[_Union[EvidenceClass, str]] = ..., differences: _Optional[_Iterable[_Union[LaneDifference, _Mapping]]] = ...) -> None: ...

class LaneDifference(_message.Message):
    __slots__ = ("part", "value", "recorded")
    PART_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    part: str
    value: str
    recorded: str
    def __init__(self, part: _Optional[str] = ..., value: _Optional[str] = ..., recorded: _Optional[str] = ...) -> None: ...

class Advert(_message.Message):
    __slots__ = ("compatibility", "range", "capacity", "load", "seam", "health", "certification", "security", "data_paths")
    COMPATIBILITY_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SEAM_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATION_FIELD_NUMBER: _ClassVar[int]
    SECURITY_FIELD_NUMBER: _ClassVar[int]
    DATA_PATHS_FIELD_NUMBER: _ClassVar[int]
    compatibility: Compatibility
    range: LayerRange
    capacity: Capacity
    load: Load
    seam: SeamCost
    health: Health
    certification: Certification
    security: Security
    data_paths: DataPaths
    def __init__(self, compatibility: _Optional[_Union[Compatibility, _Mapping]] = ..., range: _Optional[_Union[LayerRange, _Mapping]] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., seam: _Optional[_Union[SeamCost, _Mapping]] = ..., health: _Optional[_Union[Health, _Mapping]] = ..., certification: _Optional[_Union[Certification, _Mapping]] = ..., security: _Optional[_Union[Security, _Mapping]] = ..., data_paths: _Optional[_Union[DataPaths, _Mapping]] = ...) -> None: ...

class DataPaths(_message.Message):
    __slots__ = ("frame_link_port", "native_link_port", "native_link_sealed")
    FRAME_LINK_PORT_FIELD_NUMBER: _ClassVar[int]
    NATIVE_LINK_PORT_FIELD_NUMBER: _ClassVar[int]
    NATIVE_LINK_SEALED_FIELD_NUMBER: _ClassVar[int]
    frame_link_port: int
    native_link_port: int
    native_link_sealed: bool
    def __init__(self, frame_link_port: _Optional[int] = ..., native_link_port: _Optional[int] = ..., native_link_sealed: _Optional[bool] = ...) -> None: ...

class Security(_message.Message):
    __slots__ = ("tls", "client_certificates", "chain_tls")
    TLS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_TLS_FIELD_NUMBER: _ClassVar[int]
    tls: bool
    client_certificates: bool
    chain_tls: bool
    def __init__(self, tls: _Optional[bool] = ..., client_certificates: _Optional[bool] = ..., chain_tls: _Optional[bool] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "expect", "grant", "sampling", "prefix")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    expect: Expectations
    grant: bytes
    sampling: Sampling
    prefix: PrefixRef
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., expect: _Optional[_Union[Expectations, _Mapping]] = ..., grant: _Optional[bytes] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., prefix: _Optional[_Union[PrefixRef, _Mapping]] = ...) -> None: ...

class PrefixRef(_message.Message):
    __slots__ = ("digest", "length")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    length: int
    def __init__(self, digest: _Optional[bytes] = ..., length: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("seed", "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "penalty_last_n")
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    penalty_last_n: int
    def __init__(self, seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., penalty_last_n: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session_id", "epoch", "next_pos", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_POS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    next_pos: int
    session_secret: bytes
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., next_pos: _Optional[int] = ..., session_secret: _Optional[bytes] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "session_secret", "keep_prefix")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREFIX_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    session_secret: bytes
    keep_prefix: PrefixRef
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., session_secret: _Optional[bytes] = ..., keep_prefix: _Optional[_Union[PrefixRef, _Mapping]] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "step", "expect", "expected_next_pos", "positions", "token_ids", "boundary", "logit_rows", "timeout_ms", "no_logits", "session_secret", "kind", "chain_hop", "chain_trace", "ring_until_step", "ring_stop", "draft_rows", "kept_drafts", "ring_draft_max", "mtp_draft_max", "sampled_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NEXT_POS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NO_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CHAIN_HOP_FIELD_NUMBER: _ClassVar[int]
    CHAIN_TRACE_FIELD_NUMBER: _ClassVar[int]
    RING_UNTIL_STEP_FIELD_NUMBER: _ClassVar[int]
    RING_STOP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROWS_FIELD_NUMBER: _ClassVar[int]
    KEPT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    RING_DRAFT_MAX_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFT_MAX_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    step: int
    expect: Expectations
    expected_next_pos: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    boundary: Tensor
    logit_rows: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    no_logits: bool
    session_secret: bytes
    kind: RowKind
    chain_hop: int
    chain_trace: _containers.RepeatedCompositeFieldContainer[HopTrace]
    ring_until_step: int
    ring_stop: _containers.RepeatedScalarFieldContainer[int]
    draft_rows: int
    kept_drafts: int
    ring_draft_max: int
    mtp_draft_max: int
    sampled_tokens: bool
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., expect: _Optional[_Union[Expectations, _Mapping]] = ..., expected_next_pos: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., boundary: _Optional[_Union[Tensor, _Mapping]] = ..., logit_rows: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ..., no_logits: _Optional[bool] = ..., session_secret: _Optional[bytes] = ..., kind: _Optional[_Union[RowKind, str]] = ..., chain_hop: _Optional[int] = ..., chain_trace: _Optional[_Iterable[_Union[HopTrace, _Mapping]]] = ..., ring_until_step: _Optional[int] = ..., ring_stop: _Optional[_Iterable[int]] = ..., draft_rows: _Optional[int] = ..., kept_drafts: _Optional[int] = ..., ring_draft_max: _Optional[int] = ..., mtp_draft_max: _Optional[int] = ..., sampled_tokens: _Optional[bool] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_us", "compute_us", "total_us", "native_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    NATIVE_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    compute_us: int
    total_us: int
    native_us: int
    def __init__(self, queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., total_us: _Optional[int] = ..., native_us: _Optional[int] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("session_id", "epoch", "step", "kind", "output", "next_pos", "timings", "mtp_drafts", "mtp_draft_pos", "sampled")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NEXT_POS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFT_POS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    step: int
    kind: OutputKind
    output: Tensor
    next_pos: int
    timings: Timings
    mtp_drafts: _containers.RepeatedScalarFieldContainer[int]
    mtp_draft_pos: int
    sampled: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[OutputKind, str]] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., next_pos: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., mtp_drafts: _Optional[_Iterable[int]] = ..., mtp_draft_pos: _Optional[int] = ..., sampled: _Optional[_Iterable[int]] = ...) -> None: ...

class ChainHop(_message.Message):
    __slots__ = ("endpoint", "expect", "session_secret", "tls", "frame_link", "native_link", "native_hop")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    FRAME_LINK_FIELD_NUMBER: _ClassVar[int]
    NATIVE_LINK_FIELD_NUMBER: _ClassVar[int]
    NATIVE_HOP_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    expect: Expectations
    session_secret: bytes
    tls: bool
    frame_link: bool
    native_link: bool
    native_hop: int
    def __init__(self, endpoint: _Optional[str] = ..., expect: _Optional[_Union[Expectations, _Mapping]] = ..., session_secret: _Optional[bytes] = ..., tls: _Optional[bool] = ..., frame_link: _Optional[bool] = ..., native_link: _Optional[bool] = ..., native_hop: _Optional[int] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "session_secret", "next", "ring")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    session_secret: bytes
    next: ChainHop
    ring: bool
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., session_secret: _Optional[bytes] = ..., next: _Optional[_Union[ChainHop, _Mapping]] = ..., ring: _Optional[bool] = ...) -> None: ...

class LinkReply(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ChainAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChainOutputRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    session_secret: bytes
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., session_secret: _Optional[bytes] = ...) -> None: ...

class HopTrace(_message.Message):
    __slots__ = ("hop", "timings", "bytes_in", "bytes_out")
    HOP_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    hop: int
    timings: Timings
    bytes_in: int
    bytes_out: int
    def __init__(self, hop: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ...) -> None: ...

class ChainOutputReply(_message.Message):
    __slots__ = ("reply", "hops", "ring_next")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    RING_NEXT_FIELD_NUMBER: _ClassVar[int]
    reply: ForwardReply
    hops: _containers.RepeatedCompositeFieldContainer[HopTrace]
    ring_next: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reply: _Optional[_Union[ForwardReply, _Mapping]] = ..., hops: _Optional[_Iterable[_Union[HopTrace, _Mapping]]] = ..., ring_next: _Optional[_Iterable[int]] = ...) -> None: ...
