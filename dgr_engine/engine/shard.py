"""``ShardEngine``: one layer range of one GGUF model, run in the patched llama.cpp.

A thin, typed wrapper over the C ABI (``native/include/dgr_shard.h``): numpy arrays go in and come
out through ``ffi.from_buffer`` without extra copies, every failing call raises the typed
exception of ``dgr_engine.errors`` for its status, and each handle has its own lock (cffi releases
the GIL around native calls). Use it as a context manager or call ``close()``; garbage collection
frees a forgotten handle only as a safety net.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from dgr_engine._binding import check_status, ffi, lib
from dgr_engine.engine.native_link import (
    DEFAULT_BODY_TIMEOUT,
    LinkSockets,
    NativeLink,
)
from dgr_engine.errors import EngineClosed, EngineError
from dgr_engine.numerics import Numerics
from dgr_engine.status import error_for_code
from dgr_session.sampling import GREEDY, Sampling


@attrs.frozen
class ShardInfo:
    """What one shard engine is: its range, widths and capacity."""

    arch: str
    """``general.architecture`` of the GGUF."""
    n_layer: int
    """Main layers of the whole model."""
    layer_begin: int
    """First owned layer."""
    layer_end: int
    """One past the last owned layer."""
    n_embd: int
    """Model width."""
    n_vocab: int
    """Vocabulary size (the logits width of the last shard)."""
    in_width: int
    """Floats per input boundary row; 0 on the first shard (it takes token ids)."""
    out_width: int
    """Floats per output row: the boundary width, or ``n_vocab`` on the last shard."""
    is_first: bool
    """Takes token ids."""
    is_last: bool
    """Produces logits."""
    needs_token_ids: bool
    """Rows must carry token ids."""
    mtp_owner: bool
    """Owns the MTP/nextn layers (the last shard); they are loaded with ``load_mtp`` only."""
    max_sessions: int
    """Concurrent sessions."""
    n_ctx_per_session: int
    """KV cells per session."""
    n_batch: int
    """Most rows one forward call may carry."""

    @property
    def layers(self) -> tuple[int, int]:
        """The owned range ``[begin, end)``."""
        return (self.layer_begin, self.layer_end)


@attrs.frozen
class EngineStats:
    """Memory and work counters of one engine (process-wide figures for RSS)."""

    weight_bytes: int
    """Model buffers held by this engine."""
    kv_bytes: int
    """KV / memory buffers."""
    compute_bytes: int
    """Compute buffers."""
    rss_bytes: int
    """Process resident set now."""
    peak_rss_bytes: int
    """Process peak resident set."""
    open_sessions: int
    """Sessions open now."""
    rows_forwarded: int
    """Rows run through the owned layers."""
    forward_calls: int
    """Successful forward calls."""
    forward_seconds: float
    """Wall time spent in successful forward calls."""


FloatArray = npt.NDArray[np.float32]


@attrs.frozen
class ForwardItem:
    """One session's rows in :meth:`ShardEngine.forward_batch` (the arguments of
    :meth:`ShardEngine.forward`)."""

    session_id: int
    epoch: int
    positions: npt.ArrayLike
    tokens: npt.ArrayLike | None = None
    rows: npt.ArrayLike | None = None
    want: npt.ArrayLike | None = None


@attrs.frozen
class _Prepared:
    """A forward item's arrays as the ABI takes them, and its output buffer."""

    session_id: int
    epoch: int
    n: int
    positions: npt.NDArray[np.int32]
    tokens: npt.NDArray[np.int32] | None
    rows: FloatArray | None
    row_width: int
    want: npt.NDArray[np.uint8] | None
    out: FloatArray

    def result(self, n_written: int, width: int) -> FloatArray:
        """The rows the call wrote."""
        return self.out.reshape(-1)[: n_written * width].reshape(n_written, width)


