"""The one rule for identifiers that cross the wire or reach a log: session ids.

A session id travels as gRPC metadata (``dgr-session``), as a protobuf string, inside grants and
usage records, and into every log line of every stage it touches. gRPC metadata values must be
printable ASCII; a log field must not carry a line break. So client and worker check the same
rule, at their API boundary, before any call: at most :data:`SESSION_ID_MAX_LENGTH`
characters of ``A-Z a-z 0-9 . _ : -``, not empty. What fails it is refused with
:class:`InvalidIdentifier` (a ``ValueError``): the caller's mistake, never a stage's fault.

:func:`log_field` renders any value for a log line with control characters escaped, so text a
peer sent can never forge a line of its own.
"""

from __future__ import annotations

import re
from typing import ClassVar

from dgr_session.errors import DgrError
from dgr_session.faults import FaultKind

SESSION_ID_MAX_LENGTH = 128
"""The longest session id accepted (a UUID's hex is 32)."""

SESSION_ID_ALPHABET = "A-Z a-z 0-9 . _ : -"
"""The characters a session id may hold, as the refusals name them."""

_SESSION_ID = re.compile(r"[A-Za-z0-9._:\-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class InvalidIdentifier(DgrError, ValueError):
    """An identifier breaks :mod:`dgr_session.identifiers`' rule (names ``what`` and ``why``).

    Raised before anything is sent or opened: nothing changed anywhere, no stage is blamed (its
    fault kind is ``client``). A session started with such an id never starts
    (``SessionManager.start`` raises it); one that exists lives on.
    """

    fault_kind: ClassVar[FaultKind] = FaultKind.CLIENT

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"invalid {what}: {why}")
        #: Which identifier (``"session id"``).
        self.what = what
        #: Why it is refused.
        self.why = why


def check_session_id(value: object) -> str:
    """``value`` if it is a valid session id, else :class:`InvalidIdentifier`."""
    if not isinstance(value, str):
        raise InvalidIdentifier("session id", f"a str is needed, got {type(value).__name__}")
    if not value:
        raise InvalidIdentifier("session id", "empty")
    if len(value) > SESSION_ID_MAX_LENGTH:
        raise InvalidIdentifier(
            "session id", f"{len(value)} characters, at most {SESSION_ID_MAX_LENGTH}"
        )
    if _SESSION_ID.fullmatch(value) is None:
        bad = next(c for c in value if _SESSION_ID.fullmatch(c) is None)
        raise InvalidIdentifier(
            "session id", f"character {bad!r} is not one of {SESSION_ID_ALPHABET}"
        )
    return value


def is_valid_session_id(value: object) -> bool:
    """True when :func:`check_session_id` accepts ``value``."""
    try:
        check_session_id(value)
    except InvalidIdentifier:
        return False
    return True


def log_field(value: object, *, limit: int = 200) -> str:
    """``value`` as one safe log field: control characters (line breaks included) escaped as
    ``\\xNN``/``\\uNNNN``, and at most ``limit`` characters (an ellipsis marks a cut)."""
    text = value if isinstance(value, str) else repr(value)
    text = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    return text if len(text) <= limit else text[: limit - 1] + "…"
