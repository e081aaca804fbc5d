"""The native link implementation of the chained data path (``client/channel.py``;
``docs/native-path.md``): the first stage's input and the last stage's token stream of a ring.
The session's ``ForwardRequest`` frames are written as link ``ROWS`` messages, and each ``TOKEN``
the last stage answers is read as the ``ChainOutputReply`` of a sampled reply; a ``FAILED`` ends
the stream with the failing stage's C status (``dgr_engine.status``: its number, never its
text) as a :class:`~dgr_engine.client.channel.StageFailure` naming that stage, so the chain
raises the same typed error and blames the same stage as on the other paths.

A native link carries rings whose last stage takes the tokens only (its sampler is the
session's, given at open: ``docs/sampling.md``): frames with logit rows, drafts or MTP
requests, or that want logits rather than sampled tokens, are refused here (the transport takes
the native link only for sessions that send none of them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Sequence

import numpy as np

from dgr_engine._binding import lib
from dgr_engine.client.channel import ChannelOver, Metadata, StageFailure
from dgr_engine.errors import FrameRejected, GrantUnauthenticated, ShardRpcError, ShardUnavailable
from dgr_engine.status import error_for_code
from dgr_engine.wire import link_messages as lm
from dgr_engine.wire import link_seal
from dgr_engine.wire.frames import fill_tensor
from dgr_engine.wire.keepalive import keep_alive
from dgr_engine.wire.proto import shard_pb2 as pb

__all__ = ["NativeChainChannel", "native_route"]

_CONNECT_SECONDS = 10.0
_NO_ROWS = np.zeros((0, 1), dtype=np.float32)


def _failed(code_number: int, hop: int, message: str) -> StageFailure:
    """A ``FAILED``'s failure: its C status as its typed error, the stage it names."""
    return StageFailure(hop, error_for_code(code_number, message))


_VERDICT_SECONDS = 2.0
"""How long the input's end waits for the output's verdict (a stage lost after the first ends
the first stage's link too: the output names which stage it was)."""


class _Ledger:
    """What one epoch's input and output tell each other: the steps whose frames wanted no
    logits (their answers carry none), and whether the output has ended."""

    def __init__(self) -> None:
        self.no_logits: collections.Counter[int] = collections.Counter()
        """Per step, its frames in flight that want no logits (a prefill forward's frames
        share its step)."""
        self.output_ended = asyncio.Event()
        self.n_stop = 0
        """The stop tokens every frame of the epoch carries."""


class NativeChainChannel:
    """One stage's native link port, for one epoch of a ring: the first stage's takes the
    frames, the last stage's gives the outcomes."""

    def __init__(
        self,
        host: str,
        port: int,
        hop: int,
        ledger: _Ledger,
        widths: Sequence[tuple[int, int]],
        *,
        ring: bool,
        sealed: bool = False,
    ) -> None:
        self.host, self.port, self.hop, self.ring = host, port, hop, ring
        self.sealed = sealed
        """The stage seals its links (``wire/link_seal.py``): so does the call."""
        self.endpoint = f"{host}:{port}"
        self.widths = tuple(widths)
        """Each stage's (input, output) floats per row: what its messages weigh."""
        self._ledger = ledger

    def frames(self, metadata: Metadata) -> NativeFrames:
        return NativeFrames(self, self._ledger)

    def outcomes(
        self, request: pb.ChainOutputRequest, metadata: Metadata, hop: int
    ) -> NativeOutcomes:
        return NativeOutcomes(self, self._ledger, request)


def native_route(
    hosts: Sequence[tuple[str, int]],
    widths: Sequence[tuple[int, int]],
    *,
    ring: bool,
    sealed: Sequence[bool] = (),
) -> list[NativeChainChannel]:
    """The channels of one epoch's route (``hosts``: each stage's native link host and port;
    ``widths``: its floats per input and output boundary row, 0 for token ids and logits;
    ``sealed``: whether each stage seals its links, none when empty); its first and last share
    what their streams must tell each other."""
    ledger = _Ledger()
    seals = list(sealed) or [False] * len(hosts)
    return [
        NativeChainChannel(h, p, i, ledger, widths, ring=ring, sealed=seals[i])
        for i, (h, p) in enumerate(hosts)
    ]


