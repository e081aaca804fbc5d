"""``--speculate SOURCE`` and ``--draft-max K``: speculative decoding for ``dgr generate`` and
``dgr chat`` (``docs/speculative.md``, ``docs/generate-and-chat.md``).

A speculating session sends its newest token with up to K drafts through the route in one
pass and keeps the longest run greedy decoding would have picked: the same text as plain greedy
decoding, in fewer passes when the drafts are good. So it is greedy only.

* :func:`add_speculation_arguments`: the two options, read once into
  :class:`SpeculationSettings` at the command's edge.
* :func:`plan_speculation`: checked before any work (the source, the draft
  model's file); :class:`SpeculationPlan`, or ``None`` without ``--speculate``.
* :meth:`SpeculationPlan.check_vocab`: the draft model's vocabulary against the target's GGUF,
  once the route is planned and before any worker starts.
* :meth:`SpeculationPlan.open`: the command's one drafter, on the running route (closed by the
  command at the end); :meth:`SpeculationPlan.session`: each session's own
  :class:`~dgr_session.speculation.Speculation` over it.

Every refusal is :class:`SpeculationRefused` (a :class:`RouteOptionsRefused`: one line, exit 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import attrs

from dgr_engine.argtypes import int_in
from dgr_engine.cli._route import (
    Notice,
    RouteHandle,
    RouteOptionsRefused,
    RouteSettings,
    SamplingSettings,
)
from dgr_engine.errors import EngineError
from dgr_engine.options import EngineOptions
from dgr_session.drafts import DraftConfigError, Drafter, DraftLength, NgramDrafter
from dgr_session.mtp_drafts import MtpDraftRequest
from dgr_session.speculation import MAX_DRAFTS, Speculation

__all__ = [
    "DEFAULT_DRAFT_MAX",
    "SOURCES",
    "SessionCommandSettings",
    "SpeculateSource",
    "SpeculationPlan",
    "SpeculationRefused",
    "SpeculationSettings",
    "add_speculation_arguments",
    "plan_speculation",
    "speculation_line",
]

SOURCES = ("ngram", "draft:PATH", "mtp", "off")
"""``--speculate`` values, as ``--help`` names them."""
DEFAULT_DRAFT_MAX = 8
"""``--draft-max``'s default: the adaptive draft length's ceiling."""


class SpeculationRefused(RouteOptionsRefused):
    """``--speculate`` cannot run as given (an unavailable source, a draft model that
    is missing, unreadable or of another vocabulary): nothing was started, or what was is
    stopped again."""


@attrs.frozen
class SpeculateSource:
    """Where drafts come from."""

    kind: str
    """``ngram``, ``draft``, ``mtp``, or ``off`` (no speculation: where it is on by default)."""
    model: str | None = None
    """``draft``: the draft model as given (a GGUF path or a catalog name)."""

    @classmethod
    def parse(cls, text: str) -> SpeculateSource:
        """The argparse type of ``--speculate`` (an unknown source: one line, exit 2)."""
        kind, sep, model = text.partition(":")
        if kind == "draft" and sep:
            if not model:
                raise argparse.ArgumentTypeError("draft: needs a GGUF or a model name: draft:PATH")
            return cls("draft", model)
        if not sep and kind in _AVAILABILITY:
            return cls(kind)
        raise argparse.ArgumentTypeError(f"unknown source {text!r}: expected {', '.join(SOURCES)}")

    def __str__(self) -> str:
        return self.kind if self.model is None else f"{self.kind}:{self.model}"


def _always(_plan: SpeculateSource) -> str | None:
    return None


_AVAILABILITY: dict[str, Callable[[SpeculateSource], str | None]] = {
    "ngram": _always,
    "draft": _always,
    "mtp": _always,  # the route's last stage must own the block: checked on the route (open)
    "off": _always,
}
"""Per source kind: why it cannot run now (``None``: it can)."""


def add_speculation_arguments(
    p: argparse.ArgumentParser, default: SpeculateSource | None = None
) -> None:
    """``--speculate SOURCE`` (``default`` when not given) and ``--draft-max K``."""
    said = "off" if default is None else str(default)
    p.add_argument(
        "--speculate",
        type=SpeculateSource.parse,
        default=default,
        metavar="SOURCE",
        help="speculative decoding, the same text (greedy or seeded) in fewer passes: ngram "
        "(drafts from the session's own tokens; the draft length adapts, and drafts nothing "
        "while it does not pay), draft:PATH (a draft GGUF, or a catalog model name, with the "
        "model's vocabulary, run in this process), mtp (DeepSeek V4: the route's last stage "
        f"drafts with the model's MTP block) or off (default {said})",
    )
    p.add_argument(
        "--draft-max",
        type=int_in(1, MAX_DRAFTS),
        default=DEFAULT_DRAFT_MAX,
        metavar="K",
        help=f"with --speculate: drafts per pass at most (1..{MAX_DRAFTS}, default "
        f"{DEFAULT_DRAFT_MAX}; the length adapts to what is accepted)",
    )


@attrs.frozen
class SpeculationSettings:
    """:func:`add_speculation_arguments`' options as given: what :func:`plan_speculation`
    checks."""

    source: SpeculateSource | None
    """``--speculate``: where drafts come from (``None``: no speculation)."""
    draft_max: int
    """``--draft-max``: drafts per pass at most."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SpeculationSettings:
        """The settings :func:`add_speculation_arguments` parsed."""
        return cls(args.speculate, args.draft_max)


