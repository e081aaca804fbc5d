"""The forward frame on the wire: expectations, encoding (client) and checked decoding (worker).

Decoding checks everything the frame itself can get wrong before any state is touched, and
raises :class:`FrameRejected` or :class:`ExpectationMismatch` (INVALID_ARGUMENT on the wire):
the session id (``dgr_session.identifiers``' rule), every enum (an open proto3 enum carries any
int32: a value this schema does not name is refused, never looked up), positions, token ids,
tensors (dtype, shape, bytes, finite values) and logit rows. Nothing a sender puts in a frame
raises anything else, so no frame can count as the worker's own fault.
What only the session's state can decide (epoch, next position, capacity) is left to the engine.
Tensors are raw little-endian f32, row-major; decoding is zero-copy (``np.frombuffer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from dgr_engine.errors import ExpectationMismatch, FrameRejected, InvalidArgument
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session import identifiers
from dgr_session.commands import Forward, ForwardKind
from dgr_session.prefixes import PrefixRef
from dgr_session.sampling import GREEDY, InvalidSamplingParameter, Sampling

if TYPE_CHECKING:
    from dgr_engine.engine import ShardInfo

SCHEMA_VERSION = 1
"""Version of the messages in ``proto/dgr/shard/v1`` this code speaks."""

MAX_SESSION_ID_BYTES = identifiers.SESSION_ID_MAX_LENGTH
"""Longest session id a worker accepts (bytes: the id is ASCII, ``dgr_session.identifiers``)."""

F32 = np.dtype("<f4")
"""The boundary and logits element type of schema 1."""

_MAX_POSITION = np.iinfo(np.int32).max

MAX_DRAFT_ROWS = 16
"""Most drafts one verification pass may carry: with the newest token, 17 rows, under the 32
from which patch 0010 lets llamafile's sgemm take a matmul, so every row of a verification pass
keeps the bits it has when decoded alone, and no more than a DeepSeek V4 stage can drop again
(``DGR_V4_ROLLBACK_ROWS``, ``docs/speculative.md``)."""

FloatRows = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int32]


def _hex(value: bytes) -> str:
    return value.hex()[:12] + ("…" if len(value) > 6 else "")


@attrs.frozen
class Expectations:
    """What a sender believes a worker is; a worker refuses frames meant for another."""

    model_sha256: bytes = attrs.field(repr=_hex)
    """SHA-256 of the GGUF file."""
    layer_begin: int
    """First layer of the worker's range."""
    layer_end: int
    """One past the last layer of the worker's range."""
    boundary_width: int
    """Floats per input boundary row (0: the first stage, which takes token ids)."""
    schema_version: int = SCHEMA_VERSION
    """Message schema version."""

    @classmethod
    def of_shard(cls, model_sha256: bytes, info: ShardInfo) -> Expectations:
        """What a worker hosting ``info`` over the file with this hash is."""
        return cls(model_sha256, info.layer_begin, info.layer_end, info.in_width)


@attrs.frozen
class ForwardFrame:
    """A checked forward request, as the engine takes it."""

    session_id: str
    epoch: int
    step: int
    positions: IntArray = attrs.field(repr=False)
    """One position per row, contiguous."""
    tokens: IntArray | None = attrs.field(repr=False)
    """Token ids where the shard needs them, else ``None``."""
    rows: FloatRows | None = attrs.field(repr=False)
    """Boundary rows ``[n, in_width]`` (read-only view of the request), ``None`` on stage 0."""
    want: npt.NDArray[np.uint8] | None = attrs.field(repr=False)
    """Last stage: 0/1 per row, whose logits to return; ``None``: the last row only."""
    drafts: int = 0
    """A verification pass: its last ``drafts`` rows are draft tokens (speculative decoding)."""
    kept_drafts: int | None = None
    """The frame after a verification pass: how many of its drafts the session kept
    (``None``: the previous frame was no verification pass)."""
    mtp_draft_max: int = 0
    """A last stage with the MTP block drafts at most this many tokens to follow the frame's
    next token (``ForwardReply.mtp_drafts``); 0: none."""
    sampled_tokens: bool = False
    """A last stage answers the session's token of each wanted row (``ForwardReply.sampled``,
    its sampler's: ``docs/sampling.md``) instead of its logits."""
    sent_ids: IntArray | None = attrs.field(default=None, repr=False)
    """The token ids the frame carried, whether or not the shard needs them (a last stage's
    penalised sampler reads the tokens before each row); ``None``: none came."""

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])


