"""Typed refusals of the baseline runner and the converter-made fixtures. Each names what was
refused and why, in one line; none leaves a half-written file behind."""

from __future__ import annotations

from pathlib import Path

from dgr_session.errors import DgrError


class BaselineError(DgrError):
    """Base of the baseline runner's errors; ``path`` is what was refused, when there is one."""

    def __init__(self, message: str, *, path: Path | str | None = None) -> None:
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{message}")
        self.path = None if path is None else Path(path)


class HfModelInvalid(BaselineError, ValueError):
    """The HF directory lacks its config or its weights, or the config is not readable."""


class ArchitectureNotCovered(BaselineError, ValueError):
    """The model's architecture is one the converter or dgr does not cover."""


class ConversionFailed(BaselineError):
    """llama.cpp's converter exited with an error (its last line is the message)."""


class MetadataDisagrees(BaselineError, ValueError):
    """The GGUF's metadata disagrees with the HF config it should have been made from."""


class ExtrasMissing(BaselineError, RuntimeError):
    """``torch``/``transformers`` are not installed: ``pip install 'dgr[baseline]'``."""


class GgufInvalid(BaselineError, ValueError):
    """The model to compare is not there, or not a GGUF file (no ``GGUF`` magic)."""


class V4SaveUnmappable(BaselineError, ValueError):
    """A DeepSeek V4 saved by ``transformers`` holds something the pre-conversion step cannot
    map to the release layout the converter reads (a config key missing, a value llama.cpp does
    not take, a tensor of unknown name)."""


class TokenizerUnknownToConverter(BaselineError, ValueError):
    """The model's tokenizer is one the pinned converter would refuse (its pre-tokenizer hash is
    not in the converter's table)."""
