"""Chat with a model over a route of shard workers, in the terminal.

The route is generate's (--spawn N with --model, or --endpoints; the same engine, trust and
transport options; docs/generate-and-chat.md). Each line you type is the user's next turn; the
model answers over the whole conversation so far, through its own chat template (--system TEXT
opens it with a system prompt), and the answer is printed as it is generated, up to the model's
end of turn, a --stop TEXT or -n tokens (default 256, within the context). Sampling is greedy
unless --temperature is above 0 (--top-p, --top-k, --seed as for generate); --speculate
ngram|draft:PATH (greedy only) decodes each answer speculatively, the same text.

    /reset   start a new conversation (the system prompt stays)
    /exit    end (so do end of input, Ctrl-D, and Ctrl-C at the prompt)

Ctrl-C while the model answers stops that answer (its session is cancelled and every stage's
session closed; what was shown stays in the conversation) and not the program, nor the spawned
workers (meanwhile the terminal's Ctrl-C is read as a key; other keys are dropped). A conversation
the route's context cannot hold any more is told in one line: /reset, or workers with a bigger
--ctx. Spawned workers are stopped when the chat ends. e.g.:

    dgr chat --model smollm2-135m-instruct --spawn 3 --system "Answer in one sentence."
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum

import attrs

from dgr_engine.cli._progress import sayer
from dgr_engine.cli._route import (
    PREFILL_NOTICE_SECONDS,
    Notice,
    RouteHandle,
    RouteOptionsRefused,
    RoutePlan,
    RouteStartFailed,
    SamplingSettings,
    add_route_arguments,
    add_sampling_arguments,
    failure_line,
    open_route,
    plan_route,
)
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.cli._speculate import (
    SessionCommandSettings,
    SpeculationPlan,
    add_speculation_arguments,
    plan_speculation,
)
from dgr_engine.client.text import chat_ids, start_text
from dgr_engine.errors import EngineError
from dgr_session.drafts import Drafter
from dgr_session.sampling import InvalidSamplingParameter
from dgr_session.speculation import Speculation

DEFAULT_ANSWER_TOKENS = 256
"""``-n``'s default: tokens per answer at most (the end of turn comes first, mostly)."""
PROMPT = "> "
"""What the chat shows when it waits for your next line."""
CLOSE_SECONDS = 30.0
"""The most the route's close may take at the end (its workers' bounded stops fit in it)."""
COMMANDS = "/reset starts a new conversation, /exit or Ctrl-D ends"
"""The chat's own commands, as its first line tells them."""

Message = tuple[str, str]
"""``(role, content)``: one turn of the conversation."""


class Ending(StrEnum):
    """How an answer ended."""

    END_OF_TURN = "end of turn"
    STOP_TEXT = "stop text"
    TOKEN_LIMIT = "token limit"
    INTERRUPTED = "interrupted"
    FAILED = "failed"


@attrs.frozen
class Answer:
    """One answer of the model."""

    text: str
    """What was shown (cut at a stop string)."""
    ending: Ending
    tokens: int
    """Tokens generated."""
    error: str | None = None
    """Why it failed (:attr:`Ending.FAILED`)."""


