"""Route sessions from text and back: the prompt (optionally through the model's chat template)
becomes token ids with the model's own tokenizer, generated tokens stream back as text, and a
session stops at the model's end-of-generation tokens or at a stop string (found across token
boundaries; the text is cut before it and the session cancelled, every stage's session
closed). ``dgr_session`` stays token-only; this is the layer above it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from dgr_engine.tokenizer import TextStream, Tokenizer
from dgr_session import SessionHandle, SessionManager

STOPPED_AT_TEXT = "stop text"
"""The reason a session cut at a stop string is cancelled with."""


def until_stop(tokens: Sequence[int], stops: Collection[int]) -> list[int]:
    """``tokens`` up to and including the first of ``stops`` (all of them when none is
    there): what a session that stops at ``stops`` accepts of the same run."""
    out: list[int] = []
    for token in tokens:
        out.append(token)
        if token in stops:
            break
    return out


def prompt_ids(tokenizer: Tokenizer, text: str, *, chat: bool = False) -> list[int]:
    """``text`` as token ids: as is (with the BOS the model wants), or as the user's turn of the
    model's chat template (control tokens written by the template are parsed as such)."""
    if chat:
        return chat_ids(tokenizer, [("user", text)])
    return tokenizer.encode(text)


def chat_ids(tokenizer: Tokenizer, messages: Sequence[tuple[str, str]]) -> list[int]:
    """A conversation, ``(role, content)`` messages oldest first, through the model's chat
    template with the assistant's turn opened: the prompt of its next answer."""
    return tokenizer.encode(tokenizer.chat(messages), parse_special=True)


class StopText:
    """Finds stop strings in text that arrives in pieces: :meth:`push` returns what can be
    shown now (a tail that could begin a stop string waits for the next piece), cut before the
    first stop string found; after that (:attr:`found`) nothing more is returned."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop string cannot be empty")
        self.stops = tuple(stops)
        #: The stop string found (``None``: none yet).
        self.found: str | None = None
        # Text received but not returned: the longest tail that is a prefix of a stop string.
        self._held = ""

    def push(self, piece: str) -> str:
        if self.found is not None:
            return ""
        text = self._held + piece
        hits = [(text.find(stop), stop) for stop in self.stops if stop in text]
        if hits:
            at, first = min(hits)
            # a longer stop string that begins before it may still complete with the next
            # pieces: the text from where it begins waits (the earliest stop string wins)
            pending = [
                j
                for j in range(at)
                if any(len(s) > len(text) - j and s.startswith(text[j:]) for s in self.stops)
            ]
            if not pending:
                self.found, self._held = first, ""
                return text[:at]
            self._held = text[pending[0] :]
            return text[: pending[0]]
        keep = max(
            (k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])),
            default=0,
        )
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is held back, at the end of the text (no stop string can complete now), cut
        before the first stop string it holds."""
        held, self._held = self._held, ""
        hits = [(held.find(stop), stop) for stop in self.stops if stop in held]
        if hits and self.found is None:
            at, self.found = min(hits)
            return held[:at]
        return held


class TextOutput:
    """One session's generated text: tokens in, text out (end-of-generation tokens add none),
    cut before the first stop string. :meth:`push` returns the text that is complete and
    cannot be part of a stop string yet; :meth:`flush` what is left at the end."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop_texts: Sequence[str] = (),
        stop_tokens: Collection[int] = frozenset(),
    ) -> None:
        self._stream = TextStream(tokenizer)
        self._stop = StopText(stop_texts)
        self._stop_tokens = stop_tokens
        #: Every piece returned so far, joined.
        self.text = ""

    @property
    def stopped_at(self) -> str | None:
        """The stop string the text was cut at (``None``: none)."""
        return self._stop.found

    def push(self, token: int) -> str:
        if token in self._stop_tokens:
            return ""
        return self._add(self._stop.push(self._stream.push(token)))

    def flush(self) -> str:
        return self._add(self._stop.push(self._stream.flush()) + self._stop.flush())

    def _add(self, piece: str) -> str:
        self.text += piece
        return piece


def start_text(
    manager: SessionManager,
    tokenizer: Tokenizer,
    text: str | Sequence[int],
    *,
    max_new_tokens: int,
    on_text: Callable[[str], None] | None = None,
    chat: bool = False,
    stop_at_eog: bool = True,
    stop_texts: Sequence[str] = (),
    on_token: Callable[[int], None] | None = None,
    **options: Any,
) -> tuple[SessionHandle, TextOutput]:
    """Starts a session from ``text`` (or prompt token ids already made, e.g.
    :func:`chat_ids`); ``on_text`` gets each piece of generated text as it comes (an
    end-of-generation token adds none; text that could begin one of ``stop_texts`` waits for
    the next token), then ``on_token`` the token itself (every token, the stop token too). At
    a stop string the text is cut before it and the session cancelled
    (:data:`STOPPED_AT_TEXT`). Returns the handle and the output, whose
    :meth:`~TextOutput.flush` gives what is left when the session ends. ``options`` are
    :meth:`SessionManager.start`'s (``sampler``, ``session_id``...)."""
    stops = tokenizer.eog_tokens if stop_at_eog else frozenset()
    output = TextOutput(tokenizer, stop_texts=stop_texts, stop_tokens=stops)
    started: list[SessionHandle] = []  # the handle, once start returned (tokens come later)

    def on_accepted(token: int) -> None:
        stopped = output.stopped_at is not None
        piece = output.push(token)
        if piece and on_text is not None:
            on_text(piece)
        if on_token is not None:
            on_token(token)
        if not stopped and output.stopped_at is not None:
            started[0].cancel(STOPPED_AT_TEXT)

    ids = prompt_ids(tokenizer, text, chat=chat) if isinstance(text, str) else list(text)
    handle = manager.start(
        ids, max_new_tokens=max_new_tokens, stop_tokens=stops, on_token=on_accepted, **options
    )
    started.append(handle)
    return handle, output
