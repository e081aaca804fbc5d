"""The programs' log sink (the libraries never add one)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from loguru import logger

from dgr_session.identifiers import log_field

if TYPE_CHECKING:
    from loguru import Record

_FORMAT = (
    "<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
    "stage={extra[stage]} session={extra[session]} epoch={extra[epoch]} step={extra[step]} "
    "{message}"
)
_FIELD_LIMIT = 1000
"""Characters of one bound field a line keeps."""


def _escape_fields(record: Record) -> None:
    """Every bound text field as one safe field (``log_field``): whatever a caller bound, a
    line break in it can never forge a line of its own (the call sites escape what peers
    send as well; this holds for any other)."""
    extra = record["extra"]
    for key, value in extra.items():
        if isinstance(value, str):
            extra[key] = log_field(value, limit=_FIELD_LIMIT)


def log_to_stderr(level: str) -> None:
    """Sends dgr's log lines at ``level`` and above to stderr, with their session context."""
    logger.remove()
    logger.configure(
        extra={"stage": "-", "session": "-", "epoch": "-", "step": "-"}, patcher=_escape_fields
    )
    logger.add(sys.stderr, level=level.upper(), format=_FORMAT)
    logger.enable("dgr_session")
    logger.enable("dgr_engine")
