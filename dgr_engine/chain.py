"""An in-process chain of shard engines: the simplest complete route, with no network.

``LocalChain`` relays what stage k returns into stage k+1 (token ids into the first stage,
boundary rows after it, logits out of the last). It is the reference driver for parity tests
and the demo; the route-session manager drives the same engines through its transports.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dgr_engine.engine import FloatArray, ShardEngine
from dgr_engine.errors import ShapeMismatch


class LocalChain:
    """Stages ``engines[0] .. engines[-1]`` covering ``[0, n_layer)`` in order."""

    def __init__(self, engines: Sequence[ShardEngine]) -> None:
        if not engines:
            raise ShapeMismatch("a chain needs at least one stage")
        expected_begin = 0
        for index, engine in enumerate(engines):
            begin, end = engine.info.layers
            if begin != expected_begin:
                raise ShapeMismatch(
                    f"stage {index} owns [{begin}, {end}) but the chain continues at layer "
                    f"{expected_begin}"
                )
            expected_begin = end
        if expected_begin != engines[0].info.n_layer:
            raise ShapeMismatch(
                f"the chain ends at layer {expected_begin}, the model has {engines[0].info.n_layer}"
            )
        self.engines = list(engines)

    def open(self, session_id: int, epoch: int) -> None:
        for engine in self.engines:
            engine.open_session(session_id, epoch)

    def close(self, session_id: int, epoch: int) -> None:
        for engine in self.engines:
            engine.close_session(session_id, epoch)

    def forward(
        self,
        session_id: int,
        epoch: int,
        tokens: Sequence[int] | np.ndarray,
        start_pos: int,
        *,
        all_logits: bool = False,
    ) -> FloatArray:
        """Runs ``tokens`` at positions ``start_pos..`` through every stage; returns logits of
        the last row, or of every row with ``all_logits``."""
        tok = np.asarray(tokens, dtype=np.int32)
        positions = np.arange(start_pos, start_pos + tok.shape[0], dtype=np.int32)
        want = np.ones(tok.shape[0], dtype=np.uint8) if all_logits else None
        rows: FloatArray | None = None
        for engine in self.engines:
            info = engine.info
            rows = engine.forward(
                session_id,
                epoch,
                positions,
                tokens=tok if info.needs_token_ids else None,
                rows=None if info.is_first else rows,
                want=want if info.is_last else None,
            )
        assert rows is not None
        return rows

    def greedy(
        self,
        session_id: int,
        epoch: int,
        prompt: Sequence[int],
        n_steps: int,
        *,
        accepted: Sequence[int] = (),
        all_prefill_logits: bool = True,
    ) -> tuple[list[int], list[FloatArray]]:
        """Prefills ``prompt``, replays ``accepted`` tokens (never resampled), then decodes
        ``n_steps`` greedy tokens. Returns the new tokens and the logits of the prefill (every
        row, or with ``all_prefill_logits=False`` the last row only) followed by those of each
        replayed and each decoded step.

        Asking for every prefill row changes the head's matmul batching and so the last bits of
        the last row's logits: compare like with like. Route sessions ask for the last row only;
        a reference for them passes ``all_prefill_logits=False``.

        Replay keeps the original batching - the prompt in one call, then one token per call -
        so the KV it rebuilds is bit for bit the KV of the first run: a batched re-prefill of
        prompt + accepted tokens rounds differently in the last bits and could flip a greedy
        near-tie.
        """
        history = list(prompt)
        logits: list[FloatArray] = [
            self.forward(session_id, epoch, history, 0, all_logits=all_prefill_logits)
        ]
        for token in accepted:
            logits.append(self.forward(session_id, epoch, [token], len(history)))
            history.append(int(token))
        tokens: list[int] = []
        for _ in range(n_steps):
            token = int(np.argmax(logits[-1][-1]))
            tokens.append(token)
            logits.append(self.forward(session_id, epoch, [token], len(history)))
            history.append(token)
        return tokens, logits


def split_points(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """Even contiguous ranges covering ``[0, n_layer)`` with ``n_stages`` stages."""
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"cannot cut {n_layer} layers into {n_stages} stages")
    bounds = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))
