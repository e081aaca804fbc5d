"""Generate tokens over a route of shard workers.

--endpoints: workers already running, in route order (each serving the next range).
--spawn N: N workers started on 127.0.0.1 over even layer ranges of --model or --fixture
(stopped at the end, also on Ctrl-C); a lost worker is replaced by a new one. --model is a GGUF
file or a real model of the catalog by name ('dgr models list'), fetched and verified first if
it is not yet. Sampling is
greedy. --transport chain or ring sends each stage's output straight to the next stage (the
workers dial each other; docs/chain.md). --prompt TEXT is tokenized with the model's own
tokenizer (llama.cpp's, from the GGUF; --vocab GGUF with --endpoints), --chat applies its chat
template, the text is printed as it is generated and generation stops at the model's
end-of-generation tokens (--no-stop: it does not); --ids takes and prints token ids instead (the
generated fixtures have no tokenizer; with no --prompt, 8 fixed ids). --check compares with the
whole model run in-process (same engine options) and exits 1 on a difference. Every stage's
lane must be certified at --require (default real-hardware); dark lanes are never routed. For
the fixtures: 'dgr certify --fixture NAME' first, then --require fixture (spawned workers read
--evidence, default the checkout's evidence/, and --lock, default the checkout's; the client
checks every stage's record against --lock too). On a real model, e.g.:

    dgr generate --model smollm2-135m-instruct --spawn 3 --chat --prompt "Who wrote Hamlet?"

Prints the text (or the token ids) on stdout, then per-stage counters on stderr; --json prints
one JSON object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from dgr_engine.certification.verify import LockVerifier
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.cli.certify import CERTIFY_OPTIONS
from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import GrpcStageTransport, StageStats
from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.client.text import prompt_ids, start_text
from dgr_engine.errors import EngineError
from dgr_engine.options import EngineOptions
from dgr_engine.reference import n_layer_of, split_points, whole_model_greedy
from dgr_engine.security.tls import ClientTls
from dgr_engine.tokenizer import Tokenizer
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import EvidenceClass, FailurePolicy, FaultKind, SessionManager, SessionResult
from dgr_session.transport import RouteProvider

TRANSPORTS = ("relay", "chain", "ring")
"""``--transport`` values: how a token's frames travel along the route."""

DEFAULT_PROMPT = (1, 17, 42, 99, 7, 64, 128, 3)
"""The prompt when none is given."""
DEFAULT_NEW_TOKENS, DEFAULT_TEXT_TOKENS = 16, 64
"""``-n``'s default for token ids, and for a text prompt (a chat answer needs room)."""

OPTIONS = EngineOptions(**CERTIFY_OPTIONS)
"""The engine options of the workers ``--spawn`` starts (and of ``--check``'s whole model),
unless given: ``dgr certify``'s, so a lane certified with its defaults is the lane spawned."""


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"with --ids the prompt is token ids, got {text!r}") from None
    if not ids:
        raise ValueError("the prompt needs at least one token id")
    return ids


