"""A GGUF copied with some metadata values set and everything else kept: every other key with
its type, every tensor's name, type, shape and bytes.

Three uses: a converter-made fixture gets the ``dgr.fixture`` mark (what makes evidence made on
it fixture evidence), the baseline's negative control gets a changed RoPE base (which must fail
parity), and a DeepSeek V4's MXFP4 experts are replaced by their float32 values (``tensors``).
The copy is written to a temporary file renamed into place.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from dgr_engine.atomic import replacing

_ARCH_KEY = "general.architecture"


def read_value(path: str | os.PathLike[str], key: str) -> Any:
    """The value of metadata ``key`` (``None`` when absent)."""
    field = GGUFReader(path).fields.get(key)
    return None if field is None else field.contents()


def copy_with(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    values: Mapping[str, tuple[Any, GGUFValueType]],
    *,
    without: Collection[str] = (),
    tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Copies ``src`` to ``dst`` with each ``values[key] = (value, type)`` set (added when the
    key is new, replaced when it exists) and the keys in ``without`` left out; each tensor named
    in ``tensors`` is written as that float32 array (same name and place); returns ``dst``."""
    dst = Path(dst)
    if _ARCH_KEY in values or _ARCH_KEY in without:
        raise ValueError(f"{_ARCH_KEY} is not changed by a copy")
    tensors = tensors or {}
    reader = GGUFReader(src)
    unknown = set(tensors) - {t.name for t in reader.tensors}
    if unknown:
        raise ValueError(f"no tensors {sorted(unknown)} to replace in {src}")
    arch = reader.fields[_ARCH_KEY].contents()
    with replacing(dst) as tmp:
        writer = GGUFWriter(tmp, arch, endianess=reader.endianess)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == _ARCH_KEY or name in without:
                continue  # written by the writer itself, or left out
            if name in values:
                value, vtype = values[name]
                writer.add_key_value(name, value, vtype)
                continue
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype is GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
        for name, (value, vtype) in values.items():
            if name not in reader.fields:
                writer.add_key_value(name, value, vtype)
        data = {t.name: _replaced(t.data, tensors.get(t.name)) for t in reader.tensors}
        for tensor in reader.tensors:
            array = data[tensor.name]
            raw = GGMLQuantizationType.F32 if tensor.name in tensors else tensor.tensor_type
            writer.add_tensor_info(
                tensor.name, array.shape, array.dtype, array.nbytes, raw_dtype=raw
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in reader.tensors:
            writer.write_tensor_data(data[tensor.name])
        writer.close()
    return dst


def _replaced(data: np.ndarray, new: np.ndarray | None) -> np.ndarray:
    return data if new is None else np.ascontiguousarray(new, dtype=np.float32)
