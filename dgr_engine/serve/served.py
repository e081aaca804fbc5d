"""The route a server answers with: its ``SessionManager``, the model's tokenizer, a session's
context, where its stages are read from, and how each request becomes a :class:`TextJob`
(prompt checked against the context, the token limit, the sampler, the stop strings)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence

import attrs

from dgr_engine.engine.sampling import SeededSampler
from dgr_engine.errors import EngineError
from dgr_engine.serve.errors import BadRequest, ContextLengthExceeded
from dgr_engine.serve.generation import Generation, TextJob
from dgr_engine.serve.metrics import ServeMetrics
from dgr_engine.serve.protocol import SamplingFields
from dgr_engine.serve.route_view import StageSource
from dgr_engine.tokenizer import Tokenizer
from dgr_session import FailurePolicy, SessionManager
from dgr_session.sampling import InvalidSamplingParameter, Sampler, Sampling, greedy
from dgr_session.speculation import Speculation

DEFAULT_TEMPERATURE = 1.0
"""A request's temperature when it gives none (OpenAI's default); 0 is greedy."""


@attrs.define(eq=False)
class ServedRoute:
    """What ``dgr serve`` serves. The manager, tokenizer and stages belong to the caller, who
    opened the route and closes it."""

    manager: SessionManager
    tokenizer: Tokenizer
    model: str
    """The model's name in answers and ``/v1/models``."""
    context: int
    """KV positions a session may use on this route (its smallest stage's)."""
    stages: StageSource
    """Where ``/v1/route`` reads the stages from."""
    policy: FailurePolicy | None = None
    """Each request's session policy (``None``: the manager's)."""
    speculations: Callable[[], Speculation] | None = None
    """Each request's speculative decoding, made new for it (``None``: none): the same text,
    greedy or seeded, in fewer passes (``docs/speculative.md``)."""
    created: int = attrs.field(factory=lambda: int(time.time()))
    """When the server started (unix seconds)."""
    # Invariant: the tokenizer's end-of-generation tokens, read once (a pass over the vocab).
    eog: frozenset[int] = attrs.field(init=False)
    metrics: ServeMetrics = attrs.field(init=False)
    """The server's own metrics (``GET /metrics``)."""

    def __attrs_post_init__(self) -> None:
        self.eog = self.tokenizer.eog_tokens
        self.metrics = ServeMetrics(sessions_open=lambda: float(len(self.manager)))

    # -- prompts ------------------------------------------------------------------------------

    def chat_prompt(self, conversation: Sequence[tuple[str, str]]) -> list[int]:
        """The conversation through the model's chat template, ready for the assistant."""
        try:
            text = self.tokenizer.chat(conversation)
        except EngineError as exc:
            raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from None
        return self.tokenizer.encode(text, parse_special=True)

    def text_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """A completion's prompt: text (with the BOS the model wants) or token ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        n_vocab = self.tokenizer.info.n_vocab
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise BadRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})", param="prompt"
            )
        return list(prompt)

    # -- jobs ---------------------------------------------------------------------------------

    def job(
        self,
        prompt: Sequence[int],
        *,
        limit: int | None,
        limit_given: bool,
        sampler: Sampler,
        stop: Sequence[str],
        param: str,
    ) -> TextJob:
        """The job of a request: ``limit`` tokens at most (``None``: as many as the context
        holds; a default ``limit`` the caller did not give is cut to fit, a given one that does
        not fit is :class:`ContextLengthExceeded`, as is a prompt that fills the context)."""
        if not prompt:
            raise BadRequest("the prompt is empty", param=param)
        room = self.context - len(prompt)
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt)} tokens; a session on this route holds "
                f"{self.context} (the model's maximum context length here), leaving no room "
                "for an answer",
                param=param,
            )
        if limit is None:
            limit = room
        elif limit > room:
            if limit_given:
                raise ContextLengthExceeded(
                    f"the prompt has {len(prompt)} tokens and {limit} more were asked for; a "
                    f"session on this route holds {self.context} (at most {room} more)",
                    param="max_tokens",
                )
            limit = room
        return TextJob(tuple(prompt), limit, sampler, tuple(stop))

    def start(self, job: TextJob) -> Generation:
        """Starts the job's session (needs the manager's running loop)."""
        return Generation(
            self.manager,
            self.tokenizer,
            job,
            stop_tokens=self.eog,
            policy=self.policy,
            speculation=None if self.speculations is None else self.speculations(),
            clock=self.metrics.session(len(job.prompt)),
        )


def sampler_for(body: SamplingFields) -> Sampler:
    """The sampler of a request's fields (:class:`BadRequest` for a value out of range):
    :data:`~dgr_session.sampling.greedy` at temperature 0 without penalties, else dgr's
    seeded sampler (a random seed when none is given), which the route's last stage applies."""
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    try:
        sampling = Sampling(
            secrets.randbelow(1 << 63) if body.seed is None else body.seed,
            temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repeat_penalty is None else body.repeat_penalty,
            penalty_last_n=64 if body.penalty_last_n is None else body.penalty_last_n,
        )
    except InvalidSamplingParameter as exc:
        raise BadRequest(str(exc)) from None
    return greedy if sampling.is_greedy else SeededSampler(sampling)
