"""Loads the compiled cffi module and checks its ABI version against this package's."""

from __future__ import annotations

import importlib
from typing import Any

from dgr_engine.errors import AbiMismatch
from dgr_engine.status import error_for_code

#: The C ABI version this Python package was written against (native/include/dgr_shard.h).
ABI_VERSION = 16

try:
    _native: Any = importlib.import_module("dgr_engine._native")
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "dgr_engine._native is not built: run the README's commands (or "
        "`pip install -e . --no-build-isolation`) to build the patched libllama and the binding"
    ) from exc

ffi: Any = _native.ffi
lib: Any = _native.lib

_runtime = int(lib.dgr_abi_version())
if _runtime != ABI_VERSION or int(lib.DGR_ABI_VERSION) != ABI_VERSION:
    raise AbiMismatch(
        f"dgr_engine._native has ABI version {_runtime} (header {int(lib.DGR_ABI_VERSION)}), "
        f"this package expects {ABI_VERSION}: rebuild the binding"
    )


def status_name(code: int) -> str:
    """The stable name of a C status (``DGR_E_SHAPE``...)."""
    return str(ffi.string(lib.dgr_status_name(code)).decode())


def check_status(code: int) -> None:
    """Raises the typed error of a failed C call (its status, the library's message and, for a
    stale epoch, the epoch held); nothing for ``DGR_OK``."""
    if code != 0:
        message = ffi.string(lib.dgr_last_error()).decode(errors="replace")
        held = int(lib.dgr_last_held_epoch())  # -1 unless the call failed with a stale epoch
        raise error_for_code(int(code), message, held_epoch=held)


LLAMA_COMMIT: str = ffi.string(lib.dgr_llama_commit()).decode()
"""The llama.cpp commit the binding was built from."""
PATCH_STACK_SHA256: bytes = bytes.fromhex(ffi.string(lib.dgr_patch_stack_sha256()).decode())
"""The base patch stack the binding was built with (the patches without a ``Family:`` line;
empty if unknown): what adverts state."""
SUPPORTED_ARCHS: tuple[str, ...] = tuple(ffi.string(lib.dgr_supported_archs()).decode().split(", "))
"""The architectures the binding runs: the base stack's, then those of its family patches."""


def family_patch_sha256(arch: str) -> bytes:
    """The family patch of ``arch`` the binding was built with (SHA-256 over that family's
    patches); empty for an architecture without one (the base stack's, an uncovered one)."""
    return bytes.fromhex(ffi.string(lib.dgr_family_patch_sha256(arch.encode())).decode())


BUILD_FLAGS: str = ffi.string(lib.dgr_build_flags()).decode()
"""The cmake options the patched libllama was built with (``KEY=VALUE;...``, sorted)."""
SYSTEM_INFO: str = ffi.string(lib.dgr_system_info()).decode().strip()
"""What ggml was compiled to use (instruction sets, OpenMP): part of the lane's build."""
