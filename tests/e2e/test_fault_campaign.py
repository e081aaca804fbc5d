"""The randomized fault campaign (``dgr_engine.tooling.fault_campaign``) over real worker processes.

Schedules are drawn by hypothesis (so a failing one shrinks and replays): a 4-stage route of
tiny-llama, workers spawned on demand to replace lost ones, 8 concurrent sessions over workers
with 4 slots each (so some opens find them full), and up to 5 faults mixing SIGKILL, stalls
past the step deadline, slow replies, stale and malformed frames aimed at live sessions, and
cancellations. The explicit examples inject one of each, and the schedule that caught issue
28's leaked slots. Invariants, for every schedule:

* every session's tokens are a prefix of the whole model's, and all of them when it is done;
* every failure is typed (``SessionFailed``) and within the policy's bounds; only sessions
  the schedule cancelled are cancelled;
* every hostile frame is refused with a typed error;
* no worker dies unless the schedule killed it;
* after quiescence every live worker holds 0 sessions and its RSS grew by at most
  ``RSS_MARGIN_KIB``.

CI runs ``DGR_CAMPAIGN_EXAMPLES`` schedules (default 3, plus the explicit two); the soak
raises it (``docs/reliability.md``). The tally is printed at the end of the module and, when
``DGR_CAMPAIGN_REPORT`` names a file, written there as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.fault_campaign import CampaignConfig, Fault, FaultAction, run_schedule
from dgr_session import FailurePolicy, SessionCancelled, SessionFailed, SessionState

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

N_SESSIONS = 8
N_TOKENS = 10
LAYOUT = ((0, 1), (1, 2), (2, 3), (3, 4))
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
POLICY = FailurePolicy(
    step_deadline=2.0,
    session_deadline=180.0,
    max_route_changes=6,
    max_attempts_per_step=4,
    backoff=(0.0, 0.25),
    admission_budget=60.0,
)
PROMPTS = tuple(
    tuple(int(t) for t in np.random.default_rng(200 + i).integers(0, 256, size=8))
    for i in range(N_SESSIONS)
)
RSS_MARGIN_KIB = 64 * 1024
EXAMPLES = int(os.environ.get("DGR_CAMPAIGN_EXAMPLES", "3"))

ONE_OF_EACH = [
    Fault(FaultAction.KILL, session=0, at_token=3, stage=1),
    Fault(FaultAction.STALL, session=1, at_token=4, stage=2),
    Fault(FaultAction.SLOW, session=2, at_token=2, stage=3),
    Fault(FaultAction.STALE_FRAME, session=3, at_token=3, stage=2),
    Fault(FaultAction.MALFORMED_FRAME, session=4, at_token=3, stage=1),
    Fault(FaultAction.MALFORMED_FRAME, session=5, at_token=2, stage=0),
    Fault(FaultAction.CANCEL, session=6, at_token=5, stage=0),
]
LEAKING = [
    Fault(FaultAction.KILL, session=5, at_token=5, stage=0),
    Fault(FaultAction.STALL, session=7, at_token=4, stage=0),
    Fault(FaultAction.MALFORMED_FRAME, session=5, at_token=7, stage=3),
]
"""The schedule that caught issue 28's leak: while stage 0's worker was stalled with every
slot taken, four sessions' opens of two epochs queued there; after it resumed, each close of
the newer epoch found the older one, closed it, and the newer epoch's open (still in line)
took the slot it freed. ``tests/worker/test_campaign_leak.py`` forces that interleaving."""

faults_strategy = st.lists(
    st.builds(
        Fault,
        action=st.sampled_from(FaultAction),
        session=st.integers(0, N_SESSIONS - 1),
        at_token=st.integers(1, N_TOKENS - 2),
        stage=st.integers(0, len(LAYOUT) - 1),
    ),
    min_size=1,
    max_size=5,
).filter(lambda faults: sum(f.action is FaultAction.KILL for f in faults) <= 2)


@pytest.fixture(scope="module")
def config(tiny_llama: Path) -> CampaignConfig:
    return CampaignConfig(
        model=tiny_llama,
        layout=LAYOUT,
        prompts=PROMPTS,
        max_new_tokens=N_TOKENS,
        options=OPTIONS,
        policy=POLICY,
    )


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[list[int]]:
    reference = whole_model_reference(tiny_llama, [list(p) for p in PROMPTS], N_TOKENS, OPTIONS)
    return [tokens for tokens, _ in reference]


@pytest.fixture(scope="module")
def tally() -> Iterator[dict[str, Any]]:
    totals: dict[str, Any] = {
        "schedules": 0,
        "sessions": 0,
        "faults_injected": Counter(),
        "hostile_answers": Counter(),
        "outcomes": Counter(),
        "reports_by_fault": Counter(),
        "failures_by_type": Counter(),
        "wrong_tokens": 0,
        "leaked_slots": 0,
        "crashed_workers": 0,
        "max_rss_growth_kib": 0,
    }
    yield totals
    printable = {k: dict(v) if isinstance(v, Counter) else v for k, v in totals.items()}
    print("\nfault campaign:", json.dumps(printable, sort_keys=True))
    path = os.environ.get("DGR_CAMPAIGN_REPORT")
    if path:
        Path(path).write_text(json.dumps(printable, indent=2, sort_keys=True) + "\n")


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@example(faults=ONE_OF_EACH)
@example(faults=LEAKING)
@given(faults=faults_strategy)
def test_fault_campaign_keeps_every_invariant(
    config: CampaignConfig, want: list[list[int]], tally: dict[str, Any], faults: list[Fault]
) -> None:
    check_invariants(config, want, tally, faults)


@pytest.mark.parametrize("faults", [ONE_OF_EACH, LEAKING], ids=["one-of-each", "leaking"])
def test_fault_campaign_over_a_ring_on_the_frame_link(
    config: CampaignConfig, want: list[list[int]], tally: dict[str, Any], faults: list[Fault]
) -> None:
    """The same invariants with the sessions' frames going around a ring over the frame link
    (``docs/data-paths.md``): kills, stalls, slow stages and cancellations end epochs there
    as over the relay, and every session that finishes has the whole model's tokens."""
    check_invariants(attrs.evolve(config, transport="ring"), want, tally, faults)