# --- sampling (docs/sampling.md) ---------------------------------------------------------------

_SAMPLING_FIELDS = tuple(a.name for a in attrs.fields(Sampling))


def sampling_to_proto(sampling: Sampling) -> pb.Sampling:
    """A session's sampler as the wire's ``Sampling`` (its open's, its usage record's)."""
    return pb.Sampling(**{name: getattr(sampling, name) for name in _SAMPLING_FIELDS})


def sampling_from_proto(message: pb.Sampling, present: bool) -> Sampling:
    """The sampler an open carries (``present``: the field is set; else greedy);
    :class:`InvalidArgument` (``DGR_E_INVALID_ARGUMENT``) for a value out of range."""
    if not present:
        return GREEDY
    try:
        return Sampling(**{name: getattr(message, name) for name in _SAMPLING_FIELDS})
    except InvalidSamplingParameter as exc:
        raise InvalidArgument(f"DGR_E_INVALID_ARGUMENT: the open's sampling: {exc}") from exc


PREFIX_DIGEST_BYTES = 32
"""A kept prefix's name: a SHA-256 (``dgr_session.prefixes.prefix_digest``)."""


def prefix_from_proto(message: pb.PrefixRef) -> PrefixRef:
    """A kept prefix an open or a close names; :class:`InvalidArgument`
    (``DGR_E_INVALID_ARGUMENT``) for a digest that is no SHA-256."""
    if len(message.digest) != PREFIX_DIGEST_BYTES:
        raise InvalidArgument(
            f"DGR_E_INVALID_ARGUMENT: a prefix digest is {PREFIX_DIGEST_BYTES} bytes, got "
            f"{len(message.digest)}"
        )
    return PrefixRef(bytes(message.digest), int(message.length))


# --- expectations ------------------------------------------------------------------------------


def expectations_to_proto(expect: Expectations) -> pb.Expectations:
    return pb.Expectations(
        schema_version=expect.schema_version,
        model_sha256=expect.model_sha256,
        layer_begin=expect.layer_begin,
        layer_end=expect.layer_end,
        boundary_width=expect.boundary_width,
    )


def check_expectations(got: pb.Expectations, mine: Expectations) -> None:
    """Raises :class:`ExpectationMismatch` (naming the first difference) unless ``got`` is
    exactly what this worker is."""
    if got.schema_version != mine.schema_version:
        raise ExpectationMismatch(
            f"schema version {got.schema_version}, this worker speaks {mine.schema_version}",
            status="DGR_E_EXPECTATION_SCHEMA",
        )
    if got.model_sha256 != mine.model_sha256:
        raise ExpectationMismatch(
            f"frame is for model {_hex(got.model_sha256) or '(none)'}, this worker serves "
            f"{_hex(mine.model_sha256)}",
            status="DGR_E_EXPECTATION_MODEL",
        )
    if (got.layer_begin, got.layer_end) != (mine.layer_begin, mine.layer_end):
        raise ExpectationMismatch(
            f"frame is for layers [{got.layer_begin}, {got.layer_end}), this worker owns "
            f"[{mine.layer_begin}, {mine.layer_end})",
            status="DGR_E_EXPECTATION_RANGE",
        )
    if got.boundary_width != mine.boundary_width:
        raise ExpectationMismatch(
            f"frame expects boundary width {got.boundary_width}, this worker takes "
            f"{mine.boundary_width}",
            status="DGR_E_EXPECTATION_WIDTH",
        )


