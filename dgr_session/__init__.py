"""dgr_session: the control plane of dgr (route sessions over shard workers).

A *route* is an ordered list of stages covering a model's layers ``[0, n_layer)`` exactly once.
A *route session* prefills a prompt, decodes token by token, and survives the loss of a stage by
moving to a new route under a new epoch: a cache miss and a re-prefill of the prompt plus every
accepted token, never a KV migration. Failure is bounded by a :class:`FailurePolicy` and ends in
a typed error.

* :class:`RouteSession` is the sans-I/O core: events in, commands out.
* :class:`SessionManager` drives many sessions over a :class:`StageTransport` and a
  :class:`RouteProvider` (the tracker's role) with asyncio.

The library logs through loguru under the name ``dgr_session`` and is disabled by default;
applications that want its lines call ``logger.enable("dgr_session")`` and add their own sinks.
"""

from loguru import logger

from dgr_session.commands import (
    CloseStage,
    Command,
    EmitToken,
    Finish,
    FinishReason,
    Forward,
    ForwardKind,
    OpenStage,
    RequestRoute,
)
from dgr_session.core import RouteSession
from dgr_session.errors import (
    AdmissionTimeout,
    BoundaryMismatch,
    ClientFailure,
    DarkLane,
    DgrError,
    FailureBudgetExhausted,
    InsufficientEvidence,
    InvalidTransition,
    NonFiniteLogits,
    NoRoute,
    NoRouteAvailable,
    RequestRefused,
    RouteIncompatible,
    RouteInvalid,
    RouteRefused,
    RouteStalled,
    SessionCancelled,
    SessionDeadlineExceeded,
    SessionFailed,
    StageBusy,
    StageDead,
    StageUnreachable,
    StaleEpoch,
    StepDeadlineExceeded,
    UnverifiedCertification,
)
from dgr_session.events import (
    Cancel,
    ClockTick,
    Event,
    RouteAssigned,
    RouteUnavailable,
    StageFailed,
    StageOpened,
    StageOutput,
    Start,
)
from dgr_session.faults import FailureReport, FaultKind
from dgr_session.identifiers import InvalidIdentifier, check_session_id
from dgr_session.identity import (
    CertificationStatus,
    EvidenceClass,
    Lane,
    LaneDifference,
    ModelIdentity,
    NearestRecord,
    Recipe,
)
from dgr_session.machine import (
    TRANSITIONS,
    SessionMachine,
    SessionState,
    shared_machine,
)
from dgr_session.manager import SessionHandle, SessionManager, SessionResult, fault_kind
from dgr_session.policy import FailurePolicy, ReplayMode
from dgr_session.route import CertificationVerifier, Route, StageSpec, validate_route
from dgr_session.sampling import GREEDY, InvalidSamplingParameter, Sampler, Sampling, greedy
from dgr_session.transport import (
    Boundary,
    GrantingRouteProvider,
    Logits,
    RouteProvider,
    SessionStart,
    StageResult,
    StageTransport,
    TransportCapabilities,
)
from dgr_session.usage import StageCost, UsageRecord, layer_rows

logger.disable("dgr_session")

__all__ = [
    "StageCost",
    "UsageRecord",
    "layer_rows",
    "TRANSITIONS",
    "AdmissionTimeout",
    "Boundary",
    "BoundaryMismatch",
    "Cancel",
    "CertificationStatus",
    "CertificationVerifier",
    "ClientFailure",
    "ClockTick",
    "CloseStage",
    "Command",
    "DarkLane",
    "DgrError",
    "EmitToken",
    "Event",
    "EvidenceClass",
    "FailureBudgetExhausted",
    "FailurePolicy",
    "FailureReport",
    "FaultKind",
    "Finish",
    "FinishReason",
    "Forward",
    "ForwardKind",
    "InsufficientEvidence",
    "InvalidIdentifier",
    "InvalidTransition",
    "Lane",
    "LaneDifference",
    "Logits",
    "ModelIdentity",
    "NearestRecord",
    "NoRoute",
    "NoRouteAvailable",
    "NonFiniteLogits",
    "OpenStage",
    "Recipe",
    "ReplayMode",
    "RequestRefused",
    "RequestRoute",
    "Route",
    "RouteAssigned",
    "RouteIncompatible",
    "RouteInvalid",
    "RouteRefused",
    "GrantingRouteProvider",
    "RouteProvider",
    "RouteSession",
    "RouteUnavailable",
    "Sampler",
    "Sampling",
    "SessionCancelled",
    "SessionDeadlineExceeded",
    "SessionFailed",
    "SessionHandle",
    "SessionMachine",
    "SessionManager",
    "SessionResult",
    "SessionState",
    "StageBusy",
    "StageDead",
    "StageFailed",
    "StageOpened",
    "StageOutput",
    "StageResult",
    "StageSpec",
    "StageTransport",
    "StageUnreachable",
    "StaleEpoch",
    "Start",
    "RouteStalled",
    "StepDeadlineExceeded",
    "UnverifiedCertification",
    "check_session_id",
    "fault_kind",
    "greedy",
    "GREEDY",
    "InvalidSamplingParameter",
    "shared_machine",
    "validate_route",
    "SessionStart",
    "TransportCapabilities",
]
