"""Where model artifacts may live (issue 14's storage policy).

The root is always explicit: a flag, else ``$DGR_STORAGE_ROOT``; there is no default. It is
resolved with symlinks followed, then refused when it lies under ``/home`` (the specification:
"no model artifact may be placed under /home"), inside dgr's source checkout, or in a temporary
directory unless the caller allows that (tests do). Free space is checked before anything is
fetched. Every refusal is one line naming the root and the rule.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from dgr_session.errors import DgrError

STORAGE_ENV: Final = "DGR_STORAGE_ROOT"
_CHECKOUT: Final = Path(__file__).resolve().parents[2]
_HOME: Final = Path("/home")


class StorageRefused(DgrError, ValueError):
    """A storage root the policy refuses, or one without room for what is to be fetched."""


def _temp_dirs() -> list[Path]:
    found = {Path(tempfile.gettempdir()).resolve(), Path("/tmp").resolve(), Path("/var/tmp")}
    return sorted(found)


def storage_root(
    flag: str | os.PathLike[str] | None,
    *,
    allow_temp: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """The storage root: ``flag``, else ``$DGR_STORAGE_ROOT``, resolved; :class:`StorageRefused`
    when neither is given or the root breaks the policy."""
    env = os.environ if environ is None else environ
    given = flag if flag is not None else env.get(STORAGE_ENV)
    if not given:
        raise StorageRefused(
            f"no storage root: pass --root or set {STORAGE_ENV} (model artifacts go to "
            "mounted-drive storage, never a default)"
        )
    root = Path(given).expanduser().resolve()
    if root == _HOME or root.is_relative_to(_HOME):
        raise StorageRefused(f"storage root {root} is under /home: no model artifact may be there")
    checkout = _CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() else None
    if checkout is not None and (root == checkout or root.is_relative_to(checkout)):
        raise StorageRefused(f"storage root {root} is inside dgr's source checkout {checkout}")
    if not allow_temp:
        for temp in _temp_dirs():
            if root == temp or root.is_relative_to(temp):
                raise StorageRefused(
                    f"storage root {root} is in the temporary directory {temp} (allowed for "
                    "tests only)"
                )
    return root


def check_free_space(root: Path, need_bytes: int) -> None:
    """:class:`StorageRefused` unless the filesystem of ``root`` (or its nearest existing
    parent) has ``need_bytes`` free."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise StorageRefused(
            f"storage root {root} has {free / 2**30:.2f} GiB free, {need_bytes / 2**30:.2f} GiB "
            "are needed"
        )