@pytest.mark.parametrize("faults", [ONE_OF_EACH, LEAKING], ids=["one-of-each", "leaking"])
def test_fault_campaign_over_a_native_ring(
    config: CampaignConfig, want: list[list[int]], tally: dict[str, Any], faults: list[Fault]
) -> None:
    """The same invariants with the sessions' frames going around a ring over native links
    (``docs/native-path.md``): no Python per frame on the workers, and still every fault ends
    its epoch, blames the right stage, and leaves every finished session exact. (``LEAKING``
    over native rings once left a session open on stage 0: its open's reply was lost at the
    stalled worker, and its close, with the older epoch's secret, was refused;
    ``tests/worker/test_campaign_leak.py`` forces that order now.)"""
    check_invariants(attrs.evolve(config, transport="ring-native"), want, tally, faults)


def check_invariants(
    config: CampaignConfig, want: list[list[int]], tally: dict[str, Any], faults: list[Fault]
) -> None:
    outcome = asyncio.run(run_schedule(config, faults))
    cancelled_on_purpose = {f.session for f in faults if f.action is FaultAction.CANCEL}

    wrong = 0
    for index, result in enumerate(outcome.results):
        tokens = list(result.tokens)
        if tokens != want[index][: len(tokens)]:
            wrong += 1
        if result.state is SessionState.DONE:
            assert tokens == want[index], f"session {index}: {tokens} != {want[index]}"
        elif result.state is SessionState.CANCELLED:
            assert index in cancelled_on_purpose, f"session {index} cancelled: {result.error}"
            assert isinstance(result.error, SessionCancelled)
        else:
            assert isinstance(result.error, SessionFailed), repr(result.error)
            assert result.route_changes <= POLICY.max_route_changes
            assert result.error.attempts <= POLICY.max_attempts_per_step
    assert wrong == 0
    assert all(h.answer != "accepted" for h in outcome.hostile), outcome.hostile
    assert outcome.crashed == []
    assert outcome.open_after == dict.fromkeys(outcome.open_after, 0), (
        outcome.open_after,
        outcome.leak_logs,
    )
    assert all(g <= RSS_MARGIN_KIB for g in outcome.rss_growth_kib.values()), outcome

    tally["schedules"] += 1
    tally["sessions"] += len(outcome.results)
    tally["faults_injected"].update(outcome.injected)
    tally["hostile_answers"].update(f"{h.action.value}: {h.answer}" for h in outcome.hostile)
    tally["outcomes"].update(r.state.value for r in outcome.results)
    tally["reports_by_fault"].update(
        report.fault.value for r in outcome.results for report in r.reports
    )
    tally["failures_by_type"].update(
        type(r.error).__name__ for r in outcome.results if r.state is SessionState.FAILED
    )
    tally["wrong_tokens"] += wrong
    tally["leaked_slots"] += sum(outcome.open_after.values())
    tally["crashed_workers"] += len(outcome.crashed)
    tally["max_rss_growth_kib"] = max(
        [tally["max_rss_growth_kib"], *outcome.rss_growth_kib.values()]
    )