@attrs.frozen
class ChatSettings(SessionCommandSettings):
    """``dgr chat``'s command line, read once at its edge (:meth:`from_args`)."""

    system: str | None
    """``--system``: the system prompt opening the conversation (``None``: none)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatSettings:
        """The settings :func:`configure` parsed (a random seed when none);
        :class:`~dgr_session.sampling.InvalidSamplingParameter` or :class:`RouteOptionsRefused`
        for a value the settings refuse."""
        return cls(
            **attrs.asdict(SessionCommandSettings.from_args(args), recurse=False),
            system=args.system,
        )


def configure(p: argparse.ArgumentParser) -> None:
    add_route_arguments(p)
    add_sampling_arguments(
        p,
        max_tokens_help=f"tokens per answer at most (default {DEFAULT_ANSWER_TOKENS}; never "
        "more than the context holds after the conversation)",
    )
    add_speculation_arguments(p)
    p.add_argument("--system", default=None, help="the system prompt opening the conversation")


def run(args: argparse.Namespace) -> int:
    notice = sayer("dgr chat: ")  # silent under --quiet
    try:
        settings = ChatSettings.from_args(args)
        speculate = plan_speculation(settings.speculation, notice=notice)
        plan = plan_route(settings.route, notice=notice)
    except (RouteOptionsRefused, InvalidSamplingParameter) as exc:
        return _refused(exc)
    try:
        if speculate is not None:
            speculate.check_vocab(plan.vocab)
            speculate.check_model(plan.model)
    except RouteOptionsRefused as exc:
        plan.close()
        return _refused(exc)
    tokenizer = plan.tokenizer
    if tokenizer is None or not tokenizer.info.has_chat_template:
        plan.close()
        what = "a tokenizer" if tokenizer is None else "a chat template"
        return _refused(f"dgr chat needs a model with {what} (--model, or --vocab GGUF)")
    base: list[Message] = [] if settings.system is None else [("system", settings.system)]
    try:
        chat_ids(tokenizer, base or [("user", "")])  # the template takes these roles
    except EngineError as exc:
        plan.close()
        return _refused(exc)
    try:
        with sigterm_as_interrupt(), asyncio.Runner() as runner:
            return _chat(runner, plan, settings.sampling, speculate, base, notice)
    except KeyboardInterrupt:  # while the workers start or stop
        print("dgr chat: interrupted", file=sys.stderr)
        return 130
    except (RouteStartFailed, RouteOptionsRefused) as exc:  # or a draft model the route refuses
        return _refused(exc)


def _refused(exc: BaseException | str) -> int:
    print(f"dgr chat: {exc}", file=sys.stderr)
    return 2


def _chat(
    runner: asyncio.Runner,
    plan: RoutePlan,
    settings: SamplingSettings,
    speculate: SpeculationPlan | None,
    base: list[Message],
    notice: Notice,
) -> int:
    """Runs the route on ``runner``'s loop while this thread reads your lines. With
    ``speculate``, one drafter serves every answer (each its own speculation), closed at the
    end."""
    opened = open_route(plan, notice=notice)
    route = runner.run(opened.__aenter__())
    drafter: Drafter | None = None
    try:
        if speculate is not None:
            drafter = speculate.open(route, plan.options)
        stages = " -> ".join(f"{s.endpoint} [{s.layers[0]},{s.layers[1]})" for s in route.stages)
        notice(f"{len(route.stages)} stages: {stages}; context {route.context} positions")
        notice(COMMANDS)
        speculations = None
        if speculate is not None and drafter is not None:
            speculations = functools.partial(speculate.session, drafter)
        _converse(runner, route, settings, speculations, base, notice)
    finally:
        try:
            _close_route(runner, opened, notice)
        finally:
            if drafter is not None:
                drafter.close()
    return 0


def _close_route(
    runner: asyncio.Runner,
    opened: contextlib.AbstractAsyncContextManager[RouteHandle],
    notice: Notice,
) -> None:
    """Closes the route (its sessions, its channels, the workers it started), bounded: what
    is still open after :data:`CLOSE_SECONDS` is cut off (spawned workers are killed)."""
    began = time.monotonic()
    notice("closing the route ...")
    try:
        runner.run(asyncio.wait_for(opened.__aexit__(None, None, None), CLOSE_SECONDS))
    except TimeoutError:
        notice(f"the route did not close within {CLOSE_SECONDS:g} s: its workers were stopped")
        return
    notice(f"route closed in {time.monotonic() - began:.1f} s")


def _converse(
    runner: asyncio.Runner,
    route: RouteHandle,
    settings: SamplingSettings,
    speculations: Callable[[], Speculation] | None,
    base: list[Message],
    notice: Notice,
) -> None:
    """The loop: read a line, answer it, until /exit, end of input or Ctrl-C at the prompt.
    ``speculations``: a new speculation for each answer (``None``: plain decoding)."""
    _line_editing()
    assert route.tokenizer is not None
    messages = list(base)
    while True:
        try:
            line = input(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            print(flush=True)
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = list(base)
            print("(a new conversation)", flush=True)
            continue
        if line.startswith("/"):
            print(f"(unknown command {line}: {COMMANDS})", flush=True)
            continue
        turn = [*messages, ("user", line)]
        prompt = chat_ids(route.tokenizer, turn)
        room = route.context - len(prompt)
        if room < 1:
            print(
                f"(the conversation holds {len(prompt)} tokens and the route's context "
                f"{route.context} positions: /reset to start a new one, or start workers with "
                "a bigger --ctx)",
                flush=True,
            )
            continue
        limit = min(settings.max_tokens or DEFAULT_ANSWER_TOKENS, room)
        speculation = None if speculations is None else speculations()
        answer = runner.run(_answer(route, settings, prompt, limit, _show, notice, speculation))
        print(_ending_note(answer, limit, limit == room), flush=True)
        if answer.ending is not Ending.FAILED:
            messages = [*turn, ("assistant", answer.text)]


def _show(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _ending_note(answer: Answer, limit: int, context_full: bool) -> str:
    """What ends the answer's line: nothing for an answer that ended by itself."""
    match answer.ending:
        case Ending.INTERRUPTED:
            return " [stopped]"
        case Ending.FAILED:
            return f"\n(the answer failed: {answer.error})"
        case Ending.TOKEN_LIMIT if context_full:
            return f"\n(the context is full after {limit} tokens: /reset, or a bigger --ctx)"
        case Ending.TOKEN_LIMIT:
            return f"\n(cut at {limit} tokens: -n sets the limit)"
    return ""