def check_session_id(session_id: str) -> None:
    """:class:`FrameRejected` (``DGR_E_FRAME``) unless ``session_id`` keeps the one rule of
    ``dgr_session.identifiers`` (the client checks the same before it sends)."""
    try:
        identifiers.check_session_id(session_id)
    except identifiers.InvalidIdentifier as exc:
        raise FrameRejected(f"DGR_E_FRAME: {exc}") from None


def enum_name(enum: Any, value: int, what: str) -> str:
    """The name of ``value`` in the proto enum ``enum``; :class:`FrameRejected` naming
    ``what`` and the values it may take when the schema does not define it."""
    try:
        return str(enum.Name(value))
    except ValueError:
        known = ", ".join(f"{enum.Name(v)}={v}" for v in sorted(enum.values()))
        raise FrameRejected(
            f"DGR_E_FRAME: {what} {value} is not defined by schema {SCHEMA_VERSION} ({known})"
        ) from None


# --- tensors -----------------------------------------------------------------------------------


def fill_tensor(tensor: pb.Tensor, rows: npt.NDArray[np.floating]) -> None:
    """Writes a 2-D float array into ``tensor`` (in place: no sub-message copy) as f32 LE."""
    arr = np.ascontiguousarray(rows, dtype=F32)
    if arr.ndim != 2:
        raise FrameRejected(f"a tensor must be 2-D [rows, width], got shape {arr.shape}")
    tensor.dtype = pb.DTYPE_F32
    tensor.shape[:] = arr.shape
    tensor.data = arr.tobytes()


def tensor_to_proto(rows: npt.NDArray[np.floating]) -> pb.Tensor:
    """A 2-D float array as a little-endian f32 tensor message."""
    tensor = pb.Tensor()
    fill_tensor(tensor, rows)
    return tensor


def tensor_from_proto(tensor: pb.Tensor, n_rows: int, width: int, what: str) -> FloatRows:
    """The tensor as a read-only ``[n_rows, width]`` f32 view; :class:`FrameRejected` unless
    dtype, shape and byte length are exactly that (an undefined dtype included)."""
    if tensor.dtype != pb.DTYPE_F32:
        name = enum_name(pb.DType, tensor.dtype, f"{what}: dtype")
        raise FrameRejected(
            f"{what}: dtype {name} not supported (schema {SCHEMA_VERSION} carries DTYPE_F32)"
        )
    shape = tuple(tensor.shape)
    if shape != (n_rows, width):
        raise FrameRejected(f"{what}: shape {list(shape)}, expected [{n_rows}, {width}]")
    data = tensor.data  # each read of a bytes field copies it: read once
    if len(data) != n_rows * width * F32.itemsize:
        raise FrameRejected(
            f"{what}: {len(data)} bytes for shape [{n_rows}, {width}] f32 "
            f"({n_rows * width * F32.itemsize} expected)"
        )
    return np.frombuffer(data, dtype=F32).reshape(n_rows, width)


# --- forward request ---------------------------------------------------------------------------


ROW_KINDS = {
    ForwardKind.PREFILL: pb.ROW_KIND_PREFILL,
    ForwardKind.DECODE: pb.ROW_KIND_DECODE,
    ForwardKind.REPLAY: pb.ROW_KIND_REPLAY,
}
"""``Forward.kind`` on the wire (``None``: unspecified)."""
ROW_KIND_NAMES = {v: k.value for k, v in ROW_KINDS.items()}
"""The names of the kinds; ``ROW_KIND_UNSPECIFIED`` is ``"unspecified"``; a decoded frame
never holds another value (:func:`decode_forward` refuses it)."""


def _kind(value: ForwardKind | str | None) -> ForwardKind | None:
    """A frame's kind: a :class:`ForwardKind` (or its name), ``None`` (or ``""``) for
    unspecified; any other name is a ``ValueError``, never silently unspecified."""
    return None if value is None or value == "" else ForwardKind(value)


