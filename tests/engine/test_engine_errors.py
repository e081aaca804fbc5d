"""Bad input gets a typed error with a clear message, and loses nothing.

After every refused call, a healthy session in the same engines continues exactly as the whole
model does (its next logits are asserted bit for bit), and the refused session, where it exists,
is where it was before the call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from dgr_engine import ShardEngine, _binding
from dgr_engine import errors as E
from dgr_engine.baseline.gguf_copy import copy_with
from dgr_engine.fixtures import converted
from dgr_engine.reference import InProcessRoute
from dgr_engine.status import STATUSES, error_for_code
from dgr_engine.testing import write_corrupt_copy, write_truncated_copy
from dgr_session import errors as session_errors
from dgr_session.faults import FaultKind
from dgr_session.manager import fault_kind

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
KW = {"max_sessions": 3, "n_ctx_per_session": 256, "n_batch": 32}


class Harness:
    """A 2-stage chain with a healthy session (id 1) that must keep matching the whole model."""

    def __init__(self, path: Path) -> None:
        self.first = ShardEngine(path, layers=(0, 2), **KW)
        self.last = ShardEngine(path, layers=(2, 4), **KW)
        self.chain = InProcessRoute([self.first, self.last])
        whole = ShardEngine(path, **KW)
        ref_chain = InProcessRoute([whole])
        ref_chain.open(1, 0)
        self.ref_tokens, self.ref_logits = ref_chain.greedy(1, 0, PROMPT, 24)
        whole.close()
        self.chain.open(1, 0)
        self.chain.forward(1, 0, PROMPT, 0)
        self.steps = 0

    def healthy_session_continues(self) -> None:
        """One more decode step of session 1 equals the whole model's."""
        token = self.ref_tokens[self.steps]
        got = self.chain.forward(1, 0, [token], len(PROMPT) + self.steps)
        self.steps += 1
        assert np.array_equal(got, self.ref_logits[self.steps])

    def close(self) -> None:
        self.first.close()
        self.last.close()


@pytest.fixture()
def h(tiny_llama: Path) -> Iterator[Harness]:
    harness = Harness(tiny_llama)
    yield harness
    harness.close()


def refused(
    h: Harness, exc: type[E.EngineError], call: Callable[[], object], match: str
) -> E.EngineError:
    with pytest.raises(exc, match=match) as info:
        call()
    h.healthy_session_continues()
    return info.value


def boundary_rows(h: Harness, n: int, start: int) -> np.ndarray:
    h.first.open_session(2, 0)
    rows = h.first.forward(2, 0, np.arange(start, start + n), tokens=PROMPT[:n])
    h.first.close_session(2, 0)
    return rows


def test_wrong_row_width(h: Harness) -> None:
    h.last.open_session(5, 0)
    rows = np.zeros((2, 63), dtype=np.float32)
    err = refused(h, E.ShapeMismatch, lambda: h.last.forward(5, 0, [0, 1], rows=rows), "width 63")
    assert err.status == "DGR_E_SHAPE" and isinstance(err, ValueError)
    assert h.last.next_pos(5, 0) == 0


def test_missing_boundary_rows_on_a_later_stage(h: Harness) -> None:
    h.last.open_session(5, 0)
    refused(h, E.ShapeMismatch, lambda: h.last.forward(5, 0, [0], tokens=[1]), "boundary rows")
    assert h.last.next_pos(5, 0) == 0


def test_rows_given_to_the_first_stage(h: Harness) -> None:
    h.first.open_session(5, 0)
    rows = np.zeros((1, 64), dtype=np.float32)
    refused(h, E.ShapeMismatch, lambda: h.first.forward(5, 0, [0], rows=rows), "token ids")


