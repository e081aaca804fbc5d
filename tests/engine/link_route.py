"""The tests' client of a route over native links made of engines and socket pairs
(``docs/native-path.md``; the product's client is ``client/native_channel.py``): it writes a
turn's rows to the first stage and reads the last stage's greedy tokens. On a ring the last
stage sends each next step's frame to the first stage itself, and the client only reads; on a
chain the client sends each token back.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

import attrs

from dgr_engine.errors import FrameRejected
from dgr_engine.status import error_for_code
from dgr_engine.wire.link_messages import MAX_STOP, Kind, encode_rows, read_message
from dgr_engine.wire.link_seal import Sealing

__all__ = ["LinkRoute", "Turn"]


@attrs.frozen
class Turn:
    """What one turn made: its greedy tokens, and the position the next turn starts at (its
    last token is not in the route's KV yet: the next turn's rows start with it)."""

    tokens: tuple[int, ...]
    next_pos: int
    seconds: float
    first_token_seconds: float


class LinkRoute:
    """One session epoch's route over native links: ``first`` is connected to the first
    stage's link, ``output`` to the last stage's token stream. ``ring``: the last stage sends
    each next frame to the first stage itself. A sealed route (``wire/link_seal.py``) seals
    what goes to ``first`` with ``seal_first`` and opens what ``output`` brings with
    ``open_output``."""

    def __init__(
        self,
        first: socket.socket,
        output: socket.socket,
        epoch: int,
        *,
        ring: bool,
        seal_first: Sealing | None = None,
        open_output: Sealing | None = None,
    ) -> None:
        self.first, self.output, self.epoch, self.ring = first, output, epoch, ring
        self._seal, self._open = seal_first, open_output

    def _send(self, message: bytes) -> None:
        self.first.sendall(self._seal.seal(message) if self._seal is not None else message)

    def generate(
        self,
        rows: Sequence[int],
        pos: int,
        max_new: int,
        *,
        stop: Sequence[int] = (),
        timeout: float = 60.0,
    ) -> Turn:
        """Runs ``rows`` (a prompt, or the last turn's last token and the next user text) at
        ``pos`` and makes up to ``max_new`` greedy tokens, ending early at a token of
        ``stop``; raises the failing stage's typed error, ``FrameRejected`` for an answer that
        is not the route's, ``LinkClosed`` when the route ends or falls silent for
        ``timeout`` seconds."""
        if max_new < 1 or not rows or len(stop) > MAX_STOP:
            raise ValueError(f"a turn needs rows, max_new >= 1 and at most {MAX_STOP} stop tokens")
        began = time.monotonic()
        first_at = 0.0
        until = max_new - 1
        self._send(encode_rows(self.epoch, 0, pos, rows, until_step=until, stop=stop))
        pos += len(rows)
        tokens: list[int] = []
        while len(tokens) < max_new:
            header, payload = read_message(
                self.output, timeout, max_payload=4096, opener=self._open
            )
            if header.kind is Kind.FAILED:
                text = payload.decode(errors="replace")
                raise error_for_code(header.value, f"stage {header.hop}: {text}")
            if header.kind is not Kind.TOKEN or header.step != len(tokens):
                raise FrameRejected(
                    f"DGR_E_FRAME: expected the token of step {len(tokens)}, got a "
                    f"{header.kind.name} of step {header.step}"
                )
            if not tokens:
                first_at = time.monotonic() - began
            tokens.append(header.value)
            if header.value in stop or header.step >= until:
                break
            if not self.ring:  # a chain: the client sends the token on itself
                step = header.step + 1
                frame = encode_rows(
                    self.epoch, step, pos, [header.value], until_step=until, stop=stop
                )
                self._send(frame)
            pos += 1  # the token goes into the route's KV with the next step
        return Turn(tuple(tokens), pos, time.monotonic() - began, first_at)
