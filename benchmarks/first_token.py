"""Time to first token of a benchmark's route runs, and what it is compared with.

:class:`FirstTokenRouteBench` is ``benchmarks.pipeline.RouteBench`` whose runs also say when
their first token came: from ``SessionManager.start`` to the first accepted token, so the
route's opens, the prompt's prefill through every stage and its greedy token are all in it
(what a user waits for). The peers' equivalent (:func:`peer_ttft_s`) is llama-bench's prompt
test for the same prompt: ``llama_decode`` of the prompt in ``-b`` chunks, the last row's
logits computed, which is exactly what the first token is chosen from; a decode step after
it would be the second token. llama-bench times inside one process, after loading.
"""

from __future__ import annotations

import attrs

from benchmarks.pipeline import RouteBench, RouteRun


@attrs.frozen
class TimedRun:
    """A route run and its time to first token."""

    run: RouteRun
    ttft_s: float
    """From ``SessionManager.start`` to the first accepted token."""


class FirstTokenRouteBench(RouteBench):
    """A :class:`~benchmarks.pipeline.RouteBench` whose :meth:`timed_run` says when the first
    token came (``RouteRun.ttft_s``); the route, transport, session and the prefill and decode
    figures are the parent's."""

    async def timed_run(self, prompt: list[int], n_decode: int) -> TimedRun:
        """One greedy run, as ``RouteBench.run``, with its time to first token."""
        run = await self.run(prompt, n_decode)
        return TimedRun(run, run.ttft_s)


def peer_ttft_s(prompt: int, prefill_tps: float) -> float:
    """llama-bench's prompt time for ``prompt`` tokens at its reported ``prefill_tps``: the
    peer's time to its first token's logits (see the module's docs)."""
    return prompt / prefill_tps