def test_positions_that_do_not_continue_the_kv(h: Harness) -> None:
    h.first.open_session(5, 0)
    h.first.forward(5, 0, [0, 1, 2], tokens=[1, 2, 3])
    refused(h, E.PositionMismatch, lambda: h.first.forward(5, 0, [0], tokens=[4]), "continues at 3")
    refused(h, E.PositionMismatch, lambda: h.first.forward(5, 0, [4], tokens=[4]), "continues at 3")
    refused(
        h,
        E.PositionMismatch,
        lambda: h.first.forward(5, 0, [3, 5], tokens=[4, 5]),
        "continues at 4",
    )
    assert h.first.next_pos(5, 0) == 3
    h.first.forward(5, 0, [3], tokens=[4])  # the session itself lives on
    assert h.first.next_pos(5, 0) == 4


def test_unknown_session(h: Harness) -> None:
    refused(h, E.UnknownSession, lambda: h.first.forward(77, 0, [0], tokens=[1]), "unknown session")
    refused(h, E.UnknownSession, lambda: h.first.close_session(77, 0), "unknown session 77")


def test_epoch_not_opened_yet(h: Harness) -> None:
    refused(h, E.UnknownSession, lambda: h.first.forward(1, 3, [0], tokens=[1]), "not open")


def test_stale_epoch(h: Harness) -> None:
    h.first.open_session(6, 0)
    h.first.forward(6, 0, [0, 1], tokens=[1, 2])
    h.first.open_session(6, 2)  # route change: cache miss, epoch 2 starts empty
    assert h.first.next_pos(6, 2) == 0
    err = refused(
        h, E.StaleEpoch, lambda: h.first.forward(6, 0, [2], tokens=[3]), "epoch 0 is stale"
    )
    assert err.code == 6
    assert isinstance(err, E.StaleEpoch) and err.held_epoch == 2  # the epoch the engine holds
    refused(h, E.StaleEpoch, lambda: h.first.open_session(6, 1), "stale")
    refused(h, E.StaleEpoch, lambda: h.first.close_session(6, 1), "stale")
    assert h.first.next_pos(6, 2) == 0
    h.first.open_session(6, 2)  # the same epoch again changes nothing
    h.first.forward(6, 2, [0], tokens=[1])


def test_a_stale_epoch_refusal_carries_the_epoch_the_engine_holds(h: Harness) -> None:
    h.first.open_session(8, 5)
    calls = {
        "open": lambda: h.first.open_session(8, 3),
        "forward": lambda: h.first.forward(8, 3, [0], tokens=[1]),
        "close": lambda: h.first.close_session(8, 3),
    }
    for name, call in calls.items():
        err = refused(h, E.StaleEpoch, call, "epoch 3 is stale")
        assert isinstance(err, E.StaleEpoch) and err.held_epoch == 5, name
        assert isinstance(err, session_errors.StaleEpoch)  # one concept, one class to catch
        assert err.fault_kind is FaultKind.PROTOCOL


def test_the_held_epoch_accessor_names_only_a_stale_epoch_failure(h: Harness) -> None:
    lib = _binding.lib
    h.first.open_session(9, 4)
    with pytest.raises(E.StaleEpoch):
        h.first.open_session(9, 2)
    assert int(lib.dgr_last_held_epoch()) == 4
    with pytest.raises(E.UnknownSession):  # another failure on this thread: no held epoch
        h.first.close_session(78, 0)
    assert int(lib.dgr_last_held_epoch()) == -1
    with pytest.raises(E.StaleEpoch):
        h.first.open_session(9, 2)
    h.first.open_session(9, 4)  # a success clears it too
    assert int(lib.dgr_last_held_epoch()) == -1


def test_the_held_epoch_is_never_read_from_the_message() -> None:
    text = "session 1: epoch 3 is stale (current epoch 9)"
    err = error_for_code(6, text)
    assert isinstance(err, E.StaleEpoch) and err.held_epoch is None
    err = error_for_code(6, text, held_epoch=-1)  # the C "unknown"
    assert isinstance(err, E.StaleEpoch) and err.held_epoch is None
    err = error_for_code(6, "no number here", held_epoch=7)
    assert isinstance(err, E.StaleEpoch) and err.held_epoch == 7


def test_more_sessions_than_allowed(h: Harness) -> None:
    h.first.open_session(20, 0)
    h.first.open_session(21, 0)
    refused(h, E.CapacityExceeded, lambda: h.first.open_session(22, 0), "no free session slot")
    h.first.close_session(20, 0)
    h.first.open_session(22, 0)  # a freed slot is reusable and starts empty
    assert h.first.next_pos(22, 0) == 0
    assert h.first.stats().open_sessions == 3


