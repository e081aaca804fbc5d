"""A model given on a command line: a catalog name (fetched and verified when needed) or the
path of a GGUF file."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from dgr_engine.models.catalog import CATALOG, lookup
from dgr_engine.models.fetch import (
    ModelNotFetched,
    ProgressFn,
    fetch_model,
    model_path,
    models_root,
)


def resolve_model(
    given: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    notice: Callable[[str], None] | None = None,
    progress: ProgressFn | None = None,
) -> Path:
    """The GGUF ``given`` names: a catalog name (``dgr models list``), taken from the models
    directory (``root``, else the default: :func:`~dgr_engine.models.fetch.models_root`) or
    fetched there first, with ``notice`` told so and ``progress(name, done, total)`` the
    bytes downloaded and verified; else an existing file.
    :class:`~dgr_engine.models.catalog.UnknownModel` (which lists the catalog) for a name
    that is neither, ``FileNotFoundError`` for a path that does not exist (``IsADirectoryError``:
    a directory)."""
    text = os.fspath(given)
    if text in CATALOG:
        model = lookup(text)
        folder = models_root(root)
        try:
            return model_path(model, folder)
        except ModelNotFetched:
            if notice is not None:
                notice(f"fetching {model.name} ({model.size / 2**20:.0f} MiB) into {folder}")
            path, _report = fetch_model(model, folder, notice=notice, progress=progress)
            return path
    path = Path(text)
    if path.is_dir():
        raise IsADirectoryError(f"{text}: a directory, not a GGUF file")
    if path.exists():  # a file (or what storage offers as one: the loader reads it)
        return path
    if path.suffix == ".gguf" or os.sep in text:
        raise FileNotFoundError(f"{text}: no such GGUF file")
    lookup(text)  # not a catalog name either: UnknownModel, naming the catalog
    raise AssertionError("unreachable")
