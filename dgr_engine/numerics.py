"""The numerics options that decide how exactly an engine computes: the KV cache element type
and the flash-attention mode.

Both are part of a lane (``LaneKey.kv_type``, ``LaneKey.flash_attn``) and of a route's recipe:
every stage of one route runs the same pair, and a split is bit-identical to the whole model only
at equal settings. Defaults are llama.cpp's own (f16 KV, flash attention auto); ``docs/numerics.md``
says what each choice costs in error and speed, measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import attrs

from dgr_engine._binding import lib
from dgr_engine.errors import InvalidArgument

KV_TYPES: Final = ("f16", "f32", "q8_0")
"""KV cache element types, llama.cpp's default first."""
FLASH_ATTN_MODES: Final = ("auto", "off", "on")
"""Flash-attention modes, llama.cpp's default first."""

_KV_TO_ABI: Final = {"f16": lib.DGR_KV_F16, "f32": lib.DGR_KV_F32, "q8_0": lib.DGR_KV_Q8_0}
_FA_TO_ABI: Final = {
    "auto": lib.DGR_FLASH_ATTN_AUTO,
    "off": lib.DGR_FLASH_ATTN_OFF,
    "on": lib.DGR_FLASH_ATTN_ON,
}


def _one_of(choices: tuple[str, ...]) -> Callable[[Any, attrs.Attribute[str], str], None]:
    def check(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in choices:
            raise InvalidArgument(
                f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}"
            )

    return check


@attrs.frozen
class Numerics:
    """A KV cache type and a flash-attention mode. ``InvalidArgument`` for anything else."""

    kv_type: str = attrs.field(default=KV_TYPES[0], validator=_one_of(KV_TYPES))
    flash_attn: str = attrs.field(default=FLASH_ATTN_MODES[0], validator=_one_of(FLASH_ATTN_MODES))

    @property
    def abi_kv_type(self) -> int:
        """The ``dgr_engine_params.kv_type`` value."""
        return int(_KV_TO_ABI[self.kv_type])

    @property
    def abi_flash_attn(self) -> int:
        """The ``dgr_engine_params.flash_attn`` value."""
        return int(_FA_TO_ABI[self.flash_attn])

    @property
    def exact(self) -> bool:
        """f32 KV and flash attention off: the setting at which a whole model matches its
        float32 reference to float32 noise (``docs/numerics.md``)."""
        return self.kv_type == "f32" and self.flash_attn == "off"

    def __str__(self) -> str:
        return f"kv {self.kv_type}, flash attention {self.flash_attn}"


EXACT: Final = Numerics(kv_type="f32", flash_attn="off")
"""The exact setting (see :attr:`Numerics.exact`)."""
