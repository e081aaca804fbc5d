"""Chained routes (``docs/chain.md``): a :class:`~dgr_session.transport.StageTransport` where
each stage sends its output straight to the next one and only the last stage's output comes
back, over whichever data path the epoch takes (``client/channel.py``).

* ``transport``: :class:`ChainStageTransport`, the route session's transport: links each
  epoch's route, sends its frames and answers the session's forwards from their outcomes;
* ``epoch``: one (session, epoch)'s frames in flight and the streams they take;
* ``tickets``: a frame's outcome as the session relays it, and what chained frames cost;
* ``silence``: which stage of a route went silent while a frame is overdue.
"""

from __future__ import annotations

from dgr_engine.client.chained.silence import SilenceWatch
from dgr_engine.client.chained.tickets import ChainRecord, ChainStats, ChainTicket, RingMismatch
from dgr_engine.client.chained.transport import DATA_PATHS, ChainStageTransport

__all__ = [
    "DATA_PATHS",
    "ChainRecord",
    "ChainStageTransport",
    "ChainStats",
    "ChainTicket",
    "RingMismatch",
    "SilenceWatch",
]
