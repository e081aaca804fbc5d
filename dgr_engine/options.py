"""Engine options: one frozen value that renders both the ``ShardEngine`` keyword arguments and
the ``dgr worker`` command line, so an in-process engine and a worker process built from the
same options compute the same bits.

Its field defaults are dgr's one set of engine defaults: ``dgr worker``, ``generate``,
``serve``, ``chat``, ``certify`` and ``demo`` all use them, so a worker started by hand with
defaults runs the lane ``dgr certify`` certifies with defaults (the context per session is part
of the lane), which is the lane of the committed real-hardware records of SmolLM2."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from dgr_engine.argtypes import int_in
from dgr_engine.certification.lane import BATCHING_MODES
from dgr_engine.numerics import FLASH_ATTN_MODES, KV_TYPES, Numerics


def _numerics(instance: EngineOptions, attribute: attrs.Attribute[str], value: str) -> None:
    Numerics(**{attribute.name: value})  # InvalidArgument (a ValueError) names the choices


def _one_of(instance: EngineOptions, attribute: attrs.Attribute[str], value: str) -> None:
    choices = attribute.metadata["choices"]
    if value not in choices:
        raise ValueError(f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}")


def _choice(
    default: str,
    flag: str,
    help: str,
    choices: tuple[str, ...],
    *,
    doc: str = "docs/numerics.md",
    validator: Any = _numerics,
) -> Any:
    return attrs.field(
        default=default,
        validator=validator,
        metadata={"flag": flag, "help": help, "choices": choices, "doc": doc, "lane": True},
    )


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


def _option(default: int, flag: str, help: str, most: int, *, lane: bool = False) -> Any:
    return attrs.field(
        default=default,
        validator=_positive,
        metadata={"flag": flag, "help": help, "most": most, "lane": lane},
    )


@attrs.frozen
class EngineOptions:
    """How a shard engine is set up. The defaults are the one set every ``dgr`` command uses
    (the module's docstring says why)."""

    n_threads: int = _option(1, "--threads", "engine threads", 1024)
    """Threads of the engine's compute."""
    n_ctx_per_session: int = _option(
        256, "--ctx", "KV positions per session (part of the lane)", 1 << 24, lane=True
    )
    """KV positions each session may hold (part of the lane: a record certifies one context)."""
    n_batch: int = _option(64, "--batch", "most rows per forward", 1 << 20)
    """Most rows one forward may carry (also the micro-batch: rows are never split)."""
    max_sessions: int = _option(8, "--max-sessions", "sessions held at once", 256)
    """Session slots of the engine."""
    kv_type: str = _choice(KV_TYPES[0], "--kv-type", "KV cache element type", KV_TYPES)
    """KV cache element type (``docs/numerics.md``); every stage of a route runs the same."""
    flash_attn: str = _choice(
        FLASH_ATTN_MODES[0], "--flash-attn", "flash-attention mode", FLASH_ATTN_MODES
    )
    """Flash-attention mode (``docs/numerics.md``); every stage of a route runs the same."""
    batching: str = _choice(
        BATCHING_MODES[0],
        "--batching",
        "how sessions' rows meet the engine: one session per engine call, or co-batch the "
        "frames of sessions that wait together into one call (part of the lane)",
        BATCHING_MODES,
        doc="docs/worker.md",
        validator=_one_of,
    )
    """``"session"`` (one session's rows per engine call) or ``"co-batch"`` (frames of several
    sessions in one call: ``dgr_engine.worker.engine_access.co_batch``; the lane's ``batching``)."""

    @property
    def numerics(self) -> Numerics:
        """The KV type and flash-attention mode."""
        return Numerics(kv_type=self.kv_type, flash_attn=self.flash_attn)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~dgr_engine.engine.ShardEngine`."""
        return {
            "max_sessions": self.max_sessions,
            "n_ctx_per_session": self.n_ctx_per_session,
            "n_threads": self.n_threads,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_batch,
            "numerics": self.numerics,
        }

    def worker_argv(self) -> list[str]:
        """The ``dgr worker`` arguments that set up the same engine."""
        argv: list[str] = []
        for field in attrs.fields(EngineOptions):
            argv += [field.metadata["flag"], str(getattr(self, field.name))]
        return argv

    def lane_argv(self) -> list[str]:
        """The arguments of the options that are part of the lane (context, KV type,
        flash-attention, batching) where they differ from the defaults: what ``dgr certify``
        needs to certify the lane these options run."""
        argv: list[str] = []
        for field in attrs.fields(EngineOptions):
            value = getattr(self, field.name)
            if field.metadata["lane"] and value != field.default:
                argv += [field.metadata["flag"], str(value)]
        return argv

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, **defaults: int | str) -> None:
        """Adds one option per field to ``parser``, defaulting to the field defaults (dgr's one
        set). ``defaults`` overrides them by name; no ``dgr`` command does (deprecated: a
        program with other defaults runs another lane than ``dgr certify`` certifies)."""
        for field in attrs.fields(EngineOptions):
            default = defaults.get(field.name, field.default)
            if "choices" in field.metadata:
                parser.add_argument(
                    field.metadata["flag"],
                    dest=field.name,
                    choices=field.metadata["choices"],
                    default=default,
                    help=f"{field.metadata['help']} (default {default}; {field.metadata['doc']})",
                )
                continue
            parser.add_argument(
                field.metadata["flag"],
                dest=field.name,
                type=int_in(1, field.metadata["most"]),
                metavar="N",
                default=default,
                help=f"{field.metadata['help']} (default {default})",
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options :meth:`add_arguments` parsed."""
        return cls(**{field.name: getattr(args, field.name) for field in attrs.fields(cls)})
