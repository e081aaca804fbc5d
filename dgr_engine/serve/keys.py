"""API keys of ``dgr serve`` (``--api-key``, ``--api-key-file``, ``DGR_API_KEY``): a request to
the API must carry one in ``Authorization: Bearer KEY``, as OpenAI's clients send it.

A presented key is compared with every key the server holds, by SHA-256 digest and
``hmac.compare_digest``, each comparison made whatever the others found: the time an answer
takes says nothing of how much of a key was right, nor of which key or how long it is.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

KEY_ENV = "DGR_API_KEY"
"""The environment variable read for keys (several: separated by commas)."""

_BEARER = "bearer "


class ApiKeyError(ValueError):
    """A key that cannot be one (empty, not text, spaces inside), or a key file that cannot be
    read: the server does not start."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@attrs.frozen
class ApiKeys:
    """The keys a server accepts (at least one)."""

    _digests: tuple[bytes, ...] = attrs.field(alias="digests", repr=False)

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys | None:
        """The keys given (``None`` when none: the API is open); :class:`ApiKeyError` for one
        that is empty or holds whitespace or anything but printable ASCII."""
        held: list[bytes] = []
        for key in keys:
            printable = key.isascii() and key.isprintable() and not any(c.isspace() for c in key)
            if not key or not printable:  # never shown: even a bad key may be half a secret
                raise ApiKeyError(
                    "an API key must be printable ASCII without spaces, got "
                    + (f"one of {len(key)} characters that is not" if key else "an empty one")
                )
            held.append(_digest(key))
        return cls(digests=tuple(dict.fromkeys(held))) if held else None

    @classmethod
    def gathered(
        cls,
        keys: Iterable[str] = (),
        files: Iterable[Path] = (),
        environ: Mapping[str, str] = os.environ,
    ) -> ApiKeys | None:
        """Every key of ``--api-key``, of each ``--api-key-file`` (one a line; blank lines and
        lines starting with ``#`` skipped) and of ``DGR_API_KEY`` (comma-separated)."""
        gathered = list(keys)
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise ApiKeyError(f"cannot read the API key file {path}: {why}") from None
            lines = (line.strip() for line in text.splitlines())
            gathered += [line for line in lines if line and not line.startswith("#")]
        gathered += [k.strip() for k in environ.get(KEY_ENV, "").split(",") if k.strip()]
        return cls.of(gathered)

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header's value carries one of the keys (``Bearer``,
        in any case). Every key is compared, in constant time each."""
        if authorization is None or not authorization[: len(_BEARER)].lower() == _BEARER:
            presented = _digest("")  # still compared: a missing key costs what a wrong one does
        else:
            presented = _digest(authorization[len(_BEARER) :].strip())
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(digest, presented)
        return found


__all__ = ["KEY_ENV", "ApiKeyError", "ApiKeys"]
