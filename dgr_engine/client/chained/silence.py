"""Which stage of a chained route went silent (``docs/reliability.md``, "Between hosts").

On a chained route or a ring the client hears only the last stage: a frame that never comes
back says nothing of where it stopped. Between real hosts the common failure is silence (a
host loses power, a link drops every packet) and TCP says nothing for minutes. So while a
frame is overdue the transport probes every stage of the epoch with the worker's health check
over its control channel, each within a short deadline, and names the first stage that did
not answer while a later one did or the route's others did. When every stage answers (a slow
stage, or a link between two stages cut) or none does (the client's own link), the client
cannot tell, and names none: a wrong blame would exclude a healthy worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import attrs

from dgr_session.route import StageSpec

__all__ = ["SilenceWatch", "SilentStage", "find_silent_stage"]


@attrs.frozen
class SilenceWatch:
    """When a chained transport probes an epoch's stages, and how long each may take."""

    after: float = attrs.field(default=2.0)
    """Seconds a frame may be overdue before the route's stages are probed (and again each
    this long while it stays overdue)."""
    timeout: float = attrs.field(default=3.0)
    """Seconds each stage has to answer a probe."""

    @after.validator
    @timeout.validator
    def _positive(self, attribute: attrs.Attribute[float], value: float) -> None:
        if not value > 0:
            raise ValueError(f"{attribute.name} must be > 0 seconds, got {value}")


@attrs.frozen
class SilentStage:
    """The stage a probe found silent, and its probe's typed error."""

    index: int
    error: Exception


async def find_silent_stage(
    route: Sequence[StageSpec], probe: Callable[[StageSpec], Awaitable[None]]
) -> SilentStage | None:
    """Probes every stage of ``route`` at once (``probe`` raises the typed error of a stage
    that did not answer) and names the first that did not, when another did; ``None`` when
    every stage answered or none did."""
    results = await asyncio.gather(*(probe(s) for s in route), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # cancelled: not a stage's answer
    silent = [(i, r) for i, r in enumerate(results) if isinstance(r, Exception)]
    if not silent or len(silent) == len(route):
        return None
    index, error = silent[0]
    error.args = (
        f"stage {index} answered no probe while a frame was overdue and the route's other"
        f" stages answered: {error}",
        *error.args[1:],
    )
    return SilentStage(index, error)
