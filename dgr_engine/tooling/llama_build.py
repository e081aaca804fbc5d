"""dgr's source checkout's ``native/build_llama.py``, for what needs the pinned llama.cpp tree or
its tools at run time (the converter, ``llama-gguf-split``). An installation without the
checkout has neither, and says so in one line."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Final

from dgr_session.errors import DgrError

CHECKOUT: Final = Path(__file__).resolve().parents[2]
BUILD_SCRIPT: Final = CHECKOUT / "native" / "build_llama.py"


class CheckoutMissing(DgrError, RuntimeError):
    """This installation has no source checkout, hence no ``native/build_llama.py``."""


@functools.cache
def build_module() -> ModuleType:
    """``native/build_llama.py`` of the source checkout, as a module (never on ``sys.path``)."""
    if not BUILD_SCRIPT.is_file():
        raise CheckoutMissing(
            "the pinned llama.cpp tree and tools come from native/build_llama.py of dgr's "
            f"source checkout, which this installation lacks ({BUILD_SCRIPT})"
        )
    spec = importlib.util.spec_from_file_location("_dgr_build_llama", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def tool(name: str, log: Callable[[str], None] = lambda _text: None) -> Path:
    """The path of a llama.cpp tool of the pinned, patched build (``llama-gguf-split``), built
    with the library when the cache lacks it."""
    build = build_module()
    prefix = Path(build.ensure_llama(log=log, paths=build.BuildPaths.default(repo_root=CHECKOUT)))
    path = prefix / "bin" / name
    if not path.is_file():
        raise CheckoutMissing(f"the llama.cpp build at {prefix} has no tool {name}")
    return path
