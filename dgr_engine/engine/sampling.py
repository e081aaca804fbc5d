"""dgr's one sampler, bound: :class:`SeededSampler` calls the native ``dgr_sample``
(``native/src/dgr_sampler.cpp``, ``docs/sampling.md``), the code a worker's last stage and a
native link's run too, so the client, every stage and every data path take the same token from
the same logits, seed, position and history.

:func:`sample_rows` is what a last stage does with a frame's logits rows; the session's
parameters (:class:`~dgr_session.sampling.Sampling`) come with its open.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from dgr_engine._binding import ffi, lib
from dgr_session.errors import NonFiniteLogits
from dgr_session.sampling import GREEDY, InvalidSamplingParameter, Sampling

__all__ = ["SeededSampler", "check_sampling", "native_sampling", "sample_rows", "uniform"]

_NON_FINITE = int(lib.DGR_E_NON_FINITE)


def native_sampling(sampling: Sampling) -> Any:
    """``sampling`` as the ABI's ``dgr_sampling`` (a cffi struct)."""
    return ffi.new(
        "dgr_sampling *",
        {
            "seed": sampling.seed,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": sampling.min_p,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "repetition_penalty": sampling.repetition_penalty,
            "penalty_last_n": sampling.penalty_last_n,
        },
    )


def check_sampling(params: Any) -> None:
    """The native check of a ``dgr_sampling``: :class:`InvalidSamplingParameter` naming the
    value out of range (``dgr_sampling_check``)."""
    if lib.dgr_sampling_check(params) != 0:
        raise InvalidSamplingParameter(ffi.string(lib.dgr_last_error()).decode(errors="replace"))


def sample_exp(y: float) -> float:
    """The sampler's own exponential of ``min(y, 0)`` (``docs/sampling.md``, "The
    exponential"): the same bits on every system."""
    return float(lib.dgr_sample_exp(y))


def uniform(seed: int, position: int) -> float:
    """The draw of ``(seed, position)``, in ``[0, 1)`` (``docs/sampling.md``, "The draw")."""
    return float(lib.dgr_sample_uniform(seed, position))


def _one(params: Any, row: npt.NDArray[np.float32], position: int, history: Any, n: int) -> int:
    out = ffi.new("int32_t *")
    logits = ffi.from_buffer("float[]", row)
    rc = lib.dgr_sample(params, logits, len(row), position, history, n, out)
    if rc != 0:
        message = ffi.string(lib.dgr_last_error()).decode(errors="replace")
        if rc == _NON_FINITE:
            raise NonFiniteLogits(message)
        raise InvalidSamplingParameter(message)
    return int(out[0])


def _history(tokens: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
    return np.ascontiguousarray(np.asarray(tokens, dtype=np.int64), dtype=np.int32)


def sample_rows(
    sampling: Sampling,
    rows: npt.NDArray[np.float32],
    positions: Sequence[int],
    history: Sequence[int] | npt.NDArray[np.integer] = (),
) -> list[int]:
    """The token of each logits row: row ``i`` gives the token at ``positions[i]`` (the
    position after the row's own), from the tokens before it, ``history[:positions[i]]``
    (read only when ``sampling`` is penalised: then ``history`` must reach the last row's)."""
    params = native_sampling(sampling)
    values = np.ascontiguousarray(rows, dtype=np.float32)
    if values.ndim != 2 or values.shape[0] != len(positions):
        raise ValueError(f"{values.shape} logits rows for {len(positions)} positions")
    if not sampling.penalized:
        return [_one(params, values[i], int(p), ffi.NULL, 0) for i, p in enumerate(positions)]
    held = _history(history)
    if positions and int(positions[-1]) > len(held):
        raise ValueError(f"a history of {len(held)} tokens for position {positions[-1]}")
    pointer = ffi.from_buffer("int32_t[]", held)
    return [_one(params, values[i], int(p), pointer, int(p)) for i, p in enumerate(positions)]


@attrs.frozen
class SeededSampler:
    """dgr's one sampler with the parameters :attr:`sampling`, called in this process (a
    :class:`~dgr_session.sampling.Sampler`): ``sampler(logits, position, history)`` is the token
    at ``position`` from the logits of the row before it and ``history``, the tokens before
    it (the last of them at ``position - 1``). The stages of a route apply the same
    code to the same parameters, which the session hands them at open."""

    sampling: Sampling = GREEDY

    @classmethod
    def of(cls, **fields: Any) -> SeededSampler:
        """The sampler of :class:`~dgr_session.sampling.Sampling` ``(**fields)``."""
        return cls(Sampling(**fields))

    def __call__(self, logits: Any, position: int, history: Sequence[int] = ()) -> int:
        row = np.ascontiguousarray(np.asarray(logits, dtype=np.float32).reshape(-1))
        if row.shape[0] == 0:
            raise ValueError("empty logits")
        params = native_sampling(self.sampling)
        if not self.sampling.penalized or not len(history):
            return _one(params, row, position, ffi.NULL, 0)
        held = _history(history)
        return _one(params, row, position, ffi.from_buffer("int32_t[]", held), len(held))
