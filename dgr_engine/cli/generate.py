"""Generate text (or tokens) over a route of shard workers.

--endpoints: workers already running, in route order (each serving the next range).
--spawn N: N workers started on 127.0.0.1 over even layer ranges of --model or --fixture
(stopped at the end, also on Ctrl-C); a lost worker is replaced by a new one. --model is a GGUF
file or a real model of the catalog by name ('dgr models list'), fetched and verified first if
it is not yet. --transport chain or ring sends each stage's output straight to the next stage
(the workers dial each other; a ring is greedy only; docs/chain.md).

The prompt is --prompt TEXT, else standard input when it is not a terminal; it is tokenized with
the model's own tokenizer (llama.cpp's, from the GGUF; --vocab GGUF with --endpoints), --chat
applies its chat template. The text is printed as it is generated and stops at the model's
end-of-generation tokens (--no-stop: it does not), at a --stop TEXT (cut before it), or after
-n tokens (default 256, and never more than the route's context holds). Sampling is greedy
(the whole model's tokens) unless --temperature is above 0 (with --top-p, --top-k; --seed makes
it repeatable). --speculate ngram|draft:PATH decodes greedily in passes that verify up to
--draft-max drafts each: the same text, and one line on stderr of what the drafts achieved.
--ids takes and prints token ids instead (the generated fixtures have no
tokenizer; with no --prompt, 8 fixed ids). --check compares greedy tokens with the whole model
run in-process (same engine options) and exits 1 on a difference. Every stage's lane must be
certified at --require (default real-hardware); dark lanes are never routed. For the fixtures:
'dgr certify --fixture NAME' first, then --require fixture. On a real model, e.g.:

    dgr generate --model smollm2-135m-instruct --spawn 3 --chat --prompt "Who wrote Hamlet?"

Prints the text (or the token ids) on stdout, then per-stage counters on stderr; --json prints
one JSON object instead. Progress ("starting 3 workers") goes to stderr unless --quiet. Exit
status: 0 done, 1 the session failed or --check differed, 2 a bad command line or a route that
could not be started, 130 interrupted.
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

from dgr_engine.cli._progress import sayer
from dgr_engine.cli._route import (
    PREFILL_NOTICE_SECONDS,
    ContextExceeded,
    Notice,
    RouteHandle,
    RouteOptionsRefused,
    RoutePlan,
    RouteStartFailed,
    add_route_arguments,
    add_sampling_arguments,
    failure_line,
    open_route,
    plan_route,
    token_budget,
)
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.cli._speculate import (
    SessionCommandSettings,
    SpeculationPlan,
    add_speculation_arguments,
    plan_speculation,
    speculation_line,
)
from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.path_choice import PathChoice
from dgr_engine.client.relay import StageStats
from dgr_engine.client.text import TextOutput, prompt_ids, start_text
from dgr_engine.errors import EngineError
from dgr_engine.reference import whole_model_greedy
from dgr_engine.tokenizer import Tokenizer
from dgr_session import SessionResult
from dgr_session.sampling import InvalidSamplingParameter
from dgr_session.speculation import Speculation

DEFAULT_PROMPT = (1, 17, 42, 99, 7, 64, 128, 3)
"""The prompt of a model without a tokenizer when none is given."""
DEFAULT_NEW_TOKENS, DEFAULT_TEXT_TOKENS = 16, 256
"""``-n``'s default for token ids, and for a text prompt (which stops at end-of-turn first);
either is cut to what the route's context holds after the prompt."""


@attrs.frozen
class Generation:
    """What one run produced."""

    result: SessionResult
    text: str | None
    """The generated text (``None``: token ids)."""
    stopped_at: str | None
    """The stop string the text was cut at."""
    max_tokens: int
    """The token limit it ran under (after the context's cut)."""
    stats: dict[str, StageStats]
    seconds: float
    chain_frames_sent: int | None
    """Frames this client sent into a chain or ring (``None``: relay)."""
    speculation: Speculation | None = None
    """The session's speculation and what it achieved (``None``: without --speculate)."""
    choice: PathChoice | None = None
    """The route mode and data path it took."""


