"""A GGUF copied with some metadata values set and everything else kept: every other key with
its type, every tensor's name, type, shape and bytes.

Two uses: a converter-made fixture gets the ``dgr.fixture`` mark (what makes evidence made on it
fixture evidence), and the baseline's negative control gets a changed RoPE base (which must fail
parity). The copy is written to a temporary file renamed into place.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, GGUFWriter

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
) -> Path:
    """Copies ``src`` to ``dst`` with each ``values[key] = (value, type)`` set (added when the
    key is new, replaced when it exists) and the keys in ``without`` left out; returns
    ``dst``."""
    dst = Path(dst)
    if _ARCH_KEY in values or _ARCH_KEY in without:
        raise ValueError(f"{_ARCH_KEY} is not changed by a copy")
    reader = GGUFReader(src)
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
        for tensor in reader.tensors:
            writer.add_tensor_info(
                tensor.name,
                tensor.data.shape,
                tensor.data.dtype,
                tensor.data.nbytes,
                raw_dtype=tensor.tensor_type,
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in reader.tensors:
            writer.write_tensor_data(tensor.data)
        writer.close()
    return dst
