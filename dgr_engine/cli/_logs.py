"""The programs' log sink (the libraries never add one)."""

from __future__ import annotations

import sys

from loguru import logger

_FORMAT = (
    "<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
    "stage={extra[stage]} session={extra[session]} epoch={extra[epoch]} step={extra[step]} "
    "{message}"
)


def log_to_stderr(level: str) -> None:
    """Sends dgr's log lines at ``level`` and above to stderr, with their session context."""
    logger.remove()
    logger.configure(extra={"stage": "-", "session": "-", "epoch": "-", "step": "-"})
    logger.add(sys.stderr, level=level.upper(), format=_FORMAT)
    logger.enable("dgr_session")
    logger.enable("dgr_engine")
