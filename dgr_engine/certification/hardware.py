"""The hardware class a lane names: computed by the worker from the machine it runs on.

A CPU lane's class is the architecture, the CPU model and the instruction-set flags that can
change which kernels run (and so the bits of a result); two machines with the same three are of
the same class. Everything else about the machine (core count, memory, host name) is recorded in
evidence as context but is not part of the class.
"""

from __future__ import annotations

import platform
from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")

RESULT_FLAGS = frozenset(
    {
        # x86
        "sse3",
        "ssse3",
        "sse4_1",
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "bmi2",
        "avx_vnni",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "amx_tile",
        "amx_int8",
        "amx_bf16",
        # arm
        "asimd",
        "asimdhp",
        "asimddp",
        "fphp",
        "i8mm",
        "sve",
        "sve2",
        "bf16",
    }
)
"""Instruction-set flags that select kernels in ggml's CPU backend."""


def _cpuinfo_fields(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # first processor block only
                break
            continue
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def cpu_fingerprint(cpuinfo: str, machine: str) -> str:
    """``ARCH | MODEL | FLAGS`` from the text of ``/proc/cpuinfo`` (first processor)."""
    fields = _cpuinfo_fields(cpuinfo)
    model = fields.get("model name") or fields.get("cpu model") or fields.get("hardware") or "?"
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    kept = " ".join(sorted(flags & RESULT_FLAGS)) or "-"
    return f"{machine} | {' '.join(model.split())} | {kept}"


def hardware_fingerprint() -> str:
    """This machine's hardware class (CPU lanes): see :func:`cpu_fingerprint`. Where
    ``/proc/cpuinfo`` is absent, the platform's processor name stands for the model."""
    machine = platform.machine() or "unknown"
    try:
        text = _CPUINFO.read_text(errors="replace")
    except OSError:
        text = f"model name : {platform.processor() or 'unknown'}\n"
    return cpu_fingerprint(text, machine)