def test_token_ids_outside_the_vocabulary(h: Harness) -> None:
    h.first.open_session(5, 0)
    refused(h, E.InvalidArgument, lambda: h.first.forward(5, 0, [0], tokens=[256]), "vocabulary")
    refused(h, E.InvalidArgument, lambda: h.first.forward(5, 0, [0], tokens=[-1]), "vocabulary")


def test_too_many_rows_and_full_context(h: Harness) -> None:
    h.first.open_session(5, 0)
    refused(
        h,
        E.ShapeMismatch,
        lambda: h.first.forward(5, 0, np.arange(33), tokens=np.ones(33)),
        "exceed n_batch",
    )
    ctx = h.first.info.n_ctx_per_session
    for start in range(0, ctx, 32):
        h.first.forward(5, 0, np.arange(start, start + 32), tokens=np.ones(32))
    refused(h, E.ContextFull, lambda: h.first.forward(5, 0, [ctx], tokens=[1]), "context")


def test_bad_saved_state(h: Harness, tiny_llama: Path) -> None:
    h.last.open_session(5, 0)
    h.last.forward(5, 0, [0, 1], rows=boundary_rows(h, 2, 0))
    state = h.last.save_state(5, 0)
    refused(h, E.StateError, lambda: h.last.load_state(5, 0, b"XXXX" + state[4:]), "not a dgr")
    refused(h, E.StateError, lambda: h.first.load_state(1, 0, state), "layers")
    refused(h, E.StateError, lambda: h.last.load_state(5, 0, state[:-3]), "truncated")
    assert h.last.next_pos(5, 0) == 2


def test_closed_engine_is_refused(tiny_llama: Path) -> None:
    engine = ShardEngine(tiny_llama, layers=(0, 1), **KW)
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(E.EngineClosed):
        engine.open_session(1, 0)


@pytest.mark.parametrize(
    ("layers", "match"),
    [((0, 5), r"\[0, 5\)"), ((2, 2), "non-empty"), ((-1, 2), "inside"), ((3, 1), "range")],
)
def test_layer_range_out_of_bounds(h: Harness, tiny_llama: Path, layers, match) -> None:
    refused(h, E.LayerRangeError, lambda: ShardEngine(tiny_llama, layers=layers, **KW), match)


def test_truncated_gguf(h: Harness, tiny_llama: Path, tmp_path: Path) -> None:
    for fraction in (0.5, 0.999):
        bad = write_truncated_copy(tiny_llama, tmp_path / f"t{fraction}.gguf", fraction)
        refused(h, E.ModelLoadError, lambda b=bad: ShardEngine(b, **KW), "load|read")
    tiny_head = write_truncated_copy(tiny_llama, tmp_path / "head.gguf", 0.0005)
    refused(h, E.ModelLoadError, lambda: ShardEngine(tiny_head, **KW), "truncated or corrupt")


def test_corrupt_gguf(h: Harness, tiny_llama: Path, tmp_path: Path) -> None:
    bad = write_corrupt_copy(tiny_llama, tmp_path / "corrupt.gguf")
    err = refused(h, E.ModelLoadError, lambda: ShardEngine(bad, **KW), "corrupt")
    assert isinstance(err, OSError)


def test_missing_gguf(h: Harness, tmp_path: Path) -> None:
    refused(h, E.ModelLoadError, lambda: ShardEngine(tmp_path / "nope.gguf", **KW), "nope.gguf")


def test_architecture_not_covered(h: Harness, tiny_smollm3: Path) -> None:
    err = refused(
        h,
        E.UnsupportedArchitecture,
        lambda: ShardEngine(tiny_smollm3, **KW),
        "'smollm3' is not covered",
    )
    # the covered list: the base stack's architectures, then the family patches'
    assert "(supported: llama, deepseek4, gemma3, phi3, qwen2, qwen3)" in str(err)