class _Connection:
    """What both streams share: the connection, its introduction and how the stream ended
    (``None``: cleanly)."""

    def __init__(self, channel: NativeChainChannel) -> None:
        self.channel = channel
        self._ending: asyncio.Future[StageFailure | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._keys: link_seal.ConnectionKeys | None = None
        """A sealed connection's keys, once its introduction was answered."""

    def _end(self, failure: StageFailure | None) -> None:
        if not self._ending.done():
            self._ending.set_result(failure)
        if self._writer is not None:
            self._writer.close()

    def _lost(self, what: str) -> StageFailure:
        return StageFailure(self.channel.hop, ShardUnavailable(f"native link {what}"))

    def _raise_if_failed(self) -> None:
        failure = self._ending.result()
        if failure is not None:
            raise failure

    def cancel(self) -> None:
        self._end(StageFailure(self.channel.hop, ShardUnavailable("cancelled by the caller")))

    async def _introduce(self, hello: lm.Hello) -> bool:
        """Connects and introduces the connection (sealed when its stage seals its links:
        ``hello``'s secret is then proved, never sent); False (and the end set) if refused
        or unreachable."""
        c = self.channel
        dialer = None
        if c.sealed:
            dialer = link_seal.Dialer(
                hello.role, hello.session_id, hello.epoch, hello.secret, hello.hop, ring=hello.ring
            )
            hello = dialer.hello
        try:
            async with asyncio.timeout(_CONNECT_SECONDS):
                self._reader, self._writer = await asyncio.open_connection(c.host, c.port)
                keep_alive(self._writer.get_extra_info("socket"))
                self._writer.write(lm.encode_hello(hello))
                await self._writer.drain()
                header, payload = await lm.read_stream_message(self._reader, lm.HELLO_MAX_BYTES)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            self._end(self._lost(f"{c.endpoint}: {exc!r}"))
            return False
        except lm.LinkMessageError as exc:
            self._end(StageFailure(c.hop, _out_of_protocol(c, str(exc))))
            return False
        if header.kind is lm.Kind.FAILED:
            self._end(_failed(header.value, c.hop, payload.decode(errors="replace")))
            return False
        if header.kind is not lm.Kind.HELLO:
            self._end(StageFailure(c.hop, _out_of_protocol(c, "no HELLO answer")))
            return False
        if dialer is not None:
            try:
                self._keys = dialer.keys(payload)
            except GrantUnauthenticated as exc:
                self._end(_failed(int(lib.DGR_E_UNAUTHENTICATED), c.hop, str(exc)))
                return False
        return True


def _out_of_protocol(channel: NativeChainChannel, what: str) -> ShardRpcError:
    return ShardRpcError(f"native link {channel.endpoint}: {what}", status="DGR_E_PROTOCOL")


class NativeFrames(_Connection):
    """The first stage's input: ``send`` writes a frame (the first one introduces the
    connection with its session, epoch and secret); ``end`` waits for the connection's end (a
    native link answers nothing upstream: its failures go on to the output)."""

    def __init__(self, channel: NativeChainChannel, ledger: _Ledger) -> None:
        super().__init__(channel)
        self._ledger = ledger
        self._connected: asyncio.Future[bool] | None = None
        self._epoch = 0
        self._sealing: link_seal.Sealing | None = None

    def _seal(self, message: bytes) -> bytes:
        return self._sealing.seal(message) if self._sealing is not None else message

    async def send(self, request: pb.ForwardRequest) -> None:
        message = self._encode(request)
        self._epoch = int(request.epoch)
        if self._connected is None:
            self._connected = asyncio.ensure_future(
                self._introduce(
                    lm.Hello(
                        lm.Role.INPUT,
                        request.session_id,
                        int(request.epoch),
                        bytes(request.session_secret),
                        0,
                    )
                )
            )
        if not await asyncio.shield(self._connected) or self._ending.done():
            raise ChannelOver("the stream is over")
        assert self._writer is not None
        if self._keys is not None and self._sealing is None:
            self._sealing = link_seal.Sealing(self._keys.send)
        try:
            self._writer.write(self._seal(message))
            await self._writer.drain()
        except (OSError, RuntimeError) as exc:
            self._end(self._lost(f"{self.channel.endpoint}: {exc!r}"))
            raise ChannelOver("the stream is over") from exc

    def _encode(self, request: pb.ForwardRequest) -> bytes:
        n = len(request.positions)
        unsupported = (
            request.draft_rows
            or request.mtp_draft_max
            or request.ring_draft_max
            or request.HasField("boundary")
            or (request.logit_rows and list(request.logit_rows) != [n - 1])
            or (not request.no_logits and not request.sampled_tokens)
        )
        if unsupported or n == 0:
            raise FrameRejected(
                "DGR_E_FRAME: a native link carries sampled ring frames only (no logits, "
                "drafts or MTP requests)"
            )
        step = int(request.step)
        if request.no_logits:
            self._ledger.no_logits[step] += 1
        self._ledger.n_stop = len(request.ring_stop)
        return lm.encode_rows(
            int(request.epoch),
            step,
            int(request.positions[0]),
            list(request.token_ids),
            until_step=0 if request.no_logits else int(request.ring_until_step),
            stop=list(request.ring_stop),
            kind=int(request.kind),
        )

    async def end(self) -> None:
        if self._connected is not None and await asyncio.shield(self._connected):
            assert self._reader is not None
            try:
                while await self._reader.read(4096):
                    pass  # nothing comes upstream while all goes well
            except OSError:
                pass
            # the first stage's link ended: a failure after it reaches the output, which says
            # where; only then does this end (so the chain blames that stage, not the first)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_VERDICT_SECONDS):
                    await self._ledger.output_ended.wait()
            self._end(None)
        elif self._connected is None:
            await asyncio.shield(self._ending)
        self._raise_if_failed()

    async def finish(self) -> None:
        """Ends the route's links cleanly (an ``END``, passed on by every stage)."""
        if self._writer is not None and not self._ending.done():
            try:
                self._writer.write(self._seal(lm.encode_end(self._epoch)))
                await self._writer.drain()
                self._writer.write_eof()
            except (OSError, RuntimeError):
                pass


class NativeOutcomes(_Connection):
    """The last stage's token stream: its first ``next`` answers the empty reply (the stream
    is registered), then one sampled reply per ``TOKEN``; a ``FAILED`` ends the stream with the
    failing stage's typed error."""

    def __init__(
        self, channel: NativeChainChannel, ledger: _Ledger, request: pb.ChainOutputRequest
    ) -> None:
        super().__init__(channel)
        self._ledger = ledger
        self._ending.add_done_callback(lambda _: ledger.output_ended.set())
        self._session_id = request.session_id
        self._epoch = int(request.epoch)
        hello = lm.Hello(
            lm.Role.OUTPUT,
            request.session_id,
            int(request.epoch),
            bytes(request.session_secret),
            channel.hop,
            ring=channel.ring,
        )
        self._connected = asyncio.ensure_future(self._introduce(hello))
        self._announced = False
        self._opening: link_seal.Sealing | None = None

    async def next(self) -> pb.ChainOutputReply | None:
        if not await asyncio.shield(self._connected) and not self._ending.done():
            self._end(self._lost("lost"))
        if not self._ending.done():
            if not self._announced:
                self._announced = True
                return pb.ChainOutputReply()
            assert self._reader is not None
            if self._keys is not None and self._opening is None:
                self._opening = link_seal.Sealing(self._keys.receive)
            endpoint = self.channel.endpoint
            try:
                header, payload = await lm.read_stream_message(
                    self._reader, lm.HELLO_MAX_BYTES, self._opening
                )
                if header.kind is lm.Kind.TOKEN:
                    return self._reply(header, payload)
                if header.kind is lm.Kind.FAILED:
                    text = payload.decode(errors="replace")
                    self._end(_failed(header.value, header.hop, text))
                elif header.kind is lm.Kind.END:
                    self._end(None)
                else:
                    raise lm.LinkMessageError(f"a {header.kind.name} from the last stage")
            except (asyncio.IncompleteReadError, OSError) as exc:
                self._end(self._lost(f"{endpoint} lost: {type(exc).__name__}"))
            except (lm.LinkMessageError, GrantUnauthenticated) as exc:
                self._end(
                    StageFailure(
                        self.channel.hop, _out_of_protocol(self.channel, f"malformed answer: {exc}")
                    )
                )
        self._raise_if_failed()
        return None

    def _reply(self, header: lm.Header, payload: bytes) -> pb.ChainOutputReply:
        reply = pb.ForwardReply(
            session_id=self._session_id,
            epoch=self._epoch,
            step=header.step,
            kind=pb.OUTPUT_KIND_LOGITS,
            next_pos=header.pos + header.n_rows,
        )
        if self._ledger.no_logits[header.step] > 0:  # frames of a step come back in order
            self._ledger.no_logits[header.step] -= 1
            fill_tensor(reply.output, _NO_ROWS)
        else:
            reply.sampled.append(header.value)
        out = pb.ChainOutputReply(reply=reply)
        # each stage's part of the pass: its engine time (all of it llama.cpp's: no Python
        # around the call) and the bytes of the messages it took and sent
        n, stops = header.n_rows, self._ledger.n_stop
        widths = self.channel.widths
        trace = lm.trace_of(payload)
        for hop, engine_us in enumerate(trace[: len(widths)]):
            timings = pb.Timings(compute_us=engine_us, native_us=engine_us, total_us=engine_us)
            taken = lm.HEADER.size + 4 * (stops + n + n * widths[hop][0] + hop)
            last = hop == len(widths) - 1
            sent = lm.HEADER.size + 4 * (
                hop + 1 if last else stops + n + n * widths[hop][1] + hop + 1
            )
            out.hops.append(pb.HopTrace(hop=hop, timings=timings, bytes_in=taken, bytes_out=sent))
        return out
