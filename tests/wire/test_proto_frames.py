"""The forward frame codec and the status table, without a network.

Every way a frame can be malformed is refused with its typed error before any state is touched;
well-formed frames round-trip bit for bit; every dgr-status maps to one gRPC code and back to
the same exception class.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dgr_engine import errors as E
from dgr_engine.engine import ShardInfo
from dgr_engine.errors import (
    ExpectationMismatch,
    FrameRejected,
    ShardDeadlineExceeded,
    ShardRpcError,
    ShardUnavailable,
)
from dgr_engine.status import is_worker_fault
from dgr_engine.wire import frames as F
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import (
    error_from_rpc,
    error_from_trailers,
    grpc_status_for,
    known_statuses,
    refusal_trailers,
)
from dgr_session.commands import ForwardKind
from dgr_session.identifiers import InvalidIdentifier

HASH = bytes(range(32))


def shard(begin: int, end: int, width: int = 64, n_layer: int = 4) -> ShardInfo:
    return ShardInfo(
        arch="llama",
        n_layer=n_layer,
        layer_begin=begin,
        layer_end=end,
        n_embd=width,
        n_vocab=256,
        in_width=0 if begin == 0 else width,
        out_width=256 if end == n_layer else width,
        is_first=begin == 0,
        is_last=end == n_layer,
        needs_token_ids=begin == 0,
        mtp_owner=end == n_layer,
        max_sessions=4,
        n_ctx_per_session=256,
        n_batch=64,
    )


FIRST, MIDDLE, LAST = shard(0, 1), shard(1, 3), shard(3, 4)


def mine(info: ShardInfo) -> F.Expectations:
    return F.Expectations.of_shard(HASH, info)


def rows(n: int, width: int = 64) -> np.ndarray:
    return np.arange(n * width, dtype=np.float32).reshape(n, width) / 7


def middle_request(n: int = 3, start: int = 5) -> pb.ForwardRequest:
    return F.encode_forward("s", 1, 2, mine(MIDDLE), range(start, start + n), boundary=rows(n))


# --- round trips -------------------------------------------------------------------------------


@given(
    n=st.integers(1, 8),
    width=st.sampled_from([1, 64, 4 * 4096]),
    start=st.integers(0, 2**31 - 10),
    epoch=st.integers(0, 2**64 - 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_middle_frame_round_trips_bit_for_bit(
    n: int, width: int, start: int, epoch: int, seed: int
) -> None:
    info = shard(1, 3, width)
    bits = np.random.default_rng(seed).integers(0, 2**32, size=(n, width), dtype=np.uint32)
    special = (bits & 0x7F800000) == 0x7F800000  # NaN or infinity: refused (test below)
    bits[special] &= ~np.uint32(0x00800000)  # any other pattern: huge, tiny, subnormal
    boundary = bits.view(np.float32)
    request = F.encode_forward(
        "sess", epoch, 7, mine(info), range(start, start + n), boundary=boundary
    )
    wire = pb.ForwardRequest.FromString(request.SerializeToString())
    frame = F.decode_forward(wire, mine(info), info)
    assert (frame.session_id, frame.epoch, frame.step) == ("sess", epoch, 7)
    assert frame.positions.tolist() == list(range(start, start + n))
    assert frame.rows is not None and np.array_equal(frame.rows.view(np.uint32), bits)
    assert frame.tokens is None and frame.want is None


def test_first_frame_carries_tokens_and_no_rows() -> None:
    request = F.encode_forward("s", 0, 0, mine(FIRST), range(4), tokens=[1, 2, 3, 250])
    frame = F.decode_forward(request, mine(FIRST), FIRST)
    assert frame.tokens is not None and frame.tokens.tolist() == [1, 2, 3, 250]
    assert frame.rows is None


def test_last_frame_logit_rows_become_flags() -> None:
    request = F.encode_forward("s", 0, 0, mine(LAST), range(4), boundary=rows(4), logit_rows=[0, 3])
    frame = F.decode_forward(request, mine(LAST), LAST)
    assert frame.want is not None and frame.want.tolist() == [1, 0, 0, 1]
    default = F.decode_forward(
        F.encode_forward("s", 0, 0, mine(LAST), range(4), boundary=rows(4)), mine(LAST), LAST
    )
    assert default.want is None  # the engine's default: the last row only


def test_token_sideband_is_optional_on_later_stages() -> None:
    request = F.encode_forward("s", 0, 0, mine(MIDDLE), [0, 1], tokens=[4, 5], boundary=rows(2))
    assert F.decode_forward(request, mine(MIDDLE), MIDDLE).tokens is None


def test_output_decoding_checks_the_reply() -> None:
    out = rows(2, 256)
    reply = pb.ForwardReply(output=F.tensor_to_proto(out))
    assert np.array_equal(F.output_from_reply(reply), out)
    reply.output.data = reply.output.data[:-4]
    with pytest.raises(FrameRejected, match="bytes"):
        F.output_from_reply(reply)


def test_timeout_becomes_milliseconds() -> None:
    assert F.encode_forward("s", 0, 0, mine(FIRST), [0], tokens=[1]).timeout_ms == 0
    assert F.encode_forward("s", 0, 0, mine(FIRST), [0], tokens=[1], timeout=2.5).timeout_ms == 2500
    assert F.encode_forward("s", 0, 0, mine(FIRST), [0], tokens=[1], timeout=1e-6).timeout_ms == 1


# --- refusals ----------------------------------------------------------------------------------


def _wrong_dtype(r: pb.ForwardRequest) -> None:
    r.boundary.dtype = pb.DTYPE_F16


def _wrong_shape(r: pb.ForwardRequest) -> None:
    del r.boundary.shape[:]
    r.boundary.shape.extend([1, 3 * 64])  # same byte count, wrong shape


def _short_bytes(r: pb.ForwardRequest) -> None:
    r.boundary.data = r.boundary.data[:-1]


def _no_boundary(r: pb.ForwardRequest) -> None:
    r.ClearField("boundary")


def _gap_in_positions(r: pb.ForwardRequest) -> None:
    r.positions[2] += 1


def _expected_pos_differs(r: pb.ForwardRequest) -> None:
    r.expected_next_pos += 1


def _no_rows(r: pb.ForwardRequest) -> None:
    del r.positions[:]


def _token_count(r: pb.ForwardRequest) -> None:
    r.token_ids.extend([1])


def _empty_session(r: pb.ForwardRequest) -> None:
    r.session_id = ""


def _long_session(r: pb.ForwardRequest) -> None:
    r.session_id = "x" * (F.MAX_SESSION_ID_BYTES + 1)


def _undefined_dtype(r: pb.ForwardRequest) -> None:
    r.boundary.dtype = 77  # type: ignore[assignment]  # an open enum takes any int32


def _negative_dtype(r: pb.ForwardRequest) -> None:
    r.boundary.dtype = -1  # type: ignore[assignment]


def _undefined_kind(r: pb.ForwardRequest) -> None:
    r.kind = 77  # type: ignore[assignment]


def _newline_session(r: pb.ForwardRequest) -> None:
    r.session_id = "s\n12:00:00.000 INFO    session=admin forged"


def _non_ascii_session(r: pb.ForwardRequest) -> None:
    r.session_id = "sé"


@pytest.mark.parametrize(
    "spoil",
    [
        _undefined_dtype,
        _negative_dtype,
        _undefined_kind,
        _newline_session,
        _non_ascii_session,
        _wrong_dtype,
        _wrong_shape,
        _short_bytes,
        _no_boundary,
        _gap_in_positions,
        _expected_pos_differs,
        _no_rows,
        _token_count,
        _empty_session,
        _long_session,
    ],
)
def test_malformed_frames_are_refused(spoil: Callable[[pb.ForwardRequest], None]) -> None:
    request = middle_request()
    spoil(request)
    with pytest.raises(FrameRejected) as info:
        F.decode_forward(request, mine(MIDDLE), MIDDLE)
    assert info.value.status == "DGR_E_FRAME"
    assert grpc_status_for(info.value) == (grpc.StatusCode.INVALID_ARGUMENT, "DGR_E_FRAME")


def test_first_stage_refuses_rows_and_needs_tokens() -> None:
    with_rows = F.encode_forward("s", 0, 0, mine(FIRST), [0], tokens=[1], boundary=rows(1))
    with pytest.raises(FrameRejected, match="token ids, not boundary"):
        F.decode_forward(with_rows, mine(FIRST), FIRST)
    no_tokens = F.encode_forward("s", 0, 0, mine(FIRST), [0, 1])
    with pytest.raises(FrameRejected, match="needs one per row"):
        F.decode_forward(no_tokens, mine(FIRST), FIRST)


def test_last_stage_refuses_bad_logit_rows() -> None:
    for bad in ([4], [2, 1], [1, 1]):
        request = F.encode_forward(
            "s", 0, 0, mine(LAST), range(4), boundary=rows(4), logit_rows=bad
        )
        with pytest.raises(FrameRejected, match="logit_rows"):
            F.decode_forward(request, mine(LAST), LAST)


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("schema_version", 2, "DGR_E_EXPECTATION_SCHEMA"),
        ("model_sha256", bytes(32), "DGR_E_EXPECTATION_MODEL"),
        ("model_sha256", b"", "DGR_E_EXPECTATION_MODEL"),
        ("layer_begin", 0, "DGR_E_EXPECTATION_RANGE"),
        ("layer_end", 4, "DGR_E_EXPECTATION_RANGE"),
        ("boundary_width", 65, "DGR_E_EXPECTATION_WIDTH"),
    ],
)
def test_frames_for_another_worker_are_refused(field: str, value: object, status: str) -> None:
    request = middle_request()
    setattr(request.expect, field, value)
    with pytest.raises(ExpectationMismatch) as info:
        F.decode_forward(request, mine(MIDDLE), MIDDLE)
    assert info.value.status == status
    assert grpc_status_for(info.value) == (grpc.StatusCode.INVALID_ARGUMENT, status)


# --- the status table --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (E.StaleEpoch("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (E.PositionMismatch("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (E.UnknownSession("x"), grpc.StatusCode.NOT_FOUND),
        (E.CapacityExceeded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (E.ContextFull("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (E.ShapeMismatch("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (E.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (E.DecodeError("x"), grpc.StatusCode.INTERNAL),
        (E.InternalError("x"), grpc.StatusCode.INTERNAL),
        (E.EngineClosed("x"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_engine_errors_map_to_conventional_codes(exc: Exception, code: grpc.StatusCode) -> None:
    got_code, status = grpc_status_for(exc)
    assert got_code == code
    back = error_from_rpc(got_code, status, "detail")
    if isinstance(exc, E.EngineError) and not isinstance(exc, E.EngineClosed):
        assert type(back) is type(exc) and back.status == exc.status


@pytest.mark.parametrize("status", sorted(known_statuses()))
def test_every_status_round_trips(status: str) -> None:
    cls = type(error_from_rpc(grpc.StatusCode.UNKNOWN, status, "d"))
    exc = cls("d", status=status)
    code, again = grpc_status_for(exc)
    assert again == status
    assert type(error_from_rpc(code, again, "d")) is cls


def test_codes_without_a_reason() -> None:
    assert isinstance(error_from_rpc(grpc.StatusCode.UNAVAILABLE, None, ""), ShardUnavailable)
    assert isinstance(error_from_rpc(grpc.StatusCode.UNAVAILABLE, None, ""), ConnectionError)
    late = error_from_rpc(grpc.StatusCode.DEADLINE_EXCEEDED, None, "")
    assert isinstance(late, ShardDeadlineExceeded) and isinstance(late, TimeoutError)
    big = error_from_rpc(
        grpc.StatusCode.RESOURCE_EXHAUSTED, None, "Received message larger than max (9 vs. 8)"
    )
    assert isinstance(big, FrameRejected) and big.status == "DGR_E_MESSAGE_SIZE"
    other = error_from_rpc(grpc.StatusCode.PERMISSION_DENIED, None, "no")
    assert isinstance(other, ShardRpcError) and other.status == "GRPC_PERMISSION_DENIED"


def test_a_stale_epoch_refusal_carries_the_held_epoch_in_its_trailers() -> None:
    # the message text is for people: the held epoch travels as its own trailer
    refused = E.StaleEpoch("not a parseable text", held_epoch=7)
    code, status = grpc_status_for(refused)
    trailers = refusal_trailers(refused, status)
    assert dict(trailers) == {"dgr-status": "DGR_E_STALE_EPOCH", "dgr-held-epoch": "7"}
    back = error_from_trailers(code, trailers, "not a parseable text")
    assert isinstance(back, E.StaleEpoch) and back.held_epoch == 7

    # as gRPC may hand them back (bytes values), and without the trailer: unknown
    def held(error: Exception) -> int | None:
        assert isinstance(error, E.StaleEpoch)
        return error.held_epoch

    assert held(error_from_trailers(code, [(k, v.encode()) for k, v in trailers], "d")) == 7
    assert held(error_from_trailers(code, trailers[:1], "d")) is None
    # only a stale-epoch refusal has one; a garbled trailer is ignored, not trusted
    assert refusal_trailers(E.UnknownSession("x"), "DGR_E_UNKNOWN_SESSION") == (
        ("dgr-status", "DGR_E_UNKNOWN_SESSION"),
    )
    garbled = (("dgr-status", "DGR_E_STALE_EPOCH"), ("dgr-held-epoch", "-1x"))
    assert held(error_from_trailers(code, garbled, "d")) is None


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_boundary_rows_are_refused_naming_the_first(bad: float) -> None:
    info = shard(1, 3, 64)
    boundary = np.ones((3, 64), dtype=np.float32)
    boundary[1, 5] = bad
    request = F.encode_forward("s", 1, 2, mine(info), range(5, 8), boundary=boundary)
    with pytest.raises(FrameRejected, match=r"non-finite values \(1; first at row 1, column 5"):
        F.decode_forward(request, mine(info), info)


@pytest.mark.parametrize(
    ("field", "value"), [("dtype", 77), ("dtype", -5), ("dtype", 2**31 - 1), ("kind", 4)]
)
def test_an_undefined_enum_value_is_named_with_the_values_it_may_take(
    field: str, value: int
) -> None:
    request = middle_request()
    if field == "dtype":
        request.boundary.dtype = value  # type: ignore[assignment]
    else:
        request.kind = value  # type: ignore[assignment]
    wire = pb.ForwardRequest.FromString(request.SerializeToString())  # as the worker gets it
    with pytest.raises(FrameRejected) as info:
        F.decode_forward(wire, mine(MIDDLE), MIDDLE)
    assert f"{field} {value} is not defined by schema 1" in str(info.value)
    assert "=1" in str(info.value)  # the defined values are listed
    assert not is_worker_fault(info.value)


@pytest.mark.parametrize("kind", ["", "prefill", "decode", "replay"])
def test_every_defined_kind_is_decoded(kind: str) -> None:
    request = F.encode_forward("s", 1, 2, mine(MIDDLE), [5], boundary=rows(1), kind=kind)
    frame = F.decode_forward(request, mine(MIDDLE), MIDDLE)
    assert frame.n_rows == 1
    assert F.ROW_KIND_NAMES.get(request.kind, "unspecified") == (kind or "unspecified")


def test_a_kind_that_is_no_forward_kind_is_refused_not_unspecified() -> None:
    with pytest.raises(ValueError, match="decod"):
        F.encode_forward("s", 1, 2, mine(MIDDLE), [5], boundary=rows(1), kind="decod")


def test_a_frame_is_built_once_from_the_sessions_forward_and_cut_in_parts() -> None:
    from dgr_session.testing import fixture_identity, forward_call, make_route

    stage = make_route(["a:1"], [], identity=fixture_identity(n_layer=2)).stages[0]
    plain = forward_call(stage, "s", 1, 4, range(3, 9), (1, 2, 3, 4, 5, 6))
    call = attrs.evolve(plain, drafts=2, kept_drafts=1, sampled=True)
    frame = F.Frame.of_call(call, mine(MIDDLE), session_secret=b"s" * 32, timeout=2.0)
    assert frame.positions.tolist() == list(range(3, 9)) and frame.kind is ForwardKind.DECODE
    assert list(frame.logit_rows or ()) == list(range(6))  # a verification pass: every row
    assert frame.sampled_tokens and frame.drafts == 2 and frame.kept_drafts == 1
    ahead, tail = frame.part(0, 4), frame.part(4)
    assert ahead.positions.tolist() == [3, 4, 5, 6] and ahead.no_logits and not ahead.drafts
    assert ahead.kept_drafts is None and not ahead.sampled_tokens and ahead.logit_rows is None
    assert tail.positions.tolist() == [7, 8] and tail.tokens is not None
    assert tail.tokens.tolist() == [5, 6] and list(tail.logit_rows or ()) == [0, 1]
    request = F.encode_frame(tail)
    assert (request.expected_next_pos, request.kind) == (7, pb.ROW_KIND_DECODE)
    assert request.session_secret == b"s" * 32 and request.timeout_ms == 2000


@pytest.mark.parametrize(
    ("exc", "fault"),
    [
        (E.DecodeError("x"), True),
        (E.InternalError("x"), True),
        (E.NonFiniteOutput("x"), True),
        (E.ShardDeadlineExceeded("x", status="DGR_E_DEADLINE"), False),  # the caller's budget
        (RuntimeError("a bug"), True),
        (ValueError("a bug"), True),
        (FrameRejected("x"), False),
        (ExpectationMismatch("x", status="DGR_E_EXPECTATION_MODEL"), False),
        (E.StaleEpoch("x"), False),
        (E.UnknownSession("x"), False),
        (E.PositionMismatch("x"), False),
        (E.ShapeMismatch("x"), False),
        (E.CapacityExceeded("x"), False),
        (E.GrantUnauthenticated("x"), False),
        (E.GrantDenied("x"), False),
        (E.EngineClosed("x"), False),
        (InvalidIdentifier("session id", "empty"), False),
    ],
)
def test_only_the_workers_own_faults_count_against_its_health(exc: Exception, fault: bool) -> None:
    assert is_worker_fault(exc) is fault


def test_an_invalid_identifier_is_a_malformed_frame_on_the_wire() -> None:
    exc = InvalidIdentifier("session id", "empty")
    assert grpc_status_for(exc) == (grpc.StatusCode.INVALID_ARGUMENT, "DGR_E_FRAME")
    with pytest.raises(FrameRejected, match="invalid session id: character"):
        F.check_session_id("a b")