@attrs.frozen
class GenerateSettings(SessionCommandSettings):
    """``dgr generate``'s command line, read once at its edge (:meth:`from_args`)."""

    prompt: str | None
    """``--prompt`` as given: text, or token ids with :attr:`ids` (``None``: standard input,
    or :data:`DEFAULT_PROMPT` for a model without a tokenizer)."""
    ids: bool
    """``--ids``: token ids in and out, no tokenizer."""
    chat: bool
    """``--chat``: the prompt goes through the model's chat template."""
    stop_at_eog: bool
    """Stop at the model's end-of-generation tokens (``--no-stop``: do not)."""
    check: bool
    """``--check``: compare the greedy tokens with the whole model's."""
    json: bool
    """``--json``: one JSON object instead of the text and the counters."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GenerateSettings:
        """The settings :func:`configure` parsed (a random seed when none);
        :class:`~dgr_session.sampling.InvalidSamplingParameter` or :class:`RouteOptionsRefused`
        for a value the settings refuse."""
        return cls(
            **attrs.asdict(SessionCommandSettings.from_args(args), recurse=False),
            prompt=args.prompt,
            ids=args.ids,
            chat=args.chat,
            stop_at_eog=not args.no_stop,
            check=args.check,
            json=args.json,
        )


def configure(p: argparse.ArgumentParser) -> None:
    add_route_arguments(p, sessions=False)  # one session: nothing to keep for
    add_sampling_arguments(
        p,
        max_tokens_help=f"tokens to generate at most (default {DEFAULT_TEXT_TOKENS} with a text "
        f"prompt, {DEFAULT_NEW_TOKENS} with token ids; never more than the context holds)",
    )
    add_speculation_arguments(p)
    p.add_argument(
        "--prompt",
        default=None,
        help="the prompt: text, tokenized with the model's own tokenizer (with --ids: token "
        "ids separated by spaces or commas); default: standard input when it is not a "
        "terminal (a model without a tokenizer: 8 fixed token ids)",
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
        "--check",
        action="store_true",
        help="compare greedy tokens with the whole model; exit 1 if unequal",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    notice = sayer("dgr generate: ")  # silent under --quiet
    try:
        settings = GenerateSettings.from_args(args)
        sampling = settings.sampling
        if settings.check and not sampling.greedy:
            raise RouteOptionsRefused("--check compares greedy tokens: drop --temperature")
        speculate = plan_speculation(settings.speculation, notice=notice)
        plan = plan_route(settings.route, notice=notice)
    except (RouteOptionsRefused, InvalidSamplingParameter) as exc:
        return _refused(exc)
    try:
        if settings.check and plan.model is None:
            raise RouteOptionsRefused("--check needs --model or --fixture")
        if speculate is not None:
            speculate.check_vocab(plan.vocab)
            speculate.check_model(plan.model)
        text, prompt = _prompt(settings, plan.tokenizer, plan.vocab)
    except (ValueError, EngineError) as exc:
        plan.close()
        return _refused(exc)
    try:
        with sigterm_as_interrupt():
            run = asyncio.run(_generate(settings, plan, speculate, text, prompt, notice))
    except KeyboardInterrupt:
        print("dgr generate: interrupted", file=sys.stderr)
        return 130
    except (RouteStartFailed, ContextExceeded, RouteOptionsRefused) as exc:
        return _refused(exc)  # RouteOptionsRefused: a draft model the route refuses
    return _report(settings, plan, prompt, run)


def _refused(exc: BaseException) -> int:
    print(f"dgr generate: {exc}", file=sys.stderr)
    return 2


def _prompt(
    settings: GenerateSettings, tokenizer: Tokenizer | None, vocab: Path | None
) -> tuple[str | None, list[int]]:
    """The prompt's text (``None`` for token ids) and its token ids (``vocab``: the GGUF the
    tokenizer would come from)."""
    given = settings.prompt
    if settings.ids or (given is None and tokenizer is None):
        if settings.chat:
            raise ValueError("--chat needs a text prompt (not --ids)")
        if settings.sampling.stop:
            raise ValueError("--stop needs a text prompt (not --ids)")
        return None, list(DEFAULT_PROMPT) if given is None else _parse_ids(given)
    if vocab is None:
        raise ValueError(
            "a text prompt needs a tokenizer: --model, --fixture or --vocab GGUF (or --ids)"
        )
    if tokenizer is None:
        raise ValueError(
            f"{vocab.name} has no tokenizer (token ids only, like the generated fixtures): give "
            "token ids with --ids"
        )
    text = given if given is not None else _stdin_prompt()
    return text, prompt_ids(tokenizer, text, chat=settings.chat)


def _stdin_prompt() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("--prompt TEXT is needed (or the prompt on standard input)")
    text = sys.stdin.read().rstrip("\n")
    if not text.strip():
        raise ValueError("the prompt on standard input is empty")
    return text


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"with --ids the prompt is token ids, got {text!r}") from None
    if not ids:
        raise ValueError("the prompt needs at least one token id")
    return ids


async def _generate(
    settings: GenerateSettings,
    plan: RoutePlan,
    speculate: SpeculationPlan | None,
    text: str | None,
    prompt: list[int],
    notice: Notice,
) -> Generation:
    async with open_route(plan, notice=notice) as route:
        if speculate is None:
            return await _run_session(settings, route, None, text, prompt, notice)
        drafter = speculate.open(route, plan.options)
        try:
            speculation = speculate.session(drafter)
            return await _run_session(settings, route, speculation, text, prompt, notice)
        finally:
            drafter.close()


async def _run_session(
    settings: GenerateSettings,
    route: RouteHandle,
    speculation: Speculation | None,
    text: str | None,
    prompt: list[int],
    notice: Notice,
) -> Generation:
    """One session over the running route, its text printed as it comes."""
    sampling = settings.sampling
    wanted = sampling.max_tokens
    if wanted is None:
        wanted = DEFAULT_TEXT_TOKENS if text is not None else DEFAULT_NEW_TOKENS
    limit = token_budget(route, len(prompt), wanted, hint="a shorter prompt")
    if sampling.max_tokens is not None and limit < sampling.max_tokens:
        notice(f"{limit} new tokens fit the context ({route.context} positions)")
    loop = asyncio.get_running_loop()
    prefilling = loop.call_later(PREFILL_NOTICE_SECONDS, notice, f"prefilling {len(prompt)} tokens")
    began = time.perf_counter()
    output: TextOutput | None = None
    sampler = sampling.sampler()
    if text is None:
        handle = route.manager.start(
            prompt,
            max_new_tokens=limit,
            sampler=sampler,
            on_token=lambda _token: prefilling.cancel(),
            speculation=speculation,
        )
    else:
        assert route.tokenizer is not None
        handle, output = start_text(
            route.manager,
            route.tokenizer,
            prompt,
            max_new_tokens=limit,
            on_text=lambda piece: _emit(settings, piece),
            stop_at_eog=settings.stop_at_eog,
            stop_texts=sampling.stop,
            on_token=lambda _token: prefilling.cancel(),
            sampler=sampler,
            speculation=speculation,
        )
    try:
        result = await handle.wait()
    finally:
        prefilling.cancel()
    seconds = time.perf_counter() - began
    generated = None
    if output is not None:
        _emit(settings, output.flush())  # a character the last piece left incomplete, held text
        generated = output.text
    await route.manager.aclose()
    return Generation(
        result,
        generated,
        None if output is None else output.stopped_at,
        limit,
        route.stage_transport.stats(),
        seconds,
        _chain_frames(route),
        handle.core.speculation,  # the route's in place of ours where it drafts (a ring)
        route.choice,
    )


def _chain_frames(route: RouteHandle) -> int | None:
    transport = route.stage_transport
    return transport.chain_stats.sent if isinstance(transport, ChainStageTransport) else None


def _emit(settings: GenerateSettings, piece: str) -> None:
    """Generated text as it comes (on stdout unless --json gathers it)."""
    if piece and not settings.json:
        print(piece, end="", flush=True)


def _report(settings: GenerateSettings, plan: RoutePlan, prompt: list[int], run: Generation) -> int:
    result = run.result
    tokens = list(result.tokens)
    stopped = run.stopped_at is not None
    failed = result.error is not None and not stopped
    state = "stopped at a stop string" if stopped else result.state.value
    expected = None
    sampling = settings.sampling
    if settings.check:
        assert plan.model is not None
        whole = whole_model_greedy(plan.model, [prompt], run.max_tokens, plan.options)[0]
        expected = whole[: len(tokens)]  # a stop token or string may have ended the session
    if settings.json:
        report = {
            "state": result.state.value,
            "stopped_at": run.stopped_at,
            "tokens": tokens,
            "text": run.text,
            "prompt_tokens": len(prompt),
            "max_tokens": run.max_tokens,
            "seed": None if sampling.greedy else sampling.seed,
            "epoch": result.epoch,
            "route_changes": result.route_changes,
            "error": failure_line(result.error) if failed else None,
            "seconds": run.seconds,
            "whole_model_equal": None if expected is None else tokens == expected,
            "stages": [_stats_dict(s) for s in run.stats.values()],
            "transport": None if run.choice is None else str(run.choice.mode),
            "data_path": None if run.choice is None else str(run.choice.path),
            "chain_frames_sent": run.chain_frames_sent,
            "speculation": _speculation_dict(run.speculation),
        }
        print(json.dumps(report))
        if run.speculation is not None:
            print(speculation_line(run.speculation), file=sys.stderr)
    else:
        print(" ".join(map(str, tokens)) if run.text is None else "", flush=True)
        seed = "" if sampling.greedy else f"  seed {sampling.seed}"
        print(
            f"state {state}  epoch {result.epoch}  route changes {result.route_changes}  "
            f"{len(tokens)} tokens in {run.seconds:.3f} s{seed}",
            file=sys.stderr,
        )
        for s in run.stats.values():
            print(
                f"  {s.endpoint} [{s.layers[0]},{s.layers[1]})  forwards {s.forwards}  rows "
                f"{s.rows}  engine {s.compute_us / 1000:.1f} ms  rtt {s.rtt_us / 1000:.1f} ms  "
                f"bytes in {s.bytes_sent}  out {s.bytes_received}",
                file=sys.stderr,
            )
        if run.speculation is not None:
            print(speculation_line(run.speculation), file=sys.stderr)
        if failed:
            print(f"failed: {failure_line(result.error)}", file=sys.stderr)
        if expected is not None:
            print(f"whole-model equal: {tokens == expected}", file=sys.stderr)
    if failed:
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


def _speculation_dict(speculation: Speculation | None) -> dict[str, Any] | None:
    if speculation is None:
        return None
    return {
        "source": speculation.drafter.name,
        "passes": speculation.passes,
        "drafted": speculation.drafted,
        "accepted": speculation.accepted,
        "acceptance": speculation.acceptance,
    }
