"""A lane, exactly: backend x build x hardware class x model identity x recipe.

Two lanes are equal only when every part is; the lane id is the SHA-256 of the lane's
canonical JSON (sorted keys, no spaces), so it is stable across runs and across machines of the
same hardware class. Stage layouts are not part of a lane: the 2-4 and 10+ stage layouts are
certification scenarios (``docs/certification.md``), never product constants, so a certified
lane covers any contiguous layer range of its model.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from dgr_engine.certification.errors import EvidenceInvalid

#: ``LaneKey.batching`` values.
BATCHING_SESSION = "session"
BATCHING_CO_BATCH = "co-batch"
BATCHING_MODES = (BATCHING_SESSION, BATCHING_CO_BATCH)


_OPTIONAL: dict[str, str] = {"batching": BATCHING_SESSION, "family_patch_sha256": ""}
"""Parts left out of the canonical form when they have these values (lanes recorded before the
part existed keep their ids)."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _tuple(values: Any) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class LaneKey:
    """Every part of a lane. Field order is the canonical order of the docs, not of the hash
    (the canonical JSON sorts keys)."""

    backend: str
    """``"cpu"`` (built here), ``"cuda"``, ``"rocm"``, ``"vulkan"``, ``"metal"``."""
    llama_cpp_commit: str
    """Exact llama.cpp commit of the build."""
    patch_stack_sha256: str
    """Hex SHA-256 of the applied patch stack."""
    dgr_version: str
    """dgr's version."""
    build_flags: str
    """The cmake options of the build (``KEY=VALUE;...``)."""
    system_info: str
    """What ggml was compiled to use (instruction sets, OpenMP), from the build itself."""
    hardware: str
    """Hardware class (:func:`~dgr_engine.certification.hardware.hardware_fingerprint`)."""
    model_sha256: str
    """Hex content hash of the GGUF (or of a split manifest)."""
    arch: str
    """GGUF architecture."""
    n_layer: int
    """Main layers of the model."""
    quant_types: tuple[str, ...] = attrs.field(converter=_tuple)
    """Tensor types present in the GGUF, sorted."""
    kv_type: str
    """KV cache element type."""
    flash_attn: str
    """Flash-attention mode (``on``, ``off``, ``auto``)."""
    context_per_session: int
    """KV positions per session."""
    placement: str
    """Where the layers run (``"cpu"``: every owned layer on the CPU backend)."""
    batching: str = BATCHING_SESSION
    """How rows meet the engine: ``"session"`` (each engine call runs one session's rows) or
    ``"co-batch"`` (rows of several sessions in one call, ``dgr worker --batching co-batch``).
    Co-batched rows keep their bits for the tensor types tested (patch 0010), but types that
    llama.cpp repacks for the CPU take other kernels for one row than for several, so a record
    certifies only its own batching. Left out of the canonical form when ``"session"``, so the
    lanes recorded before this field existed keep their ids."""
    family_patch_sha256: str = ""
    """Hex SHA-256 of the family patches of ``arch`` (``patches/`` whose header says
    ``Family: <arch>``), ``""`` when the architecture has none (llama and deepseek4 run on the
    base stack alone). ``patch_stack_sha256`` covers the base stack only, so adding a family's
    patch changes the lanes of that architecture and no other. Left out of the canonical form
    when empty, so the lanes recorded before this field existed keep their ids."""

    def canonical(self) -> dict[str, Any]:
        """The lane as a JSON-ready mapping (lists for tuples)."""
        out = attrs.asdict(self)
        out["quant_types"] = list(self.quant_types)
        for name, absent in _OPTIONAL.items():
            if out[name] == absent:
                del out[name]
        return out

    @property
    def lane_id(self) -> str:
        """SHA-256 (hex) of the canonical JSON."""
        return canonical_sha256(self.canonical())

    def differences(self, other: LaneKey) -> list[str]:
        """Names of the parts in which ``other`` differs from this lane (empty: equal)."""
        mine, theirs = attrs.asdict(self), attrs.asdict(other)
        return [name for name in mine if mine[name] != theirs[name]]

    @classmethod
    def from_canonical(cls, data: Any, *, where: str = "lane") -> LaneKey:
        """The lane of a canonical mapping; :class:`EvidenceInvalid` naming the field that is
        missing, unknown or of the wrong type."""
        if not isinstance(data, Mapping):
            raise EvidenceInvalid(f"{where}: not an object", field=where)
        fields = {a.name: a for a in attrs.fields(cls)}
        for name in data.keys() - fields.keys():
            raise EvidenceInvalid(f"{where}.{name}: unknown field", field=f"{where}.{name}")
        values: dict[str, Any] = {}
        for name in fields:
            if name not in data:
                if name in _OPTIONAL:  # absent: per-session batching, no family patch
                    continue
                raise EvidenceInvalid(f"{where}.{name}: missing", field=f"{where}.{name}")
            value = data[name]
            if name == "quant_types":
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            elif name in ("n_layer", "context_per_session"):
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            elif name == "batching":  # written only when not per-session
                ok = value == BATCHING_CO_BATCH
            elif name == "family_patch_sha256":  # written only when the arch has a family patch
                ok = isinstance(value, str) and _HEX64.match(value) is not None
            else:
                ok = isinstance(value, str)
            if not ok:
                raise EvidenceInvalid(
                    f"{where}.{name}: wrong type or value {value!r}", field=f"{where}.{name}"
                )
            values[name] = value
        return cls(**values)


def canonical_json(data: Any) -> str:
    """JSON with sorted keys and no insignificant whitespace (what hashes are taken of)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_sha256(data: Any) -> str:
    """Hex SHA-256 of :func:`canonical_json`."""
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()
