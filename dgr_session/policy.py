"""The failure policy: how much a session may spend before it gives up."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from typing import cast

import attrs


def _finite_positive(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be finite and > 0, got {value}")


def _at_least(minimum: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
        if value < minimum:
            raise ValueError(f"{attribute.name} must be >= {minimum}, got {value}")

    return check


def _delays(
    _inst: object, attribute: attrs.Attribute[tuple[float, ...]], value: tuple[float, ...]
) -> None:
    for delay in value:
        if not (math.isfinite(delay) and delay >= 0):
            raise ValueError(f"{attribute.name} entries must be finite and >= 0, got {delay}")


def _float_tuple(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(value) for value in values)


class ReplayMode(enum.StrEnum):
    """How a re-prefill after a route change rebuilds the stages' KV (``FailurePolicy.replay``).
    A ``str``: ``ReplayMode.EXACT == "exact"``, and a policy takes either spelling."""

    #: Prompt and accepted tokens together, in forwards of the new route's ``max_rows``.
    BATCHED = "batched"
    #: The first run's batching: the prompt in its pinned chunks, then one token per forward.
    EXACT = "exact"


REPLAY_MODES = tuple(mode.value for mode in ReplayMode)
"""``FailurePolicy.replay`` values."""


def _replay_mode(value: str) -> ReplayMode:
    # An unknown name passes through untouched, for the validator to refuse in its own words.
    return ReplayMode(value) if value in REPLAY_MODES else cast(ReplayMode, value)


@attrs.frozen
class FailurePolicy:
    """Bounds on what a session spends on faults. Every default is finite.

    A *fault* is a stage failure (dead, deadline, engine error, protocol) or a failed route
    request (no route, invalid route, no answer in time). After a fault the session closes the
    epoch's stages, waits the backoff, asks for a new route and re-prefills from position 0
    under a new epoch. It fails instead when the fault is its ``max_attempts_per_step``-th at
    the current step, or when it would need a route change beyond ``max_route_changes``, or
    when the session deadline passes.
    """

    step_deadline: float = attrs.field(default=30.0, validator=_finite_positive)
    """Seconds allowed for one wait: a route request, opening the stages, or one forward through
    the whole route (a prompt chunk, a replay chunk or replayed token, or one decoded token)."""
    session_deadline: float = attrs.field(default=600.0, validator=_finite_positive)
    """Seconds allowed for the whole session, from its start."""
    max_route_changes: int = attrs.field(default=3, validator=_at_least(0))
    """Route assignments allowed after the first one."""
    max_attempts_per_step: int = attrs.field(default=3, validator=_at_least(1))
    """Attempts allowed at one step (the first try counts); the fault that uses up the last
    attempt fails the session."""
    backoff: tuple[float, ...] = attrs.field(
        default=(0.0, 0.5, 2.0), converter=_float_tuple, validator=_delays
    )
    """Seconds to wait before asking for a route after the 1st, 2nd, ... fault of the session;
    the last entry repeats, an empty schedule means no wait."""

    admission_budget: float = attrs.field(default=60.0, validator=_finite_positive)
    """Seconds a session may spend waiting for busy stages (no free session slot) in a row,
    from the first busy answer until every stage of a route has opened. Busy answers are load,
    not faults: they spend this budget (and the session deadline), never the attempts or the
    route changes."""
    busy_retry: float = attrs.field(default=0.25, validator=_finite_positive)
    """Seconds to wait before asking again after a busy answer that carried no hint."""
    replay: ReplayMode = attrs.field(
        default=ReplayMode.BATCHED,
        converter=_replay_mode,
        validator=attrs.validators.in_(cast("tuple[ReplayMode, ...]", REPLAY_MODES)),
    )
    """How a re-prefill after a route change rebuilds the stages' KV. ``batched``: the prompt
    and the accepted tokens together, in forwards of the new route's ``max_rows`` (as fast as
    one prefill of those rows; the KV may differ from the first run's in the last bits, since
    llama.cpp's kernels round differently for other batch shapes, which can flip a greedy
    near-tie later). ``exact``: the first run's batching, the prompt in its pinned chunks then
    one forward per accepted token, which rebuilds the KV bit for bit at one decode step per
    token."""

    pipelined: bool = True
    """Whether forwards whose rows the session knows ahead (prompt chunks, replayed rows) are
    pipelined across the stages: stage k computes chunk c + 1 while stage k + 1 computes chunk
    c. Each stage still computes the same calls in the same order, so nothing changes but the
    time (an exact replay of n tokens over N stages costs about n decode steps of the slowest
    stage, not of the whole route). ``False``: one forward in flight per session."""

    def backoff_after(self, faults: int) -> float:
        """Delay before the route request that follows the session's ``faults``-th fault."""
        if not self.backoff or faults <= 0:
            return 0.0
        return self.backoff[min(faults, len(self.backoff)) - 1]