def test_a_gguf_missing_a_key_its_family_needs_is_refused_naming_the_key(
    h: Harness, tmp_path: Path
) -> None:
    """Gemma 3's builder needs its RMS-norm epsilon; without it llama.cpp logs why first and
    that the load failed last: the refusal is one line and says both."""
    whole = converted.ensure_converted("hf-gemma3-swa").gguf
    broken = copy_with(
        whole, tmp_path / "no-eps.gguf", {}, without=("gemma3.attention.layer_norm_rms_epsilon",)
    )
    err = refused(
        h,
        E.ModelLoadError,
        lambda: ShardEngine(broken, layers=(0, 3), **KW),
        "key not found in model: gemma3.attention.layer_norm_rms_epsilon",
    )
    assert "\n" not in str(err) and "failed to load model" in str(err)
    with ShardEngine(whole, layers=(0, 3), **KW) as intact:  # nothing half-loaded stays behind
        assert intact.info.layers == (0, 3)


def test_mtp_of_a_model_without_an_mtp_block_is_refused(h: Harness, tiny_llama: Path) -> None:
    load = lambda: ShardEngine(tiny_llama, load_mtp=True, **KW)  # noqa: E731
    refused(h, E.UnsupportedFeature, load, "has no MTP block")
    assert h.last.info.mtp_owner and not h.first.info.mtp_owner


def test_invalid_engine_parameters(h: Harness, tiny_llama: Path) -> None:
    refused(h, E.InvalidArgument, lambda: ShardEngine(tiny_llama, max_sessions=0), "max_sessions")
    refused(h, E.InvalidArgument, lambda: ShardEngine(tiny_llama, n_threads=0), "positive")


def test_error_table_is_complete() -> None:
    engine = {r.error.code for r in STATUSES.values() if r.c_code is not None and r.c_code < 15}
    assert engine == set(range(1, 15))  # each of the engine's own codes has its class
    err = error_for_code(99, "odd")
    assert type(err) is E.EngineError


NOT_ENGINE_ERROR = {
    E.StaleEpoch: FaultKind.PROTOCOL,
    E.ShardUnavailable: FaultKind.DEAD,
    E.EngineClosed: FaultKind.DEAD,
    E.ModelLoadError: FaultKind.DEAD,  # an OSError, as the manager filed it before
    E.ShardDeadlineExceeded: FaultKind.DEADLINE,
    E.UnknownSession: FaultKind.STATE_LOST,  # a cache miss on a healthy stage
    E.CapacityExceeded: FaultKind.BUSY,  # load, not a fault
    E.GrantUnauthenticated: FaultKind.PROTOCOL,  # the route's grants are wrong, not the stage
    E.GrantDenied: FaultKind.PROTOCOL,
    E.ClientCallError: FaultKind.CLIENT,  # the client's own failure: no stage to blame
    E.InvalidArgument: FaultKind.BAD_REQUEST,  # any route would refuse the request the same way
}

REFUSALS = 21  # EngineError, 14 C statuses, NonFiniteOutput, EngineClosed, 4 of the worker
TRANSPORT = 5  # ShardTransportError, unavailable, deadline, RPC error, the client's own


def shard_errors() -> list[type[E.ShardError]]:
    return [c for c in vars(E).values() if isinstance(c, type) and issubclass(c, E.ShardError)]


def test_each_engine_error_declares_its_fault_kind() -> None:
    classes = shard_errors()
    assert len(classes) == 1 + REFUSALS + TRANSPORT  # ShardError and its two branches
    for cls in classes:
        kind = NOT_ENGINE_ERROR.get(cls, FaultKind.ENGINE_ERROR)
        assert cls.fault_kind is kind, cls
        assert fault_kind(cls("x")) is kind, cls
    # one concept each: the session layer catches the engine's errors by its own classes
    assert issubclass(E.ShardUnavailable, session_errors.StageDead)
    assert issubclass(E.ShardUnavailable, ConnectionError)
    assert issubclass(E.StaleEpoch, session_errors.StaleEpoch)
    assert issubclass(E.ShardDeadlineExceeded, TimeoutError)