def _ints(values: Sequence[int] | npt.NDArray[np.integer] | range) -> npt.NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@attrs.frozen(eq=False)
class Frame:
    """One forward frame as every data path sends it (gRPC, the frame link): the rows a
    session runs on a stage, and what the client adds to them (the stage's expectations, the
    session's secret, the frame's deadline). Built once, from the session's ``Forward``
    (:meth:`of_call`), and passed whole; :func:`encode_frame` is its one encoding."""

    session_id: str
    epoch: int
    step: int
    expect: Expectations
    positions: npt.NDArray[np.int64] = attrs.field(converter=_ints)
    """Contiguous, continuing the session's KV; ``expected_next_pos`` is the first."""
    tokens: npt.NDArray[np.int64] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_ints)
    )
    """The rows' token ids: on the first stage, and where the range needs them."""
    boundary: npt.NDArray[np.floating] | None = None
    """The stage before's rows (``None`` on the first stage)."""
    logit_rows: Sequence[int] | None = None
    """Rows whose logits a last stage returns (``None``: the last)."""
    no_logits: bool = False
    """A last stage returns none (it skips the output head)."""
    timeout: float | None = None
    """The frame's own deadline, seconds (``timeout_ms``)."""
    session_secret: bytes = b""
    kind: ForwardKind | None = attrs.field(default=None, converter=_kind)
    """What the rows are, for the stage's metrics and usage (``None``: unspecified)."""
    drafts: int = 0
    """A verification pass of this many drafts (``docs/speculative.md``)."""
    kept_drafts: int | None = None
    """How many drafts of the pass before were kept (the frame after one)."""
    mtp_draft_max: int = 0
    """The MTP drafts a last stage with the block returns."""
    sampled_tokens: bool = False
    """A last stage answers the session's token of each wanted row instead of its logits."""

    @classmethod
    def of_call(
        cls,
        call: Forward,
        expect: Expectations,
        *,
        session_secret: bytes,
        timeout: float | None,
        tokens: bool = True,
        boundary: npt.NDArray[np.floating] | None = None,
        last_stage: bool = True,
        mtp_draft_max: int = 0,
    ) -> Frame:
        """``call``'s frame to ``call.stage``: its rows (with their token ids where
        ``tokens``), its kind, drafts and kept drafts; a verification pass asks the logits of
        every row; a sampled call (``Forward.sampled``) to the ``last_stage`` asks its tokens."""
        return cls(
            call.session_id,
            call.epoch,
            call.step,
            expect,
            call.positions,
            tokens=call.token_ids if tokens else None,
            boundary=boundary,
            logit_rows=range(len(call.positions)) if call.drafts else None,
            no_logits=not call.wants_logits,
            timeout=timeout,
            session_secret=session_secret,
            kind=call.kind,
            drafts=call.drafts,
            kept_drafts=call.kept_drafts,
            mtp_draft_max=mtp_draft_max,
            sampled_tokens=call.sampled and call.wants_logits and last_stage,
        )

    def part(self, start: int, stop: int | None = None) -> Frame:
        """The frame of this one's rows ``[start, stop)``: a part that ends before the last row
        is sent ahead (a prefill's frames back to back) and wants no logits, drafts or sampled
        tokens; the part that ends with the last row keeps them."""
        n = len(self.positions)
        stop = n if stop is None else stop
        rows = slice(start, stop)
        tokens = None if self.tokens is None else self.tokens[rows]
        boundary = None if self.boundary is None else self.boundary[rows]
        if stop >= n:
            logit_rows = None if self.logit_rows is None else range(n - start)
            return attrs.evolve(
                self, positions=self.positions[rows], tokens=tokens, boundary=boundary,
                logit_rows=logit_rows,
            )  # fmt: skip
        return attrs.evolve(
            self, positions=self.positions[rows], tokens=tokens, boundary=boundary,
            logit_rows=None, no_logits=True, drafts=0, kept_drafts=None, mtp_draft_max=0,
            sampled_tokens=False,
        )  # fmt: skip


