"""One request's text generation: a route session of the server's ``SessionManager`` whose
accepted tokens come back as text pieces, cut at stop strings, ending with why it ended.

:class:`Generation` starts the session at once; :meth:`Generation.next` gives each
:class:`Piece` as it comes and then one :class:`Ended`. A stop string cancels the session (its
stages are closed) and ends the text before it; :meth:`Generation.aclose` cancels a session
whose client went away and waits until its end, when every stage has been told to close it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import attrs

from dgr_engine.serve.errors import ServeError, error_for_failure
from dgr_engine.serve.metrics import TokenClock
from dgr_engine.serve.stops import StopMatcher
from dgr_engine.tokenizer import TextStream, Tokenizer
from dgr_session import (
    FailurePolicy,
    FinishReason,
    SessionFailed,
    SessionHandle,
    SessionManager,
    SessionResult,
    SessionState,
)
from dgr_session.sampling import Sampler
from dgr_session.speculation import Speculation


@attrs.frozen
class TextJob:
    """What one request asks to generate."""

    prompt: tuple[int, ...]
    """The prompt's token ids (through the chat template for a chat request)."""
    max_tokens: int
    """Most tokens to generate."""
    sampler: Sampler
    """How each token is chosen."""
    stop: tuple[str, ...] = ()
    """Text that ends the output (cut before it)."""


@attrs.frozen
class Piece:
    """Generated text, in order."""

    text: str


@attrs.frozen
class Ended:
    """How the generation ended."""

    finish_reason: str | None
    """``"stop"`` (an end-of-generation token or a stop string) or ``"length"`` (the token
    limit); ``None`` when it failed or was cancelled."""
    completion_tokens: int
    """Tokens the model generated (an end-of-generation token included)."""
    error: ServeError | None = None
    """Why it failed (``None``: it did not)."""
    cancelled: bool = False
    """Cancelled before its end (its client went away, or the server is stopping)."""


class Generation:
    """One request's session; see the module's docs. Use from the event loop that runs
    ``manager``."""

    def __init__(
        self,
        manager: SessionManager,
        tokenizer: Tokenizer,
        job: TextJob,
        *,
        stop_tokens: Collection[int],
        policy: FailurePolicy | None = None,
        speculation: Speculation | None = None,
        clock: TokenClock | None = None,
    ) -> None:
        self._clock = clock  # the server's metrics of this session's tokens (None: none)
        self._stream = TextStream(tokenizer)
        self._stops = StopMatcher(job.stop)
        self._stop_tokens = frozenset(stop_tokens)
        self._busy_retry = (policy if policy is not None else FailurePolicy()).busy_retry
        self._queue: asyncio.Queue[Piece | Ended] = asyncio.Queue()
        self.handle: SessionHandle = manager.start(
            job.prompt,
            max_new_tokens=job.max_tokens,
            stop_tokens=self._stop_tokens,
            sampler=job.sampler,
            on_token=self._accepted,
            policy=policy,
            speculation=speculation,
        )
        self._ending = asyncio.get_running_loop().create_task(self._end())

    @property
    def session_id(self) -> str:
        return self.handle.session_id

    async def next(self) -> Piece | Ended:
        """The next piece of text, or how it ended (after which nothing more comes)."""
        return await self._queue.get()

    async def collect(self) -> tuple[str, Ended]:
        """The whole text and how it ended."""
        parts: list[str] = []
        while True:
            event = await self.next()
            if isinstance(event, Ended):
                return "".join(parts), event
            parts.append(event.text)

    async def aclose(self) -> None:
        """Cancels the session unless it has ended and waits for its end (its stages are told
        to close it then)."""
        if not self.handle.done:
            self.handle.cancel("the client went away")
        await asyncio.shield(self._ending)

    # -- internals ----------------------------------------------------------------------------

    def _accepted(self, token: int) -> None:
        """Called by the session's driver with each accepted token (must not raise)."""
        if self._clock is not None:
            self._clock.token()
        if token in self._stop_tokens or self._stops.stopped:
            return
        text = self._stops.push(self._stream.push(token))
        if text:
            self._queue.put_nowait(Piece(text))
        if self._stops.stopped:
            self.handle.cancel("a stop string was generated")

    async def _end(self) -> None:
        result = await self.handle.wait()
        if not self._stops.stopped:
            tail = self._stops.push(self._stream.flush())
            tail += self._stops.flush()
            if tail:
                self._queue.put_nowait(Piece(tail))
        self._queue.put_nowait(self._ended(result))

    def _ended(self, result: SessionResult) -> Ended:
        count = len(result.tokens)
        if self._clock is not None:
            self._clock.ended(count, result.route_changes, self.handle.core.reused_positions)
        if self._stops.stopped:
            return Ended("stop", count)
        if result.state is SessionState.DONE:
            return Ended("length" if result.reason is FinishReason.LENGTH else "stop", count)
        if isinstance(result.error, SessionFailed):
            # an overloaded route's client waits the busy worker's hint, else the policy's
            hint = getattr(result.error, "retry_after", None)
            retry_after = hint if hint is not None else self._busy_retry
            error = error_for_failure(result.error, retry_after=retry_after)
            return Ended(None, count, error)
        return Ended(None, count, cancelled=True)
