"""The route-session state machine: states, the transition table, and the shared Machine.

Theory of operation
===================

A route session turns a prompt into tokens over a *route*: stages, each owning a contiguous layer
range on some endpoint, chained stage 0 -> last. The session is a sans-I/O object
(:class:`~dgr_session.core.RouteSession`): a driver feeds it events and executes the commands
it returns. This module holds only *which state follows which*, as data; the core decides which
trigger an event amounts to and what commands go with it.

Happy path::

    new --route_assigned--> opening --stages_opened--> prefilling --token_accepted--> decoding
    decoding --token_accepted--> decoding ... --finished--> done

* ``new``: created; the core has asked the provider for a first route.
* ``route_assigned`` increments the *epoch*. Every command and every answer carries
  ``(session_id, epoch, step)``; answers of an epoch that is no longer live are dropped and
  counted, never applied.
* ``opening``: every stage of the route opens the session's sequence for the epoch (in
  parallel). A stage that held an older epoch of this session discards it: a cache miss.
* ``prefilling``: the prompt *and every token accepted so far* from position 0, relayed stage
  to stage, produces the next token. After a route change this is the re-prefill: accepted
  tokens are replayed, never resampled, in batched forwards (``FailurePolicy.replay``
  ``"batched"``) or in the first run's batching (``"exact"``: the prompt in its chunks, then one
  forward per accepted token, so every shard rebuilds its KV bit for bit), and no KV or
  auxiliary state ever moves between workers.
* ``decoding``: one forward per token, at the next position.

Loss and recovery::

    opening | prefilling | decoding --stage_lost--> route_lost --backoff_elapsed--> rerouting
    new | rerouting --route_refused--> route_lost          (no route, invalid route, too late)
    rerouting --route_assigned--> opening --> prefilling (re-prefill) --> decoding

* ``stage_lost``: a stage died, missed the step deadline, returned an engine error or broke
  protocol, or answered busy at open (no free session slot: load, which spends the admission
  budget and not the failure budget). The core closes every stage of the epoch (the epoch is
  dead from here on) and backs off per the policy's schedule (after busy: the worker's hint).
* ``route_lost``: waiting out the backoff. ``rerouting``: waiting for the provider's answer.

Terminal states (no trigger leaves them)::

    any live state --exhausted--> failed        (budget spent, session deadline passed, a
                                                 call failed in the client: ClientFailure, or
                                                 a refusal that would repeat: RouteRefused,
                                                 RequestRefused)
    any live state --cancel-----> cancelled     (stages of the live epoch are closed)
    prefilling | decoding --finished--> done    (max_new_tokens reached or a stop token)

``failed`` and ``cancelled`` are absorbing; ``done`` has no exits either. A trigger with no
entry for the current state is refused with :class:`~dgr_session.errors.InvalidTransition` and
changes nothing.

One :class:`SessionMachine` (per thread) serves every session: sessions are its models. It binds
nothing onto them (transitions would attach two partials per trigger and one per state to each
model), keeps only weak references, and forgets a session when it ends. ``transitions`` runs no
callbacks for us: there is nothing in a transition that could fail half-way, so nothing to roll
back. Logging happens in the core, after the state changed.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from transitions import Machine


class SessionState(enum.StrEnum):
    """States of a route session (values are the names used in the table and the diagram)."""

    NEW = "new"
    OPENING = "opening"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    ROUTE_LOST = "route_lost"
    REROUTING = "rerouting"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = SessionState

#: States no trigger leaves.
TERMINAL_STATES: frozenset[SessionState] = frozenset({S.DONE, S.FAILED, S.CANCELLED})
#: States a session can still act from.
LIVE_STATES: tuple[SessionState, ...] = (
    S.NEW,
    S.OPENING,
    S.PREFILLING,
    S.DECODING,
    S.ROUTE_LOST,
    S.REROUTING,
)
#: States in which the session holds stages of a live epoch.
HOLDING_STATES: frozenset[SessionState] = frozenset({S.OPENING, S.PREFILLING, S.DECODING})

#: One line per state, for the docs.
STATE_DOCS: Mapping[SessionState, str] = {
    S.NEW: "created; waiting for the first route",
    S.OPENING: "opening every stage of the route for a fresh epoch",
    S.PREFILLING: "forwarding prompt + accepted tokens from position 0 (first prefill or replay)",
    S.DECODING: "forwarding one token per step",
    S.DONE: "finished: max_new_tokens reached or a stop token (terminal)",
    S.ROUTE_LOST: "a fault closed the epoch; waiting out the backoff",
    S.REROUTING: "waiting for the route provider's answer",
    S.FAILED: "failure budget or session deadline spent (absorbing)",
    S.CANCELLED: "cancelled by the caller; stages closed (absorbing)",
}

#: The transition table: ``(trigger, sources, dest)``. Order is the diagram's order.
TRANSITIONS: tuple[tuple[str, tuple[SessionState, ...], SessionState], ...] = (
    ("route_assigned", (S.NEW, S.REROUTING), S.OPENING),
    ("stages_opened", (S.OPENING,), S.PREFILLING),
    ("token_accepted", (S.PREFILLING, S.DECODING), S.DECODING),
    ("finished", (S.PREFILLING, S.DECODING), S.DONE),
    ("stage_lost", (S.OPENING, S.PREFILLING, S.DECODING), S.ROUTE_LOST),
    ("route_refused", (S.NEW, S.REROUTING), S.ROUTE_LOST),
    ("backoff_elapsed", (S.ROUTE_LOST,), S.REROUTING),
    ("exhausted", LIVE_STATES, S.FAILED),
    ("cancel", LIVE_STATES, S.CANCELLED),
)

#: ``(state, trigger) -> next state``, derived from :data:`TRANSITIONS`.
NEXT_STATE: Mapping[tuple[str, str], SessionState] = {
    (source.value, trigger): dest for trigger, sources, dest in TRANSITIONS for source in sources
}

#: Trigger names, in table order.
TRIGGERS: tuple[str, ...] = tuple(trigger for trigger, _, _ in TRANSITIONS)


class SessionMachine(Machine):
    """One ``transitions`` Machine built from :data:`TRANSITIONS`, shared by many sessions.

    Not thread-safe (``transitions`` is not): use :func:`shared_machine`, which keeps one per
    thread. A session is touched by one task at a time.

    ``direct`` (default): table transitions are applied from :meth:`direct_table` (see
    :meth:`fire`); ``False``: every trigger goes through the library's dispatch (the reference
    the tests compare against).
    """

    def __init__(self, *, direct: bool = True) -> None:
        super().__init__(
            model=None,
            states=[state.value for state in SessionState],
            initial=S.NEW.value,
            transitions=[
                {"trigger": trigger, "source": [s.value for s in sources], "dest": dest.value}
                for trigger, sources, dest in TRANSITIONS
            ],
            auto_transitions=False,
            queued=False,  # no callbacks: a trigger never fires another one
            ignore_invalid_triggers=False,
            model_attribute="_state",
            name="route-session",
        )
        # Invariant: holds every model added and not yet removed, weakly (a session dropped
        # without ending must not be kept alive by the machine).
        self._members: weakref.WeakSet[Any] = weakref.WeakSet()
        self._direct: dict[tuple[str, str], str] = self.direct_table() if direct else {}

    def direct_table(self) -> dict[tuple[str, str], str]:
        """``(state, trigger) -> next state`` read from this machine's own events, for the
        transitions that run nothing on the way: every one of them while the machine has no
        callbacks, conditions or hooks (it has none: see the module's docs), else none.

        :meth:`fire` applies these by assignment; ``tests/session/test_session_machine.py``
        checks that this gives the library's own dispatch result for every state and trigger."""
        hooks = (
            self.before_state_change,
            self.after_state_change,
            self.prepare_event,
            self.finalize_event,
            self.on_exception,
            self.on_final,
        )
        if any(hooks) or any(s.on_enter or s.on_exit for s in self.states.values()):
            return {}
        table: dict[tuple[str, str], str] = {}
        for trigger, event in self.events.items():
            for source, candidates in event.transitions.items():
                if len(candidates) != 1:
                    return {}
                (transition,) = candidates
                if (
                    transition.conditions
                    or transition.prepare
                    or transition.before
                    or transition.after
                ):
                    return {}
                table[(source, trigger)] = transition.dest or source
        return table

    def add_model(self, model: Any, initial: Any = None) -> None:
        """Register session(s): set the initial state and bind nothing onto them.

        Triggers are fired through :meth:`fire`, never through per-model methods, so a session
        costs the machine one weak reference instead of dozens of bound partials, and adding or
        removing one is O(1) instead of a scan of ``Machine.models``.
        """
        state = S.NEW.value if initial is None else str(initial)
        if state not in self.states:
            raise ValueError(f"{state!r} is not a state of {self.name.strip(': ')}")
        for mod in model if isinstance(model, list) else [model]:
            mod._state = state  # what the library's set_state does for a plain state name
            self._members.add(mod)

    def remove_model(self, model: Any) -> None:
        """Forget session(s). Their state attribute stays as it was."""
        for mod in model if isinstance(model, list) else [model]:
            self._members.discard(mod)

    @property
    def member_count(self) -> int:
        """Number of sessions registered and not yet removed (or collected)."""
        return len(self._members)

    def fire(self, model: Any, trigger: str) -> None:
        """Run ``trigger`` for one session. The caller has checked :data:`NEXT_STATE`.

        A transition of :meth:`direct_table` has nothing to run (the machine has no callbacks),
        so it is applied by setting the session's state, without the library's event dispatch
        (18-25 us a trigger on this project's 2-core VM, most of a state change's cost). Any
        other trigger, including one the table does not allow (``MachineError``), and every
        trigger of a machine built with ``direct=False``, goes through ``transitions``."""
        dest = self._direct.get((model._state, trigger))
        if dest is not None:
            model._state = dest
            return
        self.events[trigger].trigger(model)


_local = threading.local()


def shared_machine() -> SessionMachine:
    """The calling thread's shared :class:`SessionMachine` (created on first use)."""
    machine: SessionMachine | None = getattr(_local, "machine", None)
    if machine is None:
        machine = SessionMachine()
        _local.machine = machine
    return machine


def mermaid(
    transitions: Iterable[tuple[str, tuple[SessionState, ...], SessionState]] = TRANSITIONS,
) -> str:
    """The state diagram of ``transitions`` as a mermaid ``stateDiagram-v2`` block body."""
    lines = ["stateDiagram-v2", f"    [*] --> {S.NEW.value}"]
    for trigger, sources, dest in transitions:
        for source in sources:
            lines.append(f"    {source.value} --> {dest.value}: {trigger}")
    for state in SessionState:
        if state in TERMINAL_STATES:
            lines.append(f"    {state.value} --> [*]")
    return "\n".join(lines) + "\n"


def state_diagram_markdown() -> str:
    """The whole ``docs/state-diagram.md`` document, generated from the table."""
    rows = "\n".join(f"| `{state.value}` | {STATE_DOCS[state]} |" for state in SessionState)
    return (
        "# Route-session state diagram\n\n"
        "<!-- Generated by scripts/gen_state_diagram.py from dgr_session/machine.py;"
        " do not edit by hand. -->\n\n"
        "```mermaid\n"
        f"{mermaid()}"
        "```\n\n"
        "| state | meaning |\n"
        "|---|---|\n"
        f"{rows}\n"
    )
