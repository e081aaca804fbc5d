"""How a test transport holds, delays, releases or fails an endpoint's replies."""

from __future__ import annotations

import asyncio

import attrs


@attrs.define
class ReplyGate:
    """Holds one endpoint's replies, for test transports: while the endpoint *hangs*, until
    :meth:`release` (delivered late) or :meth:`fail` (the connection drops); otherwise for the
    transport's latency in loop time (a reply still waits if the endpoint hangs meanwhile)."""

    hanging: bool = False
    """Replies are held until released or failed."""
    _held: list[asyncio.Future[None]] = attrs.Factory(list)

    async def pass_through(self, latency: float) -> None:
        """Returns when the reply may be delivered; raises what :meth:`fail` was given."""
        if not self.hanging and latency <= 0:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._held.append(future)
        if not self.hanging:
            loop.call_later(latency, self._deliver, future)
        await future

    def release(self) -> None:
        """Stop hanging; held replies are delivered now (late)."""
        self.hanging = False
        for future in self._held:
            if not future.done():
                future.set_result(None)
        self._held.clear()

    def fail(self, error: BaseException) -> None:
        """Stop hanging; held replies fail with ``error``."""
        self.hanging = False
        for future in self._held:
            if not future.done():
                future.set_exception(error)
        self._held.clear()

    def pending(self) -> int:
        """Replies not delivered yet."""
        return sum(1 for future in self._held if not future.done())

    def _deliver(self, future: asyncio.Future[None]) -> None:
        # The latency elapsed: deliver, unless the endpoint hangs now (then it waits for release).
        if not future.done() and not self.hanging:
            future.set_result(None)
            self._held.remove(future)