class ShardEngine:
    """One process's share of a model: layers ``[begin, end)`` of a GGUF file.

    Sessions are keyed by ``(session_id, epoch)``; opening a newer epoch discards the older
    epoch's state (cache miss), an older epoch raises ``StaleEpoch``. Positions must continue the
    session's KV exactly. Not safe to share across threads without the built-in lock: every public
    method takes it.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        layers: tuple[int, int] | None = None,
        max_sessions: int = 4,
        n_ctx_per_session: int = 512,
        n_threads: int = 2,
        n_batch: int = 512,
        n_ubatch: int = 512,
        load_mtp: bool = False,
        numerics: Numerics | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._links: weakref.WeakSet[NativeLink] = weakref.WeakSet()
        self._co_batches: dict[int, Any] = {}
        """The native links' co-batching groups, by their rows a call (freed after the links)."""
        self.native_ns = 0
        """Nanoseconds spent inside llama.cpp by :meth:`forward` and :meth:`forward_batch`,
        summed over the engine's life (what a caller's timing of a call has beyond it is
        Python: the arguments, the result, the checks)."""
        self.model_path = Path(model_path)
        self.numerics = numerics if numerics is not None else Numerics()
        """KV cache type and flash-attention mode (default: llama.cpp's)."""
        params = lib.dgr_engine_default_params()
        path_c = ffi.new("char[]", str(self.model_path).encode())
        params.model_path = path_c
        if layers is not None:
            params.layer_begin, params.layer_end = layers
        params.max_sessions = max_sessions
        params.n_ctx_per_session = n_ctx_per_session
        params.n_threads = n_threads
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch
        params.load_mtp = 1 if load_mtp else 0
        params.kv_type = self.numerics.abi_kv_type
        params.flash_attn = self.numerics.abi_flash_attn
        out = ffi.new("dgr_engine **")
        self._check(lib.dgr_engine_open(ffi.addressof(params), out))
        self._handle: Any = ffi.gc(out[0], lib.dgr_engine_free)
        self.info = self._read_info()
        self.mtp_loaded = load_mtp
        """The engine loaded the MTP block and drafts with it (:meth:`mtp_draft`)."""

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Ends the engine's native links, then frees the engine and every session's state.
        Idempotent."""
        for link in list(self._links):
            link.close()
        with self._lock:
            for group in self._co_batches.values():
                lib.dgr_link_batch_free(group)
            self._co_batches.clear()
            if self._handle is not None:
                ffi.release(self._handle)
                self._handle = None

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __enter__(self) -> ShardEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<ShardEngine {self.model_path.name} layers={self.info.layers} {state}>"

    # -- introspection ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Memory and work counters now."""
        s = ffi.new("dgr_engine_stats *")
        with self._lock:
            self._check(lib.dgr_engine_stats_get(self._live(), s))
        return EngineStats(
            weight_bytes=int(s.weight_bytes),
            kv_bytes=int(s.kv_bytes),
            compute_bytes=int(s.compute_bytes),
            rss_bytes=int(s.rss_bytes),
            peak_rss_bytes=int(s.peak_rss_bytes),
            open_sessions=int(s.open_sessions),
            rows_forwarded=int(s.rows_forwarded),
            forward_calls=int(s.forward_calls),
            forward_seconds=int(s.forward_ns) / 1e9,
        )

    # -- sessions --------------------------------------------------------------------------

    def open_session(self, session_id: int, epoch: int) -> None:
        """Opens ``(session_id, epoch)``; a newer epoch discards the older epoch's state."""
        with self._lock:
            self._check(lib.dgr_session_open(self._live(), session_id, epoch))

    def close_session(self, session_id: int, epoch: int) -> None:
        """Closes the session and frees its state and slot."""
        with self._lock:
            self._check(lib.dgr_session_close(self._live(), session_id, epoch))

    def start_link(
        self,
        session_id: int,
        epoch: int,
        *,
        hop: int,
        sockets: LinkSockets,
        max_rows: int | None = None,
        notify_fd: int = -1,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        frames_per_second: float | None = None,
        burst: int = 8,
        co_batch_rows: int | None = None,
        sampling: Sampling = GREEDY,
    ) -> NativeLink:
        """Starts a native link of the open ``(session_id, epoch)`` (``native_link.py``): the
        frames coming on ``sockets`` run on this engine's own thread and go on with no Python
        per frame. The link owns the sockets once started; :meth:`close` ends it first.
        ``frames_per_second``: the session's frame budget (a bucket of ``burst``): a frame over
        it waits in the link for its turn. ``co_batch_rows``: the link's frames co-batch with
        those of the engine's other links started so (a call of at most that many rows:
        ``worker/engine_access/co_batch.py``'s rule), each frame runs alone when ``None``.
        ``sampling``: how a last stage takes each frame's token (``docs/sampling.md``)."""
        with self._lock:
            group = ffi.NULL
            if co_batch_rows is not None:
                group = self._co_batches.get(co_batch_rows)
                if group is None:
                    made = ffi.new("dgr_link_batch **")
                    self._check(lib.dgr_link_batch_new(self._live(), co_batch_rows, made))
                    group = self._co_batches[co_batch_rows] = made[0]
            link = NativeLink(
                self._live(),
                session_id,
                epoch,
                hop=hop,
                sockets=sockets,
                max_rows=self.info.n_batch if max_rows is None else max_rows,
                notify_fd=notify_fd,
                body_timeout=body_timeout,
                frames_per_second=frames_per_second,
                burst=burst,
                co_batch=group,
                sampling=sampling,
            )
        self._links.add(link)
        return link

    def co_batch_stats(self) -> tuple[int, int]:
        """The native links' co-batching so far: engine calls made, frames they ran."""
        calls, frames = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        total = [0, 0]
        with self._lock:
            for group in self._co_batches.values():
                check_status(lib.dgr_link_batch_get_stats(group, calls, frames))
                total[0] += int(calls[0])
                total[1] += int(frames[0])
        return total[0], total[1]

    def next_pos(self, session_id: int, epoch: int) -> int:
        """The position the session's next row must carry."""
        out = ffi.new("int32_t *")
        with self._lock:
            self._check(lib.dgr_session_next_pos(self._live(), session_id, epoch, out))
        return int(out[0])

    def truncate(self, session_id: int, epoch: int, n_keep: int) -> None:
        """Keeps the first ``n_keep`` positions of the session. DeepSeek V4 drops at most
        ``DGR_V4_ROLLBACK_ROWS`` rows of the session's last forward call, once (the rejected
        drafts of a verification pass); deeper is ``UnsupportedFeature``, nothing changed
        (``docs/speculative.md``)."""
        with self._lock:
            self._check(lib.dgr_session_truncate(self._live(), session_id, epoch, n_keep))

    def mtp_draft(
        self, session_id: int, epoch: int, last_token: int, k: int, *, n_keep: int | None = None
    ) -> list[int]:
        """Greedy drafts of the MTP block (an engine opened with ``load_mtp``): the ``k`` tokens
        after ``last_token``, the token at the session's next position (the one its last
        forward's logits gave), fewer where the session's context ends. Changes nothing in the
        session. ``UnsupportedFeature`` without an MTP block or when the session's MTP inputs
        were lost (a state load, a truncation before its last forward).

        With ``n_keep`` (``1 <= n_keep <= next_pos``) it drafts as from position ``n_keep``
        (``last_token`` is the token there): the MTP block first drops its own rows from
        ``n_keep`` (never the session's main KV), so a verification pass's last stage drafts
        for the kept position before the next frame's :meth:`truncate` to the same ``n_keep``.
        ``n_keep`` outside ``[1, next_pos]`` is ``PositionError``; before the rows of the last
        forward call ``UnsupportedFeature``; both with nothing changed."""
        if k < 0:
            raise error_for_code(int(lib.DGR_E_INVALID_ARGUMENT), f"draft length {k} is negative")
        out = ffi.new("int32_t[]", max(k, 1))
        n_out = ffi.new("uint32_t *")
        with self._lock:
            if n_keep is None:
                code = lib.dgr_session_mtp_draft(
                    self._live(), session_id, epoch, last_token, k, out, n_out
                )
            else:
                code = lib.dgr_session_mtp_draft_from(
                    self._live(), session_id, epoch, n_keep, last_token, k, out, n_out
                )
            self._check(code)
        return [int(out[i]) for i in range(int(n_out[0]))]

    def forward(
        self,
        session_id: int,
        epoch: int,
        positions: npt.ArrayLike,
        *,
        tokens: npt.ArrayLike | None = None,
        rows: npt.ArrayLike | None = None,
        want: npt.ArrayLike | None = None,
        out: FloatArray | None = None,
    ) -> FloatArray:
        """Runs rows through the owned layers and returns the output rows.

        ``tokens`` (int32) feed the first shard; ``rows`` (float32, ``[n, in_width]``) feed the
        others. The result is ``[n, out_width]`` boundary rows, or on the last shard the logits
        of the rows flagged in ``want`` (default: the last row only), ``[n_out, n_vocab]``.
        """
        item = self._prepare(ForwardItem(session_id, epoch, positions, tokens, rows, want), out)
        n_written = ffi.new("uint32_t *")
        args = (
            session_id,
            epoch,
            item.n,
            ffi.NULL if item.tokens is None else ffi.from_buffer("int32_t[]", item.tokens),
            ffi.NULL if item.rows is None else ffi.from_buffer("float[]", item.rows),
            item.row_width,
            ffi.from_buffer("int32_t[]", item.positions),
            ffi.NULL if item.want is None else ffi.from_buffer("uint8_t[]", item.want),
            ffi.from_buffer("float[]", item.out, require_writable=True),
            item.out.size,
            n_written,
        )
        with self._lock:
            began = time.perf_counter_ns()
            code = lib.dgr_session_forward(self._live(), *args)
            self.native_ns += time.perf_counter_ns() - began
            self._check(code)
        return item.result(int(n_written[0]), self.info.out_width)

    def forward_batch(self, items: Sequence[ForwardItem]) -> list[FloatArray | EngineError]:
        """Runs several sessions' rows in one engine call (``dgr_forward_batch``: neighbouring
        sessions share a ``llama_decode`` carrying one sequence each, while under 32 rows
        together), each item as :meth:`forward` would run it alone; returns, in item order,
        each item's output rows or the typed error it was refused with (the other items still
        ran). The items' rows together must fit ``n_batch`` (``DGR_E_SHAPE`` is raised, nothing
        ran). Each item's rows have the bits they have when run alone (patch 0010;
        ``docs/worker.md``, co-batching)."""
        prepared: list[_Prepared | EngineError] = []
        for item in items:
            try:
                prepared.append(self._prepare(item, None))
            except EngineError as exc:
                prepared.append(exc)
        ready = [p for p in prepared if isinstance(p, _Prepared)]
        c_items = ffi.new("dgr_forward_item[]", len(ready))
        buffers: list[Any] = []  # keeps every buffer alive across the call
        for c, p in zip(c_items, ready, strict=True):
            c.session_id = p.session_id
            c.epoch = p.epoch
            c.n_rows = p.n
            if p.tokens is not None:
                buffers.append(ffi.from_buffer("int32_t[]", p.tokens))
                c.tokens = buffers[-1]
            if p.rows is not None:
                buffers.append(ffi.from_buffer("float[]", p.rows))
                c.rows = buffers[-1]
            c.row_width = p.row_width
            buffers.append(ffi.from_buffer("int32_t[]", p.positions))
            c.positions = buffers[-1]
            if p.want is not None:
                buffers.append(ffi.from_buffer("uint8_t[]", p.want))
                c.want = buffers[-1]
            buffers.append(ffi.from_buffer("float[]", p.out, require_writable=True))
            c.out = buffers[-1]
            c.out_capacity = p.out.size
        if ready:
            with self._lock:
                began = time.perf_counter_ns()
                code = lib.dgr_forward_batch(self._live(), c_items, len(ready))
                self.native_ns += time.perf_counter_ns() - began
                self._check(code)
        results: list[FloatArray | EngineError] = []
        outcomes = iter(zip(c_items, ready, strict=True))
        width = self.info.out_width
        for entry in prepared:
            if not isinstance(entry, _Prepared):
                results.append(entry)
                continue
            c, done = next(outcomes)
            if c.status != 0:
                message = ffi.string(c.error).decode(errors="replace")
                error = error_for_code(int(c.status), message, held_epoch=int(c.held_epoch))
                assert isinstance(error, EngineError)  # an item's statuses are the engine's
                results.append(error)
            else:
                results.append(done.result(int(c.n_out), width))
        return results

    def _prepare(self, item: ForwardItem, out: FloatArray | None) -> _Prepared:
        """``item``'s arrays, contiguous and of the ABI's types, with its output buffer;
        ``DGR_E_SHAPE`` for shapes that do not agree."""
        pos = np.ascontiguousarray(item.positions, dtype=np.int32).reshape(-1)
        n = int(pos.shape[0])
        tok = item.tokens
        if tok is not None:
            tok = np.ascontiguousarray(tok, dtype=np.int32).reshape(-1)
            if tok.shape[0] != n:
                raise error_for_code(
                    int(lib.DGR_E_SHAPE), f"{tok.shape[0]} token ids for {n} positions"
                )
        row_width = 0
        inp = None
        if item.rows is not None:
            inp = np.ascontiguousarray(item.rows, dtype=np.float32)
            if inp.ndim != 2 or inp.shape[0] != n:
                raise error_for_code(
                    int(lib.DGR_E_SHAPE),
                    f"rows of shape {inp.shape} for {n} positions: need [n, width]",
                )
            row_width = int(inp.shape[1])
        want_arr = None
        n_out = n
        if self.info.is_last:
            if item.want is None:
                n_out = 1 if n > 0 else 0
            else:
                want_arr = np.ascontiguousarray(item.want, dtype=np.uint8).reshape(-1)
                if want_arr.shape[0] != n:
                    raise error_for_code(
                        int(lib.DGR_E_SHAPE), f"{want_arr.shape[0]} flags for {n} rows"
                    )
                n_out = int(np.count_nonzero(want_arr))
        width = self.info.out_width
        if out is None:
            out = np.empty((n_out, width), dtype=np.float32)
        elif out.dtype != np.float32 or not out.flags.c_contiguous or out.size < n_out * width:
            raise error_for_code(int(lib.DGR_E_SHAPE), "out must be a C-contiguous float32 array")
        return _Prepared(item.session_id, item.epoch, n, pos, tok, inp, row_width, want_arr, out)

    # -- state -----------------------------------------------------------------------------

    def save_state(self, session_id: int, epoch: int) -> bytes:
        """The session's state: a ``DGRS`` header (range, widths, position) + llama.cpp's."""
        size = ffi.new("size_t *")
        written = ffi.new("size_t *")
        with self._lock:
            handle = self._live()
            self._check(lib.dgr_session_state_size(handle, session_id, epoch, size))
            buf = bytearray(int(size[0]))
            self._check(
                lib.dgr_session_state_save(
                    handle, session_id, epoch, ffi.from_buffer(buf), len(buf), written
                )
            )
        return bytes(buf[: int(written[0])])

    def load_state(self, session_id: int, epoch: int, state: bytes) -> None:
        """Replaces the open session's state by a saved one."""
        with self._lock:
            self._check(
                lib.dgr_session_state_load(
                    self._live(), session_id, epoch, ffi.from_buffer(state), len(state)
                )
            )

    # -- internals -------------------------------------------------------------------------

    def _live(self) -> Any:
        if self._handle is None:
            raise EngineClosed(f"engine for {self.model_path.name} is closed")
        return self._handle

    _check = staticmethod(check_status)

    def _read_info(self) -> ShardInfo:
        i = ffi.new("dgr_shard_info *")
        self._check(lib.dgr_engine_info(self._handle, i))
        return ShardInfo(
            arch=ffi.string(i.arch).decode(),
            n_layer=int(i.n_layer),
            layer_begin=int(i.layer_begin),
            layer_end=int(i.layer_end),
            n_embd=int(i.n_embd),
            n_vocab=int(i.n_vocab),
            in_width=int(i.in_width),
            out_width=int(i.out_width),
            is_first=bool(i.is_first),
            is_last=bool(i.is_last),
            needs_token_ids=bool(i.needs_token_ids),
            mtp_owner=bool(i.mtp_owner),
            max_sessions=int(i.max_sessions),
            n_ctx_per_session=int(i.n_ctx_per_session),
            n_batch=int(i.n_batch),
        )