@attrs.frozen
class SessionCommandSettings:
    """What every command that runs sessions on a route reads (``dgr generate``, ``dgr chat``):
    its route, sampling and speculation options; each command's settings add their own."""

    route: RouteSettings
    """Where the route runs and how."""
    sampling: SamplingSettings
    """How tokens are chosen and when an answer stops."""
    speculation: SpeculationSettings
    """``--speculate`` and ``--draft-max``."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SessionCommandSettings:
        """The three, as parsed; :class:`~dgr_session.sampling.InvalidSamplingParameter` or
        :class:`RouteOptionsRefused` for a value they refuse."""
        return SessionCommandSettings(
            RouteSettings.from_args(args),
            SamplingSettings.from_args(args),
            SpeculationSettings.from_args(args),
        )


@attrs.define(eq=False)
class SpeculationPlan:
    """``--speculate`` checked and resolved; nothing opened yet."""

    source: SpeculateSource
    draft_max: int
    """Drafts per pass at most."""
    draft_model: Path | None
    """``draft``: the draft GGUF."""

    def check_vocab(self, target: Path | None) -> None:
        """Refuses a draft model whose vocabulary size is not ``target``'s (the route's GGUF;
        ``None``: not known here, checked by :meth:`open` against the route)."""
        if self.draft_model is None or target is None:
            return
        from dgr_engine.speculative import DraftVocabMismatch

        draft, wanted = _n_vocab(self.draft_model), _n_vocab(target)
        if draft != wanted:
            mismatch = DraftVocabMismatch(draft, wanted, self.draft_model.name)
            raise SpeculationRefused(f"--speculate {self.source}: {mismatch}")

    def check_model(self, model: Path | None) -> None:
        """Refuses ``mtp`` of a model without an MTP block (a deepseek4 GGUF with
        ``nextn_predict_layers``; ``None``: not known here, checked by :meth:`open` against the
        route's last stage)."""
        if self.source.kind != "mtp" or model is None:
            return
        from dgr_engine.reference import owns_mtp_block

        if not owns_mtp_block(model, (0, -1)):
            raise SpeculationRefused(
                f"--speculate mtp: {model.name} has no MTP block (only a DeepSeek V4 model with "
                "one has it): use ngram or draft:PATH"
            )

    def open(self, route: RouteHandle, options: EngineOptions) -> Drafter:
        """The command's drafter on the running route (its vocabulary: the last stage's output
        width; its context: the route's; a draft model's threads and batch: ``options``'s).
        The caller closes it."""
        if self.source.kind == "mtp":
            last = route.stages[-1]
            if not last.mtp:
                raise SpeculationRefused(
                    f"--speculate mtp: the route's last stage ({last.endpoint}, layers "
                    f"{last.layers[0]}:{last.layers[1]}) does not advertise the model's MTP "
                    "block (only a DeepSeek V4 model with one has it): use ngram or draft:PATH"
                )
            return MtpDraftRequest(self.draft_max)
        if self.draft_model is None:
            return NgramDrafter()
        from dgr_engine.speculative import ModelDrafter

        try:
            return ModelDrafter(
                self.draft_model,
                target_n_vocab=route.n_vocab,
                n_threads=options.n_threads,
                n_ctx=route.context,
                n_batch=options.n_batch,
            )
        except (DraftConfigError, EngineError) as exc:
            raise SpeculationRefused(f"--speculate {self.source}: {exc}") from None

    def session(self, drafter: Drafter) -> Speculation:
        """One session's speculation over ``drafter`` (its own length and counters)."""
        k_max = self.draft_max
        return Speculation(drafter, DraftLength(k_max), k_max)  # two drafts first, then adapts


def plan_speculation(speculation: SpeculationSettings, *, notice: Notice) -> SpeculationPlan | None:
    """Checks ``--speculate`` and ``--draft-max`` before any work; ``None`` without
    ``--speculate`` (or with ``off``). A catalog draft model is fetched if needed (``notice``
    says so)."""
    source = speculation.source
    if source is None or source.kind == "off":
        return None
    unavailable = _AVAILABILITY[source.kind](source)
    if unavailable is not None:
        raise SpeculationRefused(unavailable)
    draft = None if source.model is None else _draft_model(source, notice)
    return SpeculationPlan(source, speculation.draft_max, draft)


def speculation_line(speculation: Speculation) -> str:
    """What a speculating session achieved, in one line."""
    passes = speculation.passes
    per_pass = (passes + speculation.accepted) / passes if passes else 0.0
    return (
        f"speculation {speculation.drafter.name}: {passes} passes  {speculation.drafted} "
        f"drafted  {speculation.accepted} accepted  acceptance {speculation.acceptance:.2f}  "
        f"{per_pass:.2f} tokens per pass"
    )


def _draft_model(source: SpeculateSource, notice: Notice) -> Path:
    from dgr_engine.artifacts.errors import ArtifactError
    from dgr_engine.artifacts.storage import StorageRefused
    from dgr_engine.models import ModelFetchFailed, UnknownModel
    from dgr_engine.models.resolve import resolve_model

    assert source.model is not None
    try:
        return resolve_model(source.model, notice=notice)
    except (UnknownModel, ModelFetchFailed, ArtifactError, StorageRefused) as exc:
        raise SpeculationRefused(f"--speculate {source}: {exc}") from None
    except OSError as exc:  # FileNotFoundError: neither a catalog name nor a file
        text = str(exc) if exc.strerror is None else f"{exc.filename}: {exc.strerror}"
        raise SpeculationRefused(f"--speculate {source}: {text}") from None


def _n_vocab(model: Path) -> int:
    """A GGUF's vocabulary size (its vocabulary only is read)."""
    from dgr_engine.tokenizer import Tokenizer

    try:
        with Tokenizer(model) as vocab:
            return vocab.info.n_vocab
    except EngineError as exc:
        raise SpeculationRefused(f"--speculate: {model}: {exc}") from None