def encode_frame(frame: Frame) -> pb.ForwardRequest:
    """A frame's forward request (the one encoding every data path sends)."""
    pos = frame.positions
    timeout = frame.timeout
    request = pb.ForwardRequest(
        session_id=frame.session_id,
        epoch=frame.epoch,
        step=frame.step,
        expect=expectations_to_proto(frame.expect),
        expected_next_pos=int(pos[0]) if pos.size else 0,
        positions=pos.tolist(),
        timeout_ms=0 if timeout is None else max(1, min(int(timeout * 1000), 2**32 - 1)),
        session_secret=frame.session_secret,
        kind=pb.ROW_KIND_UNSPECIFIED if frame.kind is None else ROW_KINDS[frame.kind],
    )
    if frame.tokens is not None:
        request.token_ids.extend(frame.tokens.tolist())
    if frame.boundary is not None:
        fill_tensor(request.boundary, frame.boundary)
    if frame.logit_rows:
        request.logit_rows.extend(int(i) for i in frame.logit_rows)
    if frame.no_logits:
        request.no_logits = True
    if frame.drafts:
        request.draft_rows = frame.drafts
    if frame.kept_drafts is not None:
        request.kept_drafts = frame.kept_drafts
    if frame.mtp_draft_max:
        request.mtp_draft_max = frame.mtp_draft_max
    if frame.sampled_tokens:
        request.sampled_tokens = True
    return request


def encode_forward(
    session_id: str,
    epoch: int,
    step: int,
    expect: Expectations,
    positions: Sequence[int] | npt.NDArray[np.integer],
    **fields: Any,
) -> pb.ForwardRequest:
    """The forward request of ``Frame(session_id, epoch, step, expect, positions,
    **fields)``: for callers (tests, tools) that build a frame by hand."""
    return encode_frame(Frame(session_id, epoch, step, expect, positions, **fields))


def check_finite_rows(rows: FloatRows, what: str) -> None:
    """Refuses rows holding NaN or infinity (``FrameRejected``, naming the first one): one such
    value would poison every later row of the session's KV."""
    finite = np.isfinite(rows)
    if not finite.all():
        row, col = (int(i) for i in np.argwhere(~finite)[0])
        raise FrameRejected(
            f"{what} rows hold non-finite values ({int((~finite).sum())}; first at row {row},"
            f" column {col}: {rows[row, col]})"
        )


