"""SmolLM2's lane for the slow tests of ``dgr serve`` (end to end, the page, the benchmark's
smoke run): the model fetched through ``dgr_engine.models`` (cached) and its lane certified on
this machine under an operator lock of the suite's own, kept in dgr's cache (certified once per
machine, build and repo lock, about 2.5 min on 2 cores; reused after), as
``tests/e2e/test_e2e_generate.py`` does. Starts worker processes: slow tests only."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import attrs

from dgr_engine.options import EngineOptions

SMOLLM2 = "smollm2-135m-instruct"
OPTIONS = EngineOptions()
"""The lane's engine options: ``dgr certify``'s (the one set of defaults)."""


@attrs.frozen
class Lane:
    model: Path
    lock: Path
    evidence: Path

    def serve_args(self) -> list[str]:
        """``dgr serve``'s arguments for this lane: the options, the lock, the evidence."""
        return [*OPTIONS.worker_argv(), "--lock", str(self.lock), "--evidence", str(self.evidence)]


@functools.cache
def certified_lane() -> Lane:
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.cli._demo_operator import operator_lock
    from dgr_engine.cli.certify import certify_or_reuse
    from dgr_engine.models import lookup
    from dgr_engine.models.resolve import resolve_model
    from dgr_engine.tooling.peer_build import PeerUse
    from tests.harness import run

    model = resolve_model(SMOLLM2)
    cache = Path(os.environ.get("DGR_CACHE_DIR") or Path.home() / ".cache" / "dgr")
    entry = lookup(SMOLLM2)
    operator = operator_lock(
        load_lock(),
        cache / "tests" / "smollm2-operator",
        name=entry.name,
        arch=entry.arch,
        sha256=entry.sha256,
    )
    certified = certify_or_reuse(
        model, OPTIONS, operator.lock, operator.evidence, True, key=operator.key, rpc=PeerUse.OFF
    )
    assert run(certified, limit=900) == 0
    return Lane(model, operator.lock.path, operator.evidence)
