"""The route a command runs over, shared by ``dgr generate``, ``dgr chat`` and ``dgr serve``.

* :func:`add_route_arguments` / :func:`add_sampling_arguments`: the options every such command
  takes (where the workers are, which model, the engine options, the lock and evidence, TLS,
  the transport; temperature, top-p, top-k, seed, stop strings, the token limit), read once
  into :class:`RouteSettings` and :class:`SamplingSettings` at the command's edge
  (``from_args``): nothing below the edge sees the ``argparse.Namespace``.
* :func:`plan_route`: the command line checked and resolved before any work (the model fetched
  or built, numbers checked, the lock read, the tokenizer opened): :class:`RoutePlan`, or
  :class:`RouteOptionsRefused` in one line.
* :func:`open_route`: an async context manager that starts the spawned workers or dials the
  given endpoints and yields a :class:`RouteHandle` (the ``SessionManager``, the tokenizer, the
  stages); on exit, also on cancellation and Ctrl-C, every session is cancelled and closed,
  every spawned worker stopped and the tokenizer closed. A worker that cannot be started or an
  endpoint that does not answer is :class:`RouteStartFailed`, whose text says why (a failed
  worker's last log lines included).

Commands print either error as ``dgr COMMAND: <text>`` on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from dgr_engine.argtypes import float_in, int_in
from dgr_engine.certification.verify import LockVerifier
from dgr_engine.cli._own_model import OwnLaneRefused, applies, settle_own_lane, terminal_yes
from dgr_engine.client.chained import DATA_PATHS, ChainStageTransport
from dgr_engine.client.path_choice import PathChoice, StageOffer, choose_path
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.route_modes import DataPath, RouteMode
from dgr_engine.client.routes import EndpointRouteProvider, describe
from dgr_engine.engine.sampling import SeededSampler
from dgr_engine.errors import EngineError, ShardError
from dgr_engine.options import EngineOptions
from dgr_engine.security.tls import ClientTls
from dgr_engine.tokenizer import Tokenizer
from dgr_engine.wire.advert import Advert
from dgr_session import EvidenceClass, FailurePolicy, SessionManager
from dgr_session.errors import DgrError
from dgr_session.prefixes import PrefixBook
from dgr_session.sampling import InvalidSamplingParameter, Sampler, Sampling, greedy
from dgr_session.transport import RouteProvider

if TYPE_CHECKING:
    from dgr_engine.tooling.loopback import LoopbackRouteProvider

__all__ = [
    "TRANSPORTS",
    "ContextExceeded",
    "PREFILL_NOTICE_SECONDS",
    "Notice",
    "RouteHandle",
    "RoutePlan",
    "RouteOptionsRefused",
    "RouteSettings",
    "RouteStage",
    "RouteStartFailed",
    "SamplingSettings",
    "add_route_arguments",
    "add_sampling_arguments",
    "failure_line",
    "open_route",
    "plan_route",
    "token_budget",
]

TRANSPORTS = tuple(str(m) for m in RouteMode)
"""``--transport`` values: how a token's frames travel along the route."""

Notice = Callable[[str], None]
"""Where progress lines go (``"starting 3 workers"``); commands print them on stderr."""

PREFILL_NOTICE_SECONDS = 1.0
"""A prompt whose first token takes longer than this is said to be prefilling."""


def _silent(_text: str) -> None:
    pass


class RouteOptionsRefused(DgrError, ValueError):
    """The command line names a route that cannot be run (a bad number, a missing model, an
    unreadable lock, TLS given by halves): nothing was started."""


class RouteStartFailed(DgrError, RuntimeError):
    """A spawned worker did not start (its text carries the worker's last log lines) or a
    given endpoint did not answer; whatever had been started is stopped again."""


class ContextExceeded(DgrError, ValueError):
    """A prompt leaves no room for a new token in the route's context (the smallest stage's
    KV positions per session): nothing was sent."""


# -- the command line ---------------------------------------------------------------------------