async def _answer(
    route: RouteHandle,
    settings: SamplingSettings,
    prompt: list[int],
    limit: int,
    show: Callable[[str], None],
    notice: Notice,
    speculation: Speculation | None = None,
) -> Answer:
    """One answer, shown as it comes; Ctrl-C meanwhile cancels its session (and only it)."""
    assert route.tokenizer is not None
    loop = asyncio.get_running_loop()
    prefilling = loop.call_later(PREFILL_NOTICE_SECONDS, notice, f"prefilling {len(prompt)} tokens")
    interrupted = asyncio.Event()
    previous = signal.getsignal(signal.SIGINT)
    loop.add_signal_handler(signal.SIGINT, interrupted.set)  # before the session: no gap
    try:
        with _ctrl_c_read_from_the_terminal(loop, interrupted.set):
            handle, output = start_text(
                route.manager,
                route.tokenizer,
                prompt,
                max_new_tokens=limit,
                on_text=show,
                stop_texts=settings.stop,
                sampler=settings.sampler(),
                on_token=lambda _token: prefilling.cancel(),
                speculation=speculation,
            )
            waiting = asyncio.ensure_future(handle.wait())
            pressed = asyncio.ensure_future(interrupted.wait())
            try:
                await asyncio.wait({waiting, pressed}, return_when=asyncio.FIRST_COMPLETED)
                if interrupted.is_set():
                    handle.cancel("interrupted (Ctrl-C)")
                result = await waiting
            finally:
                pressed.cancel()
    finally:
        prefilling.cancel()
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, previous)  # the runner's own, which it removes itself
    show(output.flush())
    # no session runs now: this waits for the answer's close calls to its stages, which would
    # otherwise wait for the next answer (the loop does not run while you type)
    await route.manager.aclose()
    tokens = len(result.tokens)
    if interrupted.is_set():
        ending = Ending.INTERRUPTED
    elif output.stopped_at is not None:
        ending = Ending.STOP_TEXT
    elif result.error is not None:
        return Answer(output.text, Ending.FAILED, tokens, failure_line(result.error))
    elif tokens and result.tokens[-1] in route.tokenizer.eog_tokens:
        ending = Ending.END_OF_TURN
    else:
        ending = Ending.TOKEN_LIMIT
    return Answer(output.text, ending, tokens)


@contextmanager
def _ctrl_c_read_from_the_terminal(
    loop: asyncio.AbstractEventLoop, on_ctrl_c: Callable[[], None]
) -> Iterator[None]:
    """While the model answers, a terminal's Ctrl-C is read as a key, not sent as SIGINT.

    A terminal sends SIGINT to its whole foreground process group, and the workers ``--spawn``
    starts are in it: they would stop with the answer. So the terminal's signal keys and echo
    are off meanwhile and this loop reads the keys: Ctrl-C calls ``on_ctrl_c``, other keys are
    dropped (what you type while the model answers is not kept). Restored on the way out.
    Without a terminal on standard input nothing changes (SIGINT is handled as a signal)."""
    stdin = sys.stdin
    if stdin is None or not stdin.isatty():
        yield
        return
    import termios

    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)
    keys = termios.tcgetattr(fd)
    keys[3] &= ~(termios.ISIG | termios.ICANON | termios.ECHO)  # local modes
    keys[6][termios.VMIN], keys[6][termios.VTIME] = 1, 0
    ctrl_c = saved[6][termios.VINTR]  # the terminal's own interrupt key (Ctrl-C by default)
    ctrl_c = ctrl_c if isinstance(ctrl_c, bytes) else bytes([ctrl_c])

    def read_keys() -> None:
        if ctrl_c in os.read(fd, 1024):
            on_ctrl_c()

    termios.tcsetattr(fd, termios.TCSANOW, keys)
    loop.add_reader(fd, read_keys)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSAFLUSH, saved)  # keys typed meanwhile are dropped


def _line_editing() -> None:
    """Line editing and history at the prompt (the standard library's readline, where the
    platform has it): plain ``input()`` gains them by importing it."""
    if sys.stdin is not None and sys.stdin.isatty():
        try:
            import readline  # noqa: F401
        except ImportError:
            pass
