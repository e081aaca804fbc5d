"""Prompt prefixes kept on a route's stages across sessions: the client's side
(``docs/prefix-cache.md``).

A session that ends asks every stage to keep its prompt's first positions (``keep``); a later
session of the same client on the same stages whose prompt starts with the same tokens opens
from them (``reuse``) and computes only the rest. The rule that keeps this exact: a session
computes its prompt in pinned chunks of ``c`` rows from position 0 (``c``: the route's smallest
``max_rows``, or the whole prompt when it is shorter), and a chunked row's bits depend on its
chunk. So only positions both sessions computed **in the same chunks** are reused: whole
chunks of the same ``c``, within the earlier session's prompt. The reusing session then
computes from a chunk boundary on, in the chunks it would have used anyway: every stage holds
the bits a fresh session fed the same chunks holds, and its tokens are a fresh session's.

:class:`PrefixBook` is what a client asked which route to keep (bounded, least recently used
first out); the stages keep theirs in ``dgr_engine/worker/lifecycle/prefixes.py``, bounded by
their own memory, so a prefix the book names may be gone: a stage then answers that it opened
empty, and the session computes the whole prompt.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

import attrs

from dgr_session.route import Route

__all__ = ["PrefixBook", "PrefixRef", "prefix_digest", "route_key"]

RouteKey = tuple[tuple[str, int, int], ...]
"""A route's stages (endpoint, layer range): a prefix is kept on exactly these."""


@attrs.frozen
class PrefixRef:
    """A kept prefix by name: ``digest`` (:func:`prefix_digest` of its tokens and chunk) and a
    number of its positions (to keep, or to start from)."""

    digest: bytes = attrs.field(repr=lambda d: d.hex()[:16])
    length: int


def prefix_digest(tokens: Sequence[int], chunk: int) -> bytes:
    """The name of the prefix ``tokens`` computed in chunks of ``chunk`` rows."""
    digest = hashlib.sha256(b"dgr prefix v1\0")
    digest.update(struct.pack(f"<I{len(tokens)}i", chunk, *tokens))
    return digest.digest()


def route_key(route: Route) -> RouteKey:
    return tuple((s.endpoint, s.layer_begin, s.layer_end) for s in route.stages)


def keep_length(prompt_length: int, chunk: int) -> int:
    """The positions of a prompt of ``prompt_length`` tokens computed in whole chunks."""
    return prompt_length // chunk * chunk


@attrs.frozen
class _Kept:
    tokens: tuple[int, ...]
    chunk: int
    digest: bytes


class PrefixBook:
    """What this client asked the stages of each route to keep, at most ``capacity`` prefixes
    (least recently used first out)."""

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._kept: OrderedDict[tuple[RouteKey, bytes], _Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def to_keep(self, prompt: Sequence[int], chunk: int) -> PrefixRef | None:
        """What a session of ``prompt`` computed in chunks of ``chunk`` asks its stages to keep
        as it ends (``None``: not one whole chunk)."""
        length = keep_length(len(prompt), chunk)
        if length < 1:
            return None
        return PrefixRef(prefix_digest(prompt[:length], chunk), length)

    def kept(self, route: RouteKey, prompt: Sequence[int], chunk: int, keep: PrefixRef) -> None:
        """The stages of ``route`` were asked to keep ``keep`` of ``prompt``."""
        entry = _Kept(tuple(prompt[: keep.length]), chunk, keep.digest)
        self._kept[(route, keep.digest)] = entry
        self._kept.move_to_end((route, keep.digest))
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def find(self, route: RouteKey, prompt: Sequence[int], chunk: int) -> PrefixRef | None:
        """The longest kept prefix of ``prompt`` on ``route`` a session computing it in chunks
        of ``chunk`` may start from: whole chunks of the same size that both share, leaving
        at least one prompt token to compute (``None``: no whole chunk)."""
        best: tuple[int, bytes, tuple[RouteKey, bytes]] | None = None
        most = (len(prompt) - 1) // chunk * chunk
        for key, entry in self._kept.items():
            if key[0] != route or entry.chunk != chunk:
                continue
            shared = _common_length(entry.tokens, prompt, min(len(entry.tokens), most))
            length = shared // chunk * chunk
            if length >= chunk and (best is None or length > best[0]):
                best = (length, entry.digest, key)
        if best is None:
            return None
        self._kept.move_to_end(best[2])
        return PrefixRef(best[1], best[0])


def _common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
