"""An in-process chain of shard engines: the simplest complete route, with no network, and the
whole-model reference run that routes are compared with.

``InProcessRoute`` relays what stage k returns into stage k+1 (token ids into the first stage,
boundary rows after it, logits out of the last).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from dgr_engine.engine import FloatArray, ShardEngine
from dgr_engine.errors import ShapeMismatch
from dgr_engine.options import EngineOptions
from dgr_session.sampling import Sampler


class InProcessRoute:
    """The in-process reference run of a split: stages ``engines[0] .. engines[-1]`` covering
    ``[0, n_layer)`` in order, each stage's output handed to the next in this process (no
    worker, no wire)."""

    def __init__(self, engines: Sequence[ShardEngine]) -> None:
        if not engines:
            raise ShapeMismatch("a route needs at least one stage")
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

        A prompt longer than the engines' ``n_batch`` goes in calls of that many rows, as a
        route session's pinned chunks (its default ``prefill_chunk``).

        Replay keeps the original batching - the prompt in its calls, then one token per call -
        so the KV it rebuilds is bit for bit the KV of the first run: a batched re-prefill of
        prompt + accepted tokens rounds differently in the last bits and could flip a greedy
        near-tie.
        """
        history = list(prompt)
        chunk = min(engine.info.n_batch for engine in self.engines)  # a session's pinned chunk
        parts = [
            self.forward(
                session_id,
                epoch,
                history[start : start + chunk],
                start,
                all_logits=all_prefill_logits,
            )
            for start in range(0, len(history), chunk)
        ]
        logits: list[FloatArray] = [np.concatenate(parts) if all_prefill_logits else parts[-1]]
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


def arch_of(model: str | os.PathLike[str]) -> str:
    """``general.architecture`` of a GGUF (from its header, arrays skipped)."""
    from dgr_engine.gguf_check import check_gguf

    return check_gguf(model).arch


def n_layer_of(model: str | os.PathLike[str]) -> int:
    """Main layers of a GGUF (from its header, arrays skipped): ``block_count`` less the
    MTP/nextn layers, which are never routed (as the C engine counts them)."""
    from dgr_engine.gguf_check import check_gguf

    return check_gguf(model).n_main_layers


def owns_mtp_block(model: str | os.PathLike[str], layers: tuple[int, int]) -> bool:
    """Whether a shard of ``model`` over ``layers`` (``-1`` as the end: to the last layer) is the
    last stage of a deepseek4 model with an MTP block (``{arch}.nextn_predict_layers``), the one
    that loads it (``docs/speculative.md``, the ownership contract). From the header only."""
    from dgr_engine.gguf_check import check_gguf

    return check_gguf(model).owns_mtp_block(layers)


def whole_model_reference(
    model: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    n_tokens: int,
    options: EngineOptions,
) -> list[tuple[list[int], list[npt.NDArray[np.float32]]]]:
    """Per prompt: the whole model's greedy tokens and, for each step, the logits row the
    token was chosen from (step 0: the prompt's last row).

    Fed as a route session feeds its stages: the prompt in calls of ``n_batch`` rows (one call
    when it fits) asking for the last row's logits only (asking for every row's changes the
    output matmul's batching, hence the last bits), then one token per call."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    out = []
    with ShardEngine(Path(model), **options.engine_kwargs()) as whole:
        chain = InProcessRoute([whole])
        for index, prompt in enumerate(prompts):
            chain.open(index, 0)
            tokens, logits = chain.greedy(index, 0, prompt, n_tokens - 1, all_prefill_logits=False)
            # the last token is chosen from the last step's logits: no forward needed after it
            tokens.append(int(np.argmax(logits[-1][-1])))
            chain.close(index, 0)
            out.append((tokens, [step[-1] for step in logits]))
    return out


def whole_model_sampled(
    model: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    n_tokens: int,
    options: EngineOptions,
    samplers: Sequence[Sampler],
) -> list[list[int]]:
    """Per prompt, the tokens its sampler (``samplers``, one a prompt: dgr's sampler, e.g.
    ``engine.sampling.SeededSampler``) takes of the whole model's logits, fed as a route
    session feeds its stages (the prompt in pinned chunks, then one token a call)."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    out = []
    with ShardEngine(Path(model), **options.engine_kwargs()) as whole:
        chain = InProcessRoute([whole])
        for index, (prompt, sampler) in enumerate(zip(prompts, samplers, strict=True)):
            chain.open(index, 0)
            _, logits = chain.greedy(index, 0, prompt, 0, all_prefill_logits=False)
            history, row = list(prompt), logits[-1][-1]
            tokens: list[int] = []
            while True:
                token = int(sampler(row, len(history), history))
                tokens.append(token)
                history.append(token)
                if len(tokens) == n_tokens:
                    break
                row = chain.forward(index, 0, [token], len(history) - 1)[-1]
            chain.close(index, 0)
            out.append(tokens)
    return out


def whole_model_greedy(
    model: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    n_tokens: int,
    options: EngineOptions,
) -> list[list[int]]:
    """Whole-model greedy tokens per prompt (:func:`whole_model_reference` without logits)."""
    return [tokens for tokens, _ in whole_model_reference(model, prompts, n_tokens, options)]
