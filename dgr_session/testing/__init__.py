"""Public test doubles of the control plane, for users' own suites (as ``trio.testing`` is).

``fake_model`` (a deterministic layered model), ``fake_transport`` (stages over it with fault
injection), ``reply_gate`` (holding and releasing replies), ``providers`` (route providers),
``routes`` (fixture identities, lanes and routes), ``forwards`` (a core's ``Forward`` built by
hand, to call a transport directly), ``null_transport`` (benchmarks),
``virtual_clock`` (an asyncio loop on virtual time). Production code never imports them.
"""

from dgr_session.testing.fake_model import FakeModel
from dgr_session.testing.fake_transport import Call, FakeEngineError, FakeTransport
from dgr_session.testing.forwards import forward_call
from dgr_session.testing.null_transport import NullTransport
from dgr_session.testing.providers import (
    HANG,
    FixedRouteProvider,
    PoolRouteProvider,
    ScriptedRouteProvider,
)
from dgr_session.testing.reply_gate import ReplyGate
from dgr_session.testing.routes import fixture_identity, fixture_lane, fixture_recipe, make_route
from dgr_session.testing.virtual_clock import VirtualClockLoop, close_loop, run_virtual, settle

__all__ = [
    "HANG",
    "Call",
    "FakeEngineError",
    "FakeModel",
    "FakeTransport",
    "FixedRouteProvider",
    "NullTransport",
    "PoolRouteProvider",
    "ReplyGate",
    "ScriptedRouteProvider",
    "VirtualClockLoop",
    "close_loop",
    "fixture_identity",
    "fixture_lane",
    "fixture_recipe",
    "forward_call",
    "make_route",
    "run_virtual",
    "settle",
]