def configure(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", help="H:P,H:P,... workers already running, in route order")
    where.add_argument("--spawn", type=int, metavar="N", help="start N workers on 127.0.0.1")
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        metavar="NAME|GGUF",
        help="a real model of the catalog by name (fetched if needed) or a GGUF file (for "
        "--spawn, --check and the tokenizer)",
    )
    model.add_argument("--fixture", help="a generated fixture by name (built if missing)")
    p.add_argument(
        "--prompt",
        default=None,
        help="the prompt: text, tokenized with the model's own tokenizer (with --ids: token "
        "ids separated by spaces or commas); default: 8 fixed token ids",
    )
    p.add_argument(
        "--ids", action="store_true", help="token ids in (--prompt) and out, no tokenizer"
    )
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument(
        "--no-stop",
        action="store_true",
        help="do not stop at the model's end-of-generation tokens",
    )
    p.add_argument(
        "--vocab",
        type=Path,
        default=None,
        help="the GGUF whose tokenizer to use with --endpoints (default: --model's)",
    )
    p.add_argument(
        "-n",
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"tokens to generate at most (default {DEFAULT_NEW_TOKENS}; {DEFAULT_TEXT_TOKENS} "
        "with a text prompt, which stops at the model's end-of-generation tokens first)",
    )
    EngineOptions.add_arguments(p, **attrs.asdict(OPTIONS))
    p.add_argument(
        "--step-deadline", type=float, default=10.0, help="seconds per step (default 10)"
    )
    p.add_argument(
        "--check", action="store_true", help="compare with the whole model; exit 1 if unequal"
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
        help="evidence directory the --spawn workers read (default: the worker's default)",
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
        default="relay",
        help="relay: this client sends every stage its frame (default); chain: each stage sends"
        " its output straight to the next, the last answers here; ring: a chain whose last"
        " stage also sends each next greedy token back to the first (docs/chain.md)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        model = _model(args)
    except GenerateRefused as exc:
        print(f"dgr generate: {exc}", file=sys.stderr)
        return 2
    if (args.spawn is not None or args.check) and model is None:
        print("dgr generate: --spawn and --check need --model or --fixture", file=sys.stderr)
        return 2
    try:
        args.tls = _client_tls(args)
        args.verifier = _verifier(args)
        args.text, args.tokenizer = _prompt(args, model)
    except (ValueError, EngineError) as exc:
        print(f"dgr generate: {exc}", file=sys.stderr)
        return 2
    if args.max_new_tokens is None:
        has_text = args.tokenizer is not None
        args.max_new_tokens = DEFAULT_TEXT_TOKENS if has_text else DEFAULT_NEW_TOKENS
    if args.max_new_tokens < 1:
        print("dgr generate: --max-new-tokens must be at least 1", file=sys.stderr)
        if args.tokenizer is not None:
            args.tokenizer.close()
        return 2
    providers: list[LoopbackRouteProvider] = []
    args.chain_frames_sent = None  # frames this client sent into a chain (set by _run)
    try:
        with sigterm_as_interrupt():
            outcome = asyncio.run(_run(args, model, providers))
    except KeyboardInterrupt:
        print("dgr generate: interrupted", file=sys.stderr)
        return 130
    finally:
        for provider in providers:
            provider.kill_all()  # idempotent: a no-op once aclose stopped them
    result, stats, seconds = outcome
    expected = None
    if args.check:
        assert model is not None
        options = EngineOptions.from_args(args)
        expected = whole_model_greedy(model, [args.prompt], args.max_new_tokens, options)[0]
        expected = expected[: len(result.tokens)]  # a stop token may have ended the session
    tokens = list(result.tokens)
    text = tail = None
    if args.tokenizer is not None:
        tail = args.stream.flush()  # bytes of a character the last piece left incomplete
        text = args.generated + tail
        args.tokenizer.close()
    if args.json:
        print(
            json.dumps(
                {
                    "state": result.state.value,
                    "tokens": tokens,
                    "text": text,
                    "epoch": result.epoch,
                    "route_changes": result.route_changes,
                    "error": None if result.error is None else str(result.error),
                    "seconds": seconds,
                    "whole_model_equal": None if expected is None else tokens == expected,
                    "stages": [_stats_dict(s) for s in stats.values()],
                    "transport": args.transport,
                    "chain_frames_sent": args.chain_frames_sent,
                }
            )
        )
    else:
        if text is None:
            print(" ".join(map(str, tokens)))
        else:
            print(tail, flush=True)  # the text went out as it came
        print(
            f"state {result.state.value}  epoch {result.epoch}  route changes "
            f"{result.route_changes}  {len(tokens)} tokens in {seconds:.3f} s",
            file=sys.stderr,
        )
        for s in stats.values():
            print(
                f"  {s.endpoint} [{s.layers[0]},{s.layers[1]})  forwards {s.forwards}  rows "
                f"{s.rows}  engine {s.compute_us / 1000:.1f} ms  rtt {s.rtt_us / 1000:.1f} ms  "
                f"bytes in {s.bytes_sent}  out {s.bytes_received}",
                file=sys.stderr,
            )
        if result.error is not None:
            print(f"failed: {result.error}", file=sys.stderr)
            if any(r.fault is FaultKind.ROUTE_INVALID for r in result.reports):
                print(
                    "the route was refused (see above); if a lane is not certified at the "
                    "required class: certify it ('dgr certify') or state the class the route "
                    "needs (--require)",
                    file=sys.stderr,
                )
        if expected is not None:
            print(f"whole-model equal: {tokens == expected}", file=sys.stderr)
    if result.error is not None:
        return 1
    return 1 if expected is not None and tokens != expected else 0


def _stats_dict(s: StageStats) -> dict[str, Any]:
    return {
        "endpoint": s.endpoint,
        "layers": list(s.layers),
        "forwards": s.forwards,
        "rows": s.rows,
        "bytes_sent": s.bytes_sent,
        "bytes_received": s.bytes_received,
        "rtt_us": s.rtt_us,
        "compute_us": s.compute_us,
    }


async def _run(
    args: argparse.Namespace, model: Path | None, providers: list[LoopbackRouteProvider]
) -> tuple[SessionResult, dict[str, StageStats], float]:
    provider: RouteProvider
    local: LoopbackRouteProvider | None = None
    if args.spawn is not None:
        assert model is not None
        layout = split_points(n_layer_of(model), args.spawn)
        options = EngineOptions.from_args(args)
        evidence = [] if args.evidence is None else ["--evidence", str(args.evidence)]
        lock = [] if args.lock is None else ["--lock", str(args.lock)]
        local = LoopbackRouteProvider(
            model,
            layout,
            spawn_on_demand=True,
            options=options,
            worker_args=[*evidence, *lock],
            certification_verifier=args.verifier,
        )
        providers.append(local)
        provider = local
    else:
        endpoints = [e.strip() for e in args.endpoints.split(",") if e]
        provider = EndpointRouteProvider(
            endpoints, tls=args.tls, certification_verifier=args.verifier
        )
    policy = FailurePolicy(step_deadline=args.step_deadline)
    required = EvidenceClass(args.require)
    try:
        if local is not None:
            await local.start()
        async with _transport(args) as transport:
            manager = SessionManager(transport, provider, policy=policy, required_evidence=required)
            began = time.perf_counter()
            if args.tokenizer is None:
                handle = manager.start(args.prompt, max_new_tokens=args.max_new_tokens)
            else:
                handle, args.stream = start_text(
                    manager,
                    args.tokenizer,
                    args.text,
                    max_new_tokens=args.max_new_tokens,
                    on_text=lambda piece: _emit(args, piece),
                    chat=args.chat,
                    stop_at_eog=not args.no_stop,
                )
            result = await handle.wait()
            seconds = time.perf_counter() - began
            await manager.aclose()
            if isinstance(transport, ChainStageTransport):
                args.chain_frames_sent = transport.chain_stats.sent
            return result, transport.stats(), seconds
    finally:
        if local is not None:
            await local.aclose()


def _transport(args: argparse.Namespace) -> GrpcStageTransport:
    """The stage transport ``--transport`` names (greedy sampling suits a ring)."""
    if args.transport == "relay":
        return GrpcStageTransport(timeout=args.step_deadline, tls=args.tls)
    ring = args.transport == "ring"
    return ChainStageTransport(timeout=args.step_deadline, tls=args.tls, ring=ring)


def _emit(args: argparse.Namespace, piece: str) -> None:
    """Generated text as it comes (on stdout unless --json gathers it)."""
    args.generated += piece
    if not args.json:
        print(piece, end="", flush=True)


def _prompt(args: argparse.Namespace, model: Path | None) -> tuple[str | None, Tokenizer | None]:
    """Sets ``args.prompt`` to token ids; returns the text and the tokenizer of a text prompt
    (``None`` for token ids: --ids, or no --prompt)."""
    args.generated = ""
    if args.prompt is None or args.ids:
        args.prompt = list(DEFAULT_PROMPT) if args.prompt is None else _parse_ids(args.prompt)
        if args.chat:
            raise ValueError("--chat needs a text prompt (not --ids)")
        return None, None
    vocab = args.vocab if args.vocab is not None else model
    if vocab is None:
        raise ValueError(
            "a text prompt needs a tokenizer: --model, --fixture or --vocab GGUF (or --ids)"
        )
    tokenizer = Tokenizer(vocab)
    if not tokenizer.info.has_tokenizer:
        tokenizer.close()
        raise ValueError(
            f"{vocab.name} has no tokenizer (token ids only, like the generated fixtures): give "
            "token ids with --ids"
        )
    text = str(args.prompt)
    try:
        args.prompt = prompt_ids(tokenizer, text, chat=args.chat)
    except EngineError:
        tokenizer.close()
        raise
    return text, tokenizer


class GenerateRefused(Exception):
    """A model the command line names that cannot be had (one line, exit 2)."""


def _model(args: argparse.Namespace) -> Path | None:
    """The GGUF of --model (a catalog name is fetched and verified first if it is not yet) or
    --fixture (built if missing); :class:`GenerateRefused` in one line when there is none."""
    if args.fixture is not None:
        from dgr_engine.fixtures import ensure_fixture
        from dgr_engine.fixtures import lookup as lookup_fixture

        try:
            lookup_fixture(args.fixture)
        except ValueError as exc:
            raise GenerateRefused(str(exc)) from None
        return ensure_fixture(args.fixture)
    if args.model is None:
        return None
    from dgr_engine.artifacts.errors import ArtifactError
    from dgr_engine.artifacts.storage import StorageRefused
    from dgr_engine.models import ModelFetchFailed, UnknownModel
    from dgr_engine.models.resolve import resolve_model

    try:
        return resolve_model(
            args.model, notice=lambda text: print(f"dgr generate: {text}", file=sys.stderr)
        )
    except (UnknownModel, ModelFetchFailed, ArtifactError, StorageRefused) as exc:
        raise GenerateRefused(str(exc)) from None
    except OSError as exc:  # FileNotFoundError: neither a catalog name nor a file
        raise GenerateRefused(
            str(exc) if exc.strerror is None else f"{exc.filename}: {exc.strerror}"
        ) from None


def _verifier(args: argparse.Namespace) -> LockVerifier:
    """The client's check of every stage's record: against --lock, else the default lock
    (``ValueError`` in one line when --lock cannot be read)."""
    if args.lock is None:
        return LockVerifier()
    from dgr_engine.certification.errors import EvidenceError
    from dgr_engine.certification.lock import load_lock

    try:
        return LockVerifier(load_lock(args.lock))
    except EvidenceError as exc:
        raise ValueError(f"--lock: {exc}") from None


def _client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The TLS the flags ask for (``ValueError`` when given half or without --endpoints)."""
    if args.tls_ca is None:
        if args.tls_cert is not None or args.tls_key is not None:
            raise ValueError("--tls-cert and --tls-key need --tls-ca")
        return None
    if args.endpoints is None:
        raise ValueError("--tls-ca goes with --endpoints (spawned workers serve loopback)")
    return ClientTls.from_files(args.tls_ca, args.tls_cert, args.tls_key)