def add_route_arguments(p: argparse.ArgumentParser, *, sessions: bool = True) -> None:
    """Where the route runs and how: the workers, the model, the engine options, trust.
    ``sessions``: the command runs several sessions (chat, serve), which may start from the
    prompt prefixes earlier ones left (``--prefix-cache``); a command of one session (generate)
    keeps none."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", help="H:P,H:P,... workers already running, in route order")
    where.add_argument(
        "--spawn",
        type=int_in(1, 4096),
        metavar="N",
        help="start N workers on 127.0.0.1 over even layer ranges (stopped at the end)",
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        metavar="NAME|GGUF",
        help="a real model of the catalog by name (fetched if needed) or a GGUF file (for "
        "--spawn and the tokenizer)",
    )
    model.add_argument("--fixture", help="a generated fixture by name (built if missing)")
    p.add_argument(
        "--vocab",
        type=Path,
        default=None,
        help="the GGUF whose tokenizer to use with --endpoints (default: --model's)",
    )
    EngineOptions.add_arguments(p)
    p.add_argument(
        "--step-deadline",
        type=float_in(0.001, 86_400.0),
        default=10.0,
        metavar="SECONDS",
        help="seconds per step (default 10)",
    )
    p.add_argument(
        "--require",
        choices=[c.value for c in EvidenceClass],
        default=EvidenceClass.REAL_HARDWARE.value,
        help="evidence class every stage's lane must be certified at (default real-hardware)",
    )
    p.add_argument(
        "--evidence",
        type=Path,
        default=None,
        help="evidence directory the --spawn workers read (default: the worker's default, then "
        "your operator lock's for your own model: docs/serve.md)",
    )
    if sessions:
        p.add_argument(
            "--prefix-cache",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="start a session from the prompt prefix an earlier one of this command left "
            "on the stages (a conversation's next turn; exact: docs/prefix-cache.md; default "
            "on)",
        )
    else:
        p.set_defaults(prefix_cache=False)
    p.add_argument(
        "--certify",
        action="store_true",
        help="with --spawn on your own model: when no record of its lane on this machine "
        "counts, certify it first under your own operator lock (made once, outside the "
        "checkout; about a minute for a small model; docs/serve.md)",
    )
    p.add_argument(
        "--lock",
        type=Path,
        default=None,
        help="the lock the client checks every stage's record against, and --spawn workers "
        "load theirs under (default: $DGR_LOCK, else certification/lock.json)",
    )
    p.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        help="with --endpoints: dial over TLS, trusting this CA",
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="...showing this client certificate")
    p.add_argument("--tls-key", type=Path, default=None, help="...and its key (mutual TLS)")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="auto: the fastest mode the stages offer, a ring (default; the command says what it"
        " chose); relay: this client sends every stage its frame; chain: each stage sends its"
        " output straight to the next, the last answers here; ring: a chain whose last stage"
        " also takes each token and sends the next frame to the first (docs/chain.md)",
    )
    p.add_argument(
        "--data-path",
        choices=[str(p) for p in DATA_PATHS],
        default="auto",
        help="with a chain or ring: the data path that carries each stage's link to the next;"
        " auto: the fastest every stage offers (native for a ring's session that drafts"
        " nothing, sealed over TLS, else frame, else grpc; default); frame, native: required;"
        " grpc (docs/data-paths.md, docs/glossary.md)",
    )


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_tokens_help: str) -> None:
    """How tokens are chosen and when generation stops (:class:`SamplingSettings`)."""
    p.add_argument(
        "--temperature",
        type=float_in(0.0, 1000.0),
        default=0.0,
        metavar="T",
        help="softmax temperature; 0 (the default) is greedy: the largest logit, the whole "
        "model's token",
    )
    p.add_argument(
        "--top-p",
        type=float_in(0.0, 1.0),
        default=1.0,
        metavar="P",
        help="nucleus sampling: keep the most likely tokens whose probability adds up to P "
        "(0 < P <= 1; default 1: all)",
    )
    p.add_argument(
        "--top-k",
        type=int_in(0, 1 << 24),
        default=0,
        metavar="K",
        help="keep only the K most likely tokens (default 0: all)",
    )
    p.add_argument(
        "--seed",
        type=int_in(0, (1 << 63) - 1),
        default=None,
        metavar="N",
        help="seed of the sampler: the same seed gives the same text on every route, mode and "
        "data path (docs/sampling.md; default: a random one, reported with the result)",
    )
    p.add_argument(
        "--min-p",
        type=float_in(0.0, 1.0),
        default=0.0,
        metavar="P",
        help="drop tokens less likely than P times the most likely (default 0: none)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float_in(-2.0, 2.0),
        default=0.0,
        metavar="X",
        help="subtract X from every token of the last --penalty-last-n (OpenAI's; default 0)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float_in(-2.0, 2.0),
        default=0.0,
        metavar="X",
        help="subtract X per time a token occurs in the last --penalty-last-n (OpenAI's; "
        "default 0)",
    )
    p.add_argument(
        "--repeat-penalty",
        type=float_in(0.0, 100.0),
        default=1.0,
        metavar="X",
        help="divide the positive logits of the last --penalty-last-n tokens by X, multiply "
        "the others (llama.cpp's; default 1: none)",
    )
    p.add_argument(
        "--penalty-last-n",
        type=int_in(0, 1 << 24),
        default=64,
        metavar="N",
        help="the tokens the penalties look back at (default 64)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when the output contains TEXT (cut before it; repeatable)",
    )
    p.add_argument(
        "-n",
        "--max-tokens",
        "--max-new-tokens",
        dest="max_tokens",
        type=int,
        default=None,
        metavar="N",
        help=max_tokens_help,
    )


@attrs.frozen
class RouteSettings:
    """:func:`add_route_arguments`' options as given (argparse's types checked, nothing else):
    what :func:`plan_route` checks and resolves."""

    endpoints: str | None
    """``--endpoints``: ``H:P,H:P,...`` as given (``None``: ``--spawn``)."""
    spawn: int | None
    """``--spawn``: workers to start here (``None``: ``--endpoints``)."""
    model: str | None
    """``--model``: a catalog name or a GGUF path, as given."""
    fixture: str | None
    """``--fixture``: a generated fixture's name."""
    vocab: Path | None
    """``--vocab``: the GGUF whose tokenizer to use (``None``: the model's)."""
    options: EngineOptions
    """The engine options of spawned workers (and of a whole-model check)."""
    step_deadline: float
    """``--step-deadline``: seconds per step."""
    require: EvidenceClass
    """``--require``: the evidence class every stage's lane must be certified at."""
    evidence: Path | None
    """``--evidence``: the directory spawned workers read their records from."""
    lock: Path | None
    """``--lock``: the lock the client checks stages against (and spawned workers load)."""
    tls_ca: Path | None
    """``--tls-ca``: dial the endpoints over TLS, trusting this CA."""
    tls_cert: Path | None
    """``--tls-cert``: the client certificate (mutual TLS)."""
    tls_key: Path | None
    """``--tls-key``: its key."""
    transport: RouteMode = attrs.field(converter=RouteMode)
    """``--transport``: one of :data:`TRANSPORTS`."""
    data_path: DataPath = attrs.field(converter=DataPath)
    """``--data-path``: how a chain's or ring's frames travel (``DATA_PATHS``)."""
    prefix_cache: bool = True
    """``--prefix-cache``: sessions start from prompt prefixes earlier ones left on the
    stages (``docs/prefix-cache.md``)."""
    certify: bool = False
    """``--certify``: certify the spawned lane of the operator's own model first when no
    record of it counts (:mod:`dgr_engine.cli._own_model`)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouteSettings:
        """The settings :func:`add_route_arguments` parsed; :class:`RouteOptionsRefused` for
        engine options out of range."""
        try:
            options = EngineOptions.from_args(args)
        except ValueError as exc:
            raise RouteOptionsRefused(str(exc)) from None
        return cls(
            endpoints=args.endpoints,
            spawn=args.spawn,
            model=args.model,
            fixture=args.fixture,
            vocab=args.vocab,
            options=options,
            step_deadline=args.step_deadline,
            require=EvidenceClass(args.require),
            evidence=args.evidence,
            lock=args.lock,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            transport=args.transport,
            data_path=args.data_path,
            certify=args.certify,
            prefix_cache=args.prefix_cache,
        )


@attrs.frozen
class SamplingSettings:
    """How tokens are chosen and when a generation stops; invalid values are refused with
    :class:`~dgr_session.sampling.InvalidSamplingParameter` at construction."""

    temperature: float = 0.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus: the smallest set of most likely tokens whose probability reaches ``top_p``."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens (0: all)."""
    seed: int = 0
    """Seed of the draw (the same seed, position and logits give the same token)."""
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Text that ends the output (cut before it)."""
    max_tokens: int | None = None
    """Most tokens to generate (``None``: the command's default, within the context)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely (0: none)."""
    presence_penalty: float = 0.0
    """OpenAI's presence penalty over the last ``penalty_last_n`` tokens."""
    frequency_penalty: float = 0.0
    """OpenAI's frequency penalty over the last ``penalty_last_n`` tokens."""
    repetition_penalty: float = 1.0
    """llama.cpp's repetition penalty over the last ``penalty_last_n`` tokens (1: none)."""
    penalty_last_n: int = 64
    """The tokens the penalties look back at (``docs/sampling.md``)."""

    def __attrs_post_init__(self) -> None:
        self.sampling  # noqa: B018 - validates every sampler parameter
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidSamplingParameter(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not text for text in self.stop):
            raise InvalidSamplingParameter("a stop string cannot be empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SamplingSettings:
        """The settings :func:`add_sampling_arguments` parsed (a random seed when none)."""
        seed = args.seed if args.seed is not None else secrets.randbelow(1 << 31)
        return cls(
            args.temperature,
            args.top_p,
            args.top_k,
            seed,
            args.stop,
            args.max_tokens,
            args.min_p,
            args.presence_penalty,
            args.frequency_penalty,
            args.repeat_penalty,
            args.penalty_last_n,
        )

    @property
    def sampling(self) -> Sampling:
        """The session's sampler parameters (``docs/sampling.md``)."""
        return Sampling(
            self.seed,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.penalty_last_n,
        )

    @property
    def greedy(self) -> bool:
        """Whether every token is the largest logit's (the whole model's greedy token)."""
        return self.sampling.is_greedy

    def sampler(self) -> Sampler:
        """dgr's sampler of these settings (:data:`~dgr_session.sampling.greedy` when
        :attr:`greedy`), which the route's last stage applies."""
        return greedy if self.greedy else SeededSampler(self.sampling)


# -- planning: every check before any work ------------------------------------------------------


@attrs.frozen
class RouteStage:
    """One stage of a running route."""

    endpoint: str
    """``host:port``."""
    layers: tuple[int, int]
    """Its layer range ``[begin, end)``."""
    context: int
    """KV positions it holds per session."""
    width_out: int
    """Floats per output row: the vocabulary size on the last stage."""
    mtp: bool = False
    """The stage loaded the model's MTP block (a V4 last stage: ``--speculate mtp``)."""
    offer: StageOffer = StageOffer()
    """The data paths and security it offers a route (its advert's)."""


@attrs.define(eq=False)
class RoutePlan:
    """A command line's route, checked and resolved; nothing started yet. Owns the tokenizer
    until :func:`open_route` takes it over (:meth:`close` when the route is never opened)."""

    model: Path | None
    """The GGUF (``None``: given endpoints and no --model)."""
    layout: tuple[tuple[int, int], ...] | None
    """The spawned workers' ranges (``None``: given endpoints)."""
    endpoints: tuple[str, ...]
    """The given endpoints, in route order (empty when spawning)."""
    options: EngineOptions
    """The spawned workers' engine options (and a whole-model check's)."""
    worker_args: tuple[str, ...]
    """Further ``dgr worker`` arguments (--evidence, --lock)."""
    tls: ClientTls | None
    verifier: LockVerifier
    """Checks every stage's record against the client's lock."""
    required: EvidenceClass
    step_deadline: float
    transport: RouteMode
    data_path: DataPath
    """``--data-path``: how a chain's or ring's frames travel (``DATA_PATHS``)."""
    vocab: Path | None
    """The GGUF the tokenizer comes from: ``--vocab``, else the model (``None``: neither)."""
    tokenizer: Tokenizer | None
    """The model's tokenizer (``None``: a model without one, like the generated fixtures)."""
    prefix_cache: bool = True
    """Sessions start from prompt prefixes earlier ones left on the stages."""

    def close(self) -> None:
        if self.tokenizer is not None:
            self.tokenizer.close()


def plan_route(settings: RouteSettings, *, notice: Notice = _silent) -> RoutePlan:
    """Checks and resolves :func:`add_route_arguments`' options; :class:`RouteOptionsRefused` in one
    line. May fetch a catalog model or build a fixture (``notice`` says so)."""
    from dgr_engine.reference import n_layer_of, split_points

    model = _model(settings, notice)
    if settings.spawn is not None and model is None:
        raise RouteOptionsRefused("--spawn needs --model or --fixture")
    layout = None
    if settings.spawn is not None:
        assert model is not None
        n_layer = n_layer_of(model)
        if settings.spawn > n_layer:
            raise RouteOptionsRefused(
                f"--spawn {settings.spawn}: {model.name} has {n_layer} layers, at most one "
                "worker per layer"
            )
        layout = tuple(split_points(n_layer, settings.spawn))
    endpoints = () if settings.endpoints is None else _endpoints(settings.endpoints)
    tls = _client_tls(settings)
    if model is not None and layout is not None:
        settings = _own_lane(settings, model, notice)
    verifier = _verifier(settings)
    evidence = [] if settings.evidence is None else ["--evidence", str(settings.evidence)]
    lock = [] if settings.lock is None else ["--lock", str(settings.lock)]
    vocab = settings.vocab if settings.vocab is not None else model
    return RoutePlan(
        model=model,
        layout=layout,
        endpoints=endpoints,
        options=settings.options,
        worker_args=(*evidence, *lock),
        tls=tls,
        verifier=verifier,
        required=settings.require,
        step_deadline=settings.step_deadline,
        transport=settings.transport,
        data_path=settings.data_path,
        vocab=vocab,
        tokenizer=_tokenizer(vocab),
        prefix_cache=settings.prefix_cache,
    )


def _own_lane(settings: RouteSettings, model: Path, notice: Notice) -> RouteSettings:
    """``settings`` with the operator's own lock and evidence for ``model`` when the defaults
    certify no lane of it here (:mod:`dgr_engine.cli._own_model`; certified first with
    ``--certify``)."""
    if not applies(lock=settings.lock, evidence=settings.evidence, model=model):
        return settings
    try:
        own = settle_own_lane(
            model,
            settings.options,
            settings.require,
            certify_now=settings.certify,
            say=notice,
            ask=terminal_yes,  # on a terminal, a clear yes does what --certify does
        )
    except (OwnLaneRefused, EngineError) as exc:
        raise RouteOptionsRefused(str(exc)) from None
    if own is None:
        return settings
    return attrs.evolve(settings, lock=own.lock, evidence=own.evidence)


def _endpoints(text: str) -> tuple[str, ...]:
    endpoints = tuple(e.strip() for e in text.split(",") if e.strip())
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RouteOptionsRefused(f"--endpoints: expected HOST:PORT, got {endpoint!r}")
    if not endpoints:
        raise RouteOptionsRefused("--endpoints: at least one HOST:PORT is needed")
    return endpoints


def _tokenizer(vocab: Path | None) -> Tokenizer | None:
    if vocab is None:
        return None
    if not vocab.is_file():
        raise RouteOptionsRefused(f"--vocab: {vocab}: no such GGUF file")
    try:
        tokenizer = Tokenizer(vocab)
    except EngineError as exc:
        raise RouteOptionsRefused(f"{vocab}: {exc}") from None
    if not tokenizer.info.has_tokenizer:
        tokenizer.close()
        return None
    return tokenizer


def _model(settings: RouteSettings, notice: Notice) -> Path | None:
    """The GGUF of --model (a catalog name is fetched and verified first if it is not yet) or
    --fixture (built if missing)."""
    if settings.fixture is not None:
        from dgr_engine.fixtures import ensure_fixture
        from dgr_engine.fixtures import lookup as lookup_fixture

        try:
            lookup_fixture(settings.fixture)
        except ValueError as exc:
            raise RouteOptionsRefused(str(exc)) from None
        return ensure_fixture(settings.fixture)
    if settings.model is None:
        return None
    from dgr_engine.artifacts.errors import ArtifactError
    from dgr_engine.artifacts.storage import StorageRefused
    from dgr_engine.models import ModelFetchFailed, UnknownModel
    from dgr_engine.models.resolve import resolve_model

    try:
        return resolve_model(settings.model, notice=notice)
    except (UnknownModel, ModelFetchFailed, ArtifactError, StorageRefused) as exc:
        raise RouteOptionsRefused(str(exc)) from None
    except OSError as exc:  # FileNotFoundError: neither a catalog name nor a file
        raise RouteOptionsRefused(
            str(exc) if exc.strerror is None else f"{exc.filename}: {exc.strerror}"
        ) from None


def _verifier(settings: RouteSettings) -> LockVerifier:
    if settings.lock is None:
        return LockVerifier()
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.certification.lock import load_lock

    try:
        return LockVerifier(load_lock(settings.lock))
    except EvidenceError as exc:
        raise RouteOptionsRefused(f"--lock: {exc}") from None


def _client_tls(settings: RouteSettings) -> ClientTls | None:
    if settings.tls_ca is None:
        if settings.tls_cert is not None or settings.tls_key is not None:
            raise RouteOptionsRefused("--tls-cert and --tls-key need --tls-ca")
        return None
    if settings.endpoints is None:
        raise RouteOptionsRefused("--tls-ca goes with --endpoints (spawned workers serve loopback)")
    try:
        return ClientTls.from_files(settings.tls_ca, settings.tls_cert, settings.tls_key)
    except (OSError, ValueError) as exc:
        raise RouteOptionsRefused(f"--tls-ca/--tls-cert/--tls-key: {exc}") from None


# -- running ------------------------------------------------------------------------------------


@attrs.define(eq=False)
class RouteHandle:
    """A running route: what a command drives and shows."""

    manager: SessionManager
    """Runs the sessions (greedy unless a session is given a sampler)."""
    tokenizer: Tokenizer | None
    """The model's tokenizer (``None``: token ids only)."""
    model: Path | None
    """The GGUF (``None``: given endpoints and no --model)."""
    stages: tuple[RouteStage, ...]
    """The stages at start, in route order."""
    choice: PathChoice
    """The route mode and data path taken (``--transport``/``--data-path``, or the fastest the
    stages offer)."""
    stage_transport: GrpcStageTransport
    """The transport itself (its per-stage counters: ``stats()``)."""
    pool: LoopbackRouteProvider | None = None
    """The workers this command spawned (``--spawn``; ``None``: given endpoints): which one
    serves each stage now, replacements included."""

    @property
    def context(self) -> int:
        """KV positions a session may use: the smallest stage's."""
        return min(stage.context for stage in self.stages)

    @property
    def n_vocab(self) -> int:
        """The model's vocabulary size: the last stage's output width."""
        return self.stages[-1].width_out


def token_budget(route: RouteHandle, prompt_tokens: int, wanted: int, *, hint: str) -> int:
    """New tokens a session of ``prompt_tokens`` may generate: ``wanted``, cut to what the
    route's context holds after the prompt; :class:`ContextExceeded` (saying ``hint`` or
    workers with a bigger --ctx) when it holds none."""
    room = route.context - prompt_tokens
    if room < 1:
        raise ContextExceeded(
            f"the prompt holds {prompt_tokens} tokens and the route's context "
            f"{route.context} positions: {hint}, or workers with a bigger --ctx"
        )
    return min(wanted, room)


def failure_line(error: BaseException | None) -> str:
    """A session's terminal error as a user reads it: its text, naming the stage (index and
    endpoint) when the error has one and its text does not already."""
    text = str(error)
    endpoint = getattr(error, "endpoint", None)
    index = getattr(error, "stage_index", None)
    if endpoint is not None and endpoint not in text:
        where = f"stage {index} at {endpoint}" if index is not None else endpoint
        text = f"{text} ({where})"
    return text


@asynccontextmanager
async def open_route(
    route: RouteSettings | RoutePlan, *, notice: Notice = _silent
) -> AsyncIterator[RouteHandle]:
    """Starts the plan's workers (or dials its endpoints) and yields the running route; on
    exit everything is closed and stopped, also on cancellation and Ctrl-C. Takes over the
    plan's tokenizer (closed on exit). Settings are planned first (:func:`plan_route`)."""
    plan = route if isinstance(route, RoutePlan) else plan_route(route, notice=notice)
    from dgr_engine.tooling.loopback import LoopbackRouteProvider

    provider: RouteProvider
    local: LoopbackRouteProvider | None = None
    try:
        if plan.layout is not None:
            assert plan.model is not None
            local = LoopbackRouteProvider(
                plan.model,
                plan.layout,
                spawn_on_demand=True,
                options=plan.options,
                worker_args=plan.worker_args,
                certification_verifier=plan.verifier,
                notice=notice,  # "starting 3 workers ...", "3 workers ready in 2.1 s"
            )
            provider = local
            try:
                workers = await local.start()
            except Exception as exc:  # noqa: BLE001 - any start failure is one line to a user
                raise RouteStartFailed(str(exc)) from exc
            stages = tuple(_stage(w.endpoint, w.advert) for w in workers)
        else:
            provider = EndpointRouteProvider(
                plan.endpoints, tls=plan.tls, certification_verifier=plan.verifier
            )
            stages = tuple([await _dial(e, plan) for e in plan.endpoints])
        choice = choose_path(
            plan.transport, plan.data_path, [s.offer for s in stages], tls=plan.tls is not None
        )
        notice(f"route: {choice.line()}")
        async with _stage_transport(plan, choice) as transport:
            manager = SessionManager(
                transport,
                provider,
                policy=FailurePolicy(step_deadline=plan.step_deadline),
                required_evidence=plan.required,
                # a conversation's next turn starts from the last one's prompt
                prefixes=PrefixBook() if plan.prefix_cache else None,
            )
            try:
                yield RouteHandle(
                    manager, plan.tokenizer, plan.model, stages, choice, transport, pool=local
                )
            finally:
                await manager.aclose()
    finally:
        try:
            if local is not None:
                await local.aclose()
        finally:
            if local is not None:
                local.kill_all()  # idempotent; the last resort when aclose was cancelled
            plan.close()


async def _dial(endpoint: str, plan: RoutePlan) -> RouteStage:
    try:
        advert = await describe(endpoint, timeout=min(plan.step_deadline, 10.0), tls=plan.tls)
    except ShardError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RouteStartFailed(f"{endpoint} did not answer: {detail}") from exc
    return _stage(endpoint, advert)


def _stage(endpoint: str, advert: Advert) -> RouteStage:
    span = advert.span
    return RouteStage(
        endpoint,
        (span.layer_begin, span.layer_end),
        advert.capacity.context_per_session,
        advert.seam.width_out,
        span.mtp,
        StageOffer(advert.data_paths, advert.security),
    )


def _stage_transport(plan: RoutePlan, choice: PathChoice) -> GrpcStageTransport:
    """The stage transport of the chosen mode (a chain's picks its path per epoch, by the same
    rule as ``choice``, unless ``--data-path`` names one)."""
    if choice.mode is RouteMode.RELAY:
        return GrpcStageTransport(timeout=plan.step_deadline, tls=plan.tls)
    ring = choice.mode is RouteMode.RING
    return ChainStageTransport(
        timeout=plan.step_deadline, tls=plan.tls, ring=ring, data_path=plan.data_path
    )
