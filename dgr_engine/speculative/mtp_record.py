"""DGR-070's MTP record (``docs/speculative.md``): the ownership contract as served, the
implementation's parity and the benchmark's figures, judged from one :func:`measure_mtp` run.

* ``mtp.contract``: on every route measured, only the last stage loaded the MTP block and only
  it advertised it (nothing else holds it; nothing new crosses a seam: the frames are the
  verification passes' own).
* ``mtp.implementation``: every session drafting with MTP, over the relay, a chain and a ring
  at every stage count, gave the whole model's plain greedy tokens.
* ``mtp.benchmark``: drafts per pass, the last stage's cost per draft and the acceptance were
  measured. On a random-weight fixture acceptance says nothing about a trained model's, so the
  record says so and claims no speed-up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dgr_engine.certification.record import Figure, Requirement, Verdict

RANDOM_WEIGHTS = (
    "random-weight fixture: acceptance says nothing about a trained model's, no speed-up is claimed"
)


def mtp_figures(run: Mapping[int, Mapping[str, Any]]) -> list[Figure]:
    """The record's figures from ``measure_mtp``'s result, per stage count."""
    figures: list[Figure] = []
    for stages, f in sorted(run.items()):
        scenario = f"{stages} stages"
        passes, drafted, accepted = int(f["passes"]), int(f["drafted"]), int(f["accepted"])
        figures += [
            Figure("mtp.passes", float(passes), "passes", scenario),
            Figure("mtp.drafts_per_pass", drafted / passes if passes else 0.0, "drafts", scenario),
            Figure("mtp.acceptance", accepted / drafted if drafted else 0.0, "ratio", scenario),
        ]
        if f.get("draft_ms_per_token") is not None:
            ms = float(f["draft_ms_per_token"])
            figures.append(Figure("mtp.draft_ms", ms, "ms per draft, last stage", scenario))
    return figures


def mtp_requirements(
    run: Mapping[int, Mapping[str, Any]], *, fixture: bool, transports: Sequence[str]
) -> list[Requirement]:
    """``mtp.contract``, ``mtp.implementation`` and ``mtp.benchmark`` from ``run``."""
    counts = ", ".join(str(n) for n in sorted(run))
    ways = "/".join(transports)
    owners_ok = all(bool(f["contract_ok"]) for f in run.values())
    bad = [n for n, f in sorted(run.items()) if not f["contract_ok"]]
    contract = Requirement(
        "mtp.contract",
        Verdict.PASS if owners_ok and run else Verdict.FAIL,
        f"only the last stage loaded and advertised the MTP block at {counts} stages"
        if owners_ok and run
        else f"the MTP block was loaded or advertised elsewhere than the last stage at {bad}",
    )
    equal = [n for n, f in sorted(run.items()) if f["tokens_equal"]]
    implementation = Requirement(
        "mtp.implementation",
        Verdict.PASS if run and len(equal) == len(run) else Verdict.FAIL,
        f"MTP drafts verified over {ways} at {counts} stages: tokens equal plain greedy's"
        if run and len(equal) == len(run)
        else f"tokens differ from plain greedy's at {sorted(set(run) - set(equal))} stages",
    )
    drafted = sum(int(f["drafted"]) for f in run.values())
    passes = sum(int(f["passes"]) for f in run.values())
    accepted = sum(int(f["accepted"]) for f in run.values())
    timed = [float(f["draft_ms_per_token"]) for f in run.values() if f.get("draft_ms_per_token")]
    measured = passes > 0 and drafted > 0 and bool(timed)
    detail = (
        f"{drafted / passes:.2f} drafts per pass, {max(timed):.3f} ms per draft on the last "
        f"stage at most, acceptance {accepted / drafted:.2f}"
        if measured
        else "no MTP drafts were made"
    )
    if measured and fixture:
        detail += f" ({RANDOM_WEIGHTS})"
    benchmark = Requirement("mtp.benchmark", Verdict.PASS if measured else Verdict.FAIL, detail)
    return [contract, implementation, benchmark]


__all__ = ["RANDOM_WEIGHTS", "mtp_figures", "mtp_requirements"]
