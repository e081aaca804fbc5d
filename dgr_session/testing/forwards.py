"""Build the core's :class:`~dgr_session.commands.Forward` by hand, to call a transport directly.

A :class:`~dgr_session.transport.StageTransport` takes the ``Forward`` command the session core
emits. A test that drives a transport without a core builds one with :func:`forward_call`.
"""

from __future__ import annotations

from collections.abc import Iterable

from dgr_session.commands import Forward, ForwardKind
from dgr_session.route import StageSpec


def forward_call(
    stage: StageSpec,
    session_id: str,
    epoch: int,
    step: int,
    positions: range,
    token_ids: Iterable[int],
    boundary: object = None,
    *,
    stage_index: int = 0,
    wants_logits: bool = True,
    kind: ForwardKind = ForwardKind.DECODE,
) -> Forward:
    """The ``Forward`` the core would emit for this stage. ``final`` follows the stage (it
    produces logits when its ``boundary_out`` is 0); ``stage_index`` is the driver's and no
    transport reads it."""
    return Forward(
        session_id=session_id,
        epoch=epoch,
        step=step,
        stage_index=stage_index,
        stage=stage,
        positions=positions,
        token_ids=tuple(int(t) for t in token_ids),
        boundary=boundary,
        final=stage.boundary_out == 0,
        wants_logits=wants_logits,
        kind=kind,
    )