def test_a_shard_error_is_a_refusal_or_a_transport_failure_never_both() -> None:
    refusals = [c for c in shard_errors() if issubclass(c, E.EngineError)]
    transport = [c for c in shard_errors() if issubclass(c, E.ShardTransportError)]
    assert len(refusals) == REFUSALS and len(transport) == TRANSPORT
    assert not set(refusals) & set(transport)
    assert set(refusals) | set(transport) | {E.ShardError} == set(shard_errors())
    # an unreachable, slow or out-of-protocol worker, or the client's own failure, is no refusal
    for cls in (E.ShardUnavailable, E.ShardDeadlineExceeded, E.ShardRpcError, E.ClientCallError):
        assert cls in transport and not issubclass(cls, E.EngineError), cls
        with pytest.raises(E.ShardTransportError):
            raise cls("x")
    # every class the C status table maps to is a refusal, and so is every worker refusal
    engine_codes = [r.error for r in STATUSES.values() if r.c_code is not None and r.c_code < 15]
    assert all(issubclass(cls, E.EngineError) for cls in engine_codes)
    for cls in (E.FrameRejected, E.ExpectationMismatch, E.GrantDenied, E.NonFiniteOutput):
        assert cls in refusals and not issubclass(cls, E.ShardTransportError), cls
    # a transport failure carries a status and no C status
    late = E.ShardDeadlineExceeded("x", status="GRPC_DEADLINE_EXCEEDED")
    assert late.status == "GRPC_DEADLINE_EXCEEDED" and not hasattr(late, "code")


def test_one_stale_epoch_for_the_control_plane_and_the_engine() -> None:
    import dgr_session

    assert E.StaleEpoch is session_errors.StaleEpoch is dgr_session.StaleEpoch
    assert [n for n, c in vars(E).items() if c is E.StaleEpoch] == ["StaleEpoch"]
    assert E.EngineError is session_errors.EngineError and E.ShardError is session_errors.ShardError
    stale = error_for_code(6, "epoch 1 is stale", held_epoch=4)
    assert type(stale) is dgr_session.StaleEpoch and stale.held_epoch == 4
    assert (stale.code, stale.status) == (6, "DGR_E_STALE_EPOCH")
    assert stale.fault_kind is FaultKind.PROTOCOL
    # what the control plane raises is the engine's refusal too: one except catches both
    made_here = dgr_session.StaleEpoch("old", session_id="s", epoch=1, held_epoch=2)
    assert isinstance(made_here, E.EngineError) and made_here.code == 6
    # and no module of either plane defines another class of that name
    root = Path(session_errors.__file__).resolve().parents[1]  # the checkout, wherever tests are
    defined = [
        str(path.relative_to(root))
        for package in ("dgr_session", "dgr_engine")
        for path in sorted((root / package).rglob("*.py"))
        if "class StaleEpoch(" in path.read_text(encoding="utf-8")
    ]
    assert defined == ["dgr_session/errors.py"]


def test_the_wire_raises_a_refusal_as_an_engine_error_and_no_answer_as_a_transport_error() -> None:
    import grpc

    from dgr_engine.wire.status import error_from_rpc, grpc_status_for, known_statuses

    no_answer = {"DGR_E_DEADLINE", "DGR_E_SHUTTING_DOWN", "DGR_E_UNAVAILABLE", "DGR_E_LINK_LOST"}
    for status in known_statuses():
        error = error_from_rpc(grpc.StatusCode.UNKNOWN, status, "d")
        branch = E.ShardTransportError if status in no_answer else E.EngineError
        assert isinstance(error, branch) and error.status == status, status
        assert grpc_status_for(error)[1] == status, status  # the worker sends either branch
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        unreachable = error_from_rpc(code, None, "connection refused")
        assert isinstance(unreachable, E.ShardTransportError), code
        assert not isinstance(unreachable, E.EngineError), code
    with pytest.raises(E.ShardUnavailable):  # `except EngineError` no longer catches it
        try:
            raise error_from_rpc(grpc.StatusCode.UNAVAILABLE, None, "gone")
        except E.EngineError:
            pytest.fail("an unreachable worker was caught as a refusal")
