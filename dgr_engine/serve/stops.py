"""Stop strings over streamed text: :class:`StopMatcher` passes text on as it comes, holding
back only the end that could still become a stop string, and cuts the output before the first
stop string it sees (the stop string itself is never sent, as in OpenAI's API)."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text pieces with :meth:`push`; each returns the text that is safe to send now.
    Once a stop string has appeared, :attr:`stopped` is true and nothing more is sent;
    :meth:`flush` gives what was held back when the text ends without one."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop string cannot be empty")
        self.stops = tuple(stops)
        self.stopped = False
        # Invariant: _held is a proper suffix of the text so far that is a prefix of some stop
        # string (the longest such), and it contains no stop string.
        self._held = ""

    def push(self, piece: str) -> str:
        """The text that can be sent after ``piece`` (empty once stopped)."""
        if self.stopped:
            return ""
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = self._longest_open_prefix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What was held back (the text ended without a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_open_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
