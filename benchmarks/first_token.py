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

import time
from functools import partial

import attrs

from benchmarks.pipeline import RouteBench, RouteRun


@attrs.frozen
class TimedRun:
    """A route run and its time to first token."""

    run: RouteRun
    ttft_s: float
    """From ``SessionManager.start`` to the first accepted token."""


class FirstTokenRouteBench(RouteBench):
    """A :class:`~benchmarks.pipeline.RouteBench` whose :meth:`timed_run` also times the first
    token. It is ``RouteBench.run`` with the session's start and first token kept (that run
    keeps them to itself); the route, transport, session and the prefill and decode figures
    are the parent's."""

    async def timed_run(self, prompt: list[int], n_decode: int) -> TimedRun:
        """One greedy run, as ``RouteBench.run``, with its time to first token."""
        self._records.clear()
        times: list[float] = []
        self._runs += 1
        began = time.perf_counter()
        handle = self.manager.start(
            prompt,
            max_new_tokens=n_decode + 1,
            session_id=f"bench-{self.stages}-{self._runs}",
            on_token=partial(_stamp, times),
        )
        result = await handle.wait()
        if result.error is not None:
            raise result.error
        first_token_at = times[0]
        ttft = first_token_at - began
        prefill = [(t, r) for t, r in self._records if r.positions.start == 0]
        tokens = list(result.tokens)
        decode_s = times[-1] - times[0]
        if not prefill:  # a chained route reports no per-stage forwards
            return TimedRun(RouteRun(ttft, decode_s, tokens, []), ttft)
        start = prefill[0][0] - prefill[0][1].rtt_us / 1e6
        decode = [r for t, r in self._records if t > first_token_at and len(r.positions) == 1]
        return TimedRun(RouteRun(prefill[-1][0] - start, decode_s, tokens, decode), ttft)


def _stamp(times: list[float], _token: int) -> None:
    times.append(time.perf_counter())


def peer_ttft_s(prompt: int, prefill_tps: float) -> float:
    """llama-bench's prompt time for ``prompt`` tokens at its reported ``prefill_tps``: the
    peer's time to its first token's logits (see the module's docs)."""
    return prompt / prefill_tps
