"""Files that appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(dst: str | os.PathLike[str], mode: int = 0o644) -> Iterator[Path]:
    """Yields a temporary path beside ``dst`` (its directory created) to write; when the block
    ends normally the file gets ``mode`` and is renamed over ``dst``, otherwise it is removed, so
    a reader never sees a partial ``dst`` and a failure leaves nothing behind."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(mode)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
