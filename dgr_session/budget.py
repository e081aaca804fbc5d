"""What a route session has spent of its :class:`~dgr_session.policy.FailurePolicy`.

:class:`FailureBudget` counts faults at the current step, route changes and the time spent
waiting for busy stages, and keeps the clocks the policy bounds: the session deadline, the
deadline of the current wait (route request, opening, or one step's forward) and the end of a
backoff. It decides nothing: the session core (:mod:`dgr_session.core`) asks it what is spent
and acts. Time comes from the core, which has it from events (sans-I/O).
"""

from __future__ import annotations

from dgr_session.policy import FailurePolicy


class FailureBudget:
    """One session's spending against ``policy``; mutable, owned by one session.

    Invariants: ``faults_at_step`` counts the faults since the last accepted token;
    ``route_changes`` counts the route assignments after the first that did not follow a busy
    answer; ``busy_since`` is set from the first of a run of busy answers until every stage of
    a route opened; ``wait_deadline`` is ``None`` while nothing is awaited.
    """

    __slots__ = (
        "policy",
        "deadline_at",
        "wait_since",
        "wait_deadline",
        "backoff_until",
        "route_changes",
        "faults_at_step",
        "busy_since",
        "busy_retry",
    )

    def __init__(self, policy: FailurePolicy) -> None:
        #: The bounds.
        self.policy = policy
        #: Clock time the session deadline passes (set at start).
        self.deadline_at = 0.0
        #: Clock time the current wait began.
        self.wait_since = 0.0
        #: Clock time the current wait times out (``None``: nothing awaited).
        self.wait_deadline: float | None = None
        #: Clock time the backoff of ``route_lost`` ends.
        self.backoff_until = 0.0
        #: Route assignments after the first (busy retries not counted).
        self.route_changes = 0
        #: Faults at the current step.
        self.faults_at_step = 0
        #: When the first of a run of busy answers came (``None``: not waiting for a slot).
        self.busy_since: float | None = None
        #: Whether the next route assignment follows a busy answer (then it is not a route
        #: change: load spends the admission budget only).
        self.busy_retry = False

    @property
    def attempts(self) -> int:
        """Attempts at the current step so far (1 + faults at this step)."""
        return self.faults_at_step + 1

    # ----------------------------------------------------------------------------------------
    # Clocks

    def start(self, now: float) -> None:
        """The session started at ``now``: its deadline counts from here."""
        self.deadline_at = now + self.policy.session_deadline

    def begin_wait(self, now: float) -> None:
        """A wait (route request, opening, one step's forward) begins: one step deadline."""
        self.wait_since = now
        self.wait_deadline = now + self.policy.step_deadline

    def end_wait(self) -> None:
        """Nothing is awaited any more."""
        self.wait_deadline = None

    def waited(self, now: float) -> float:
        """Seconds the current wait has lasted at ``now``."""
        return now - self.wait_since

    def session_over(self, now: float) -> bool:
        """True once the session deadline passed."""
        return now >= self.deadline_at

    def wait_over(self, now: float) -> bool:
        """True once the current wait ran past its step deadline."""
        return self.wait_deadline is not None and now >= self.wait_deadline

    def backoff_over(self, now: float) -> bool:
        """True once the backoff of ``route_lost`` ended."""
        return now >= self.backoff_until

    def next_timer(self, *, backing_off: bool) -> float:
        """The next clock time a deadline passes or (``backing_off``) the backoff ends."""
        when = self.deadline_at
        if backing_off:
            return min(when, self.backoff_until)
        if self.wait_deadline is not None and self.wait_deadline < when:
            return self.wait_deadline
        return when

    # ----------------------------------------------------------------------------------------
    # Spending

    def fault(self) -> int:
        """One fault at the current step; returns its attempt number (1, 2, ...)."""
        self.faults_at_step += 1
        self.busy_retry = False
        return self.faults_at_step

    def spent(self, *, routed: bool) -> str | None:
        """What of the budget the faults so far spent, in words (``None``: some is left).
        ``routed``: a route was ever assigned (only then can route changes run out)."""
        policy = self.policy
        if self.faults_at_step >= policy.max_attempts_per_step:
            return f"attempt {self.faults_at_step} of {policy.max_attempts_per_step} at step"
        if routed and self.route_changes >= policy.max_route_changes:
            return f"route changes {self.route_changes} of {policy.max_route_changes} at step"
        return None

    def back_off(self, now: float, faults: int) -> bool:
        """Starts the backoff after the session's ``faults``-th fault; True if it is already
        over (no wait)."""
        delay = self.policy.backoff_after(faults)
        self.backoff_until = now + delay
        return delay <= 0

    def token_accepted(self) -> None:
        """A token was accepted: the next step starts with every attempt."""
        self.faults_at_step = 0

    def route_assigned(self, *, first: bool) -> None:
        """A route was accepted; it is a route change unless it is the first or follows a busy
        answer."""
        if not first and not self.busy_retry:
            self.route_changes += 1
        self.busy_retry = False

    # ----------------------------------------------------------------------------------------
    # Admission

    def busy(self, now: float) -> float:
        """A stage was busy: returns the seconds spent waiting for slots in this run of busy
        answers (it began with the opening that got the first)."""
        if self.busy_since is None:
            self.busy_since = self.wait_since  # the opening began then
        return now - self.busy_since

    def admission_spent(self, waited: float) -> bool:
        """True once ``waited`` seconds used up the admission budget."""
        return waited >= self.policy.admission_budget

    def busy_back_off(self, now: float, retry_after: float | None, waited: float) -> bool:
        """Waits the worker's hint (or the policy's ``busy_retry``), never past the admission
        budget; the next route assignment is then no route change. True if the wait is already
        over."""
        policy = self.policy
        delay = policy.busy_retry if retry_after is None else max(retry_after, 0.0)
        self.backoff_until = now + min(delay, policy.admission_budget - waited)
        self.busy_retry = True
        return self.backoff_until <= now

    def admitted(self) -> None:
        """Every stage of a route opened: the run of busy answers is over."""
        self.busy_since = None
