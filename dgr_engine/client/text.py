"""Route sessions from text and back: the prompt (optionally through the model's chat template)
becomes token ids with the model's own tokenizer, generated tokens stream back as text, and a
session stops at the model's end-of-generation tokens. ``dgr_session`` stays token-only; this is
the layer above it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from dgr_engine.tokenizer import TextStream, Tokenizer
from dgr_session import SessionHandle, SessionManager


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
        return tokenizer.encode(tokenizer.chat([("user", text)]), parse_special=True)
    return tokenizer.encode(text)


def start_text(
    manager: SessionManager,
    tokenizer: Tokenizer,
    text: str,
    *,
    max_new_tokens: int,
    on_text: Callable[[str], None] | None = None,
    chat: bool = False,
    stop_at_eog: bool = True,
    on_token: Callable[[int], None] | None = None,
    **options: Any,
) -> tuple[SessionHandle, TextStream]:
    """Starts a session from ``text``; ``on_text`` gets each complete piece of generated text
    as it comes (an end-of-generation token adds none), then ``on_token`` the token itself
    (every token, the stop token too). Returns the handle and the stream, whose
    :meth:`~TextStream.flush` gives what is left when the session ends."""
    stream = TextStream(tokenizer)
    stops = tokenizer.eog_tokens if stop_at_eog else frozenset()

    def on_accepted(token: int) -> None:
        if token not in stops:
            piece = stream.push(token)
            if piece and on_text is not None:
                on_text(piece)
        if on_token is not None:
            on_token(token)

    handle = manager.start(
        prompt_ids(tokenizer, text, chat=chat),
        max_new_tokens=max_new_tokens,
        stop_tokens=stops,
        on_token=on_accepted,
        **options,
    )
    return handle, stream