def decode_forward(request: pb.ForwardRequest, mine: Expectations, info: ShardInfo) -> ForwardFrame:
    """Checks a forward request against this worker and returns the engine's arguments."""
    check_session_id(request.session_id)
    check_expectations(request.expect, mine)
    if request.kind not in ROW_KIND_NAMES and request.kind != pb.ROW_KIND_UNSPECIFIED:
        enum_name(pb.RowKind, request.kind, "kind")
    n = len(request.positions)
    if n == 0:
        raise FrameRejected("a frame needs at least one row (position)")
    positions = np.fromiter(request.positions, dtype=np.int64, count=n)
    start = int(request.expected_next_pos)
    if int(positions[0]) != start or (n > 1 and not np.all(np.diff(positions) == 1)):
        raise FrameRejected(
            f"positions must be expected_next_pos + i = {start}.., got "
            f"{positions[:4].tolist()}{'…' if n > 4 else ''}"
        )
    if int(positions[-1]) > _MAX_POSITION:
        raise FrameRejected(f"position {int(positions[-1])} out of range")

    n_tok = len(request.token_ids)
    tokens: IntArray | None = None
    if info.is_first or info.needs_token_ids:
        if n_tok != n:
            raise FrameRejected(f"{n_tok} token ids for {n} rows: this stage needs one per row")
        tokens = np.fromiter(request.token_ids, dtype=np.int32, count=n)
    elif n_tok not in (0, n):
        raise FrameRejected(f"{n_tok} token ids for {n} rows: send one per row or none")
    sent_ids = tokens
    if sent_ids is None and n_tok and info.is_last:
        sent_ids = np.fromiter(request.token_ids, dtype=np.int32, count=n)

    rows: FloatRows | None = None
    has_boundary = request.HasField("boundary")
    if info.is_first:
        if has_boundary and (request.boundary.data or request.boundary.shape):
            raise FrameRejected("the first stage takes token ids, not boundary rows")
    elif not has_boundary:
        raise FrameRejected(f"this stage takes boundary rows [{n}, {info.in_width}]: none sent")
    else:
        rows = tensor_from_proto(request.boundary, n, info.in_width, "boundary")
        check_finite_rows(rows, "boundary")

    want: npt.NDArray[np.uint8] | None = None
    if request.no_logits and request.logit_rows:
        raise FrameRejected("no_logits with logit_rows: ask for some logits or none")
    if request.no_logits and request.sampled_tokens:
        raise FrameRejected("no_logits with sampled_tokens: ask for tokens or no logits")
    if info.is_last and request.no_logits:
        want = np.zeros(n, dtype=np.uint8)  # no output row: the output head is skipped
    elif info.is_last and request.logit_rows:
        idx = np.fromiter(request.logit_rows, dtype=np.int64, count=len(request.logit_rows))
        if int(idx[-1]) >= n or (idx.size > 1 and not np.all(np.diff(idx) > 0)):
            raise FrameRejected(f"logit_rows must be strictly increasing row indices < {n}")
        want = np.zeros(n, dtype=np.uint8)
        want[idx] = 1
    drafts = int(request.draft_rows)
    if drafts:
        if drafts >= n or drafts > MAX_DRAFT_ROWS:
            raise FrameRejected(
                f"draft_rows {drafts}: a verification pass holds the newest token and at most "
                f"{min(n - 1, MAX_DRAFT_ROWS)} drafts in its {n} rows"
            )
        if request.no_logits or (info.is_last and (want is None or not want.all())):
            raise FrameRejected("a verification pass wants the logits of every row")
    kept = int(request.kept_drafts) if request.HasField("kept_drafts") else None
    if kept is not None and kept > MAX_DRAFT_ROWS:
        raise FrameRejected(f"kept_drafts {kept} is over {MAX_DRAFT_ROWS}")
    mtp_draft_max = int(request.mtp_draft_max)
    if mtp_draft_max > MAX_DRAFT_ROWS:
        raise FrameRejected(f"mtp_draft_max {mtp_draft_max} is over {MAX_DRAFT_ROWS}")
    return ForwardFrame(
        session_id=request.session_id,
        epoch=int(request.epoch),
        step=int(request.step),
        positions=positions.astype(np.int32),
        tokens=tokens,
        rows=rows,
        want=want,
        drafts=drafts,
        kept_drafts=kept,
        mtp_draft_max=mtp_draft_max,
        sampled_tokens=bool(request.sampled_tokens),
        sent_ids=sent_ids,
    )


# --- forward reply -----------------------------------------------------------------------------


def sampled_from_reply(reply: pb.ForwardReply) -> tuple[int, ...] | None:
    """The reply's tokens (``ForwardRequest.sampled_tokens``), ``None`` when it carries none (a
    reply of logits); :class:`FrameRejected` when it carries both, or a negative token."""
    if not reply.sampled:
        return None
    tokens = tuple(int(t) for t in reply.sampled)
    if reply.output.data or reply.output.shape:
        raise FrameRejected("a reply with sampled tokens carries no output rows")
    if min(tokens) < 0:
        raise FrameRejected(f"sampled token {min(tokens)} is not a token id")
    return tokens


def output_from_reply(reply: pb.ForwardReply) -> FloatRows:
    """The reply's output rows, checked as the next stage checks a boundary (shape, byte
    length, every value finite): a stage's malformed output is refused where it arrives,
    whichever path carried it, and names the stage that sent it."""
    shape = tuple(reply.output.shape)
    if len(shape) != 2:
        raise FrameRejected(f"output: shape {list(shape)} is not [rows, width]")
    rows = tensor_from_proto(reply.output, shape[0], shape[1], "output")
    check_finite_rows(rows, "output")
    return rows
