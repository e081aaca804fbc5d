"""The gates of the decision order, evaluated from records against the lock.

Each gate reads only records admitted under the lock and of at least the class it is evaluated
at, and returns one of its verdicts with every reason. Evaluated at fixture class, the verdict
line says so; no verdict at a higher class is reachable from lower-class records, because
those records are not read at all.

* DGR-020 (``go`` / ``optimize baseline`` / ``stop``): baseline records (safetensors against
  whole-model llama.cpp).
* DGR-054 (``alpha`` / ``optimize measured bottleneck`` / ``stop``): certification records of a
  dense and a V4 model; MTP off.
* DGR-070 (``beta`` / ``targeted optimization`` / ``stop/rollback``): DGR-054's alpha, the MTP
  contract, implementation and benchmark, and the lock's certified hardware/recipe matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dgr_engine.certification.lock import Lock
from dgr_engine.certification.record import EvidenceRecord, RecordKind, Verdict
from dgr_session.identity import EvidenceClass

GATES = ("DGR-020", "DGR-054", "DGR-070")
VERDICTS = {
    "DGR-020": ("go", "optimize baseline", "stop"),
    "DGR-054": ("alpha", "optimize measured bottleneck", "stop"),
    "DGR-070": ("beta", "targeted optimization", "stop/rollback"),
}
STORY_CLASS = {
    "DGR-020": EvidenceClass.REAL_MODEL,
    "DGR-054": EvidenceClass.REAL_HARDWARE,
    "DGR-070": EvidenceClass.RELEASE,
}
"""The class each gate decides at unless told otherwise (prd.json's required class)."""

CORRECTNESS = (
    "parity.layouts",
    "execution.per_stage",
    "isolation.sessions",
    "failure.bounded",
    "resources.rss",
    "mtp.off",
)
"""DGR-054's correctness requirements, per model family."""
SPEED = ("speed.decode", "speed.prefill", "speed.vs_rpc")
"""DGR-054's locked useful-speed gate."""
HOP_PARTS = ("engine", "worker", "transit", "client")
"""The per-token breakdown a certification measures (figures ``hop.<part>_share``)."""
MTP_REQUIREMENTS = ("mtp.contract", "mtp.implementation", "mtp.benchmark")
FAMILIES = ("dense", "v4")


@attrs.frozen
class Reason:
    """One line of a verdict: ``ok`` True for a met requirement."""

    ok: bool
    text: str


@attrs.frozen
class GateResult:
    """A gate's verdict, the class it was evaluated at, and every reason."""

    gate: str
    evidence_class: EvidenceClass
    verdict: str
    reasons: tuple[Reason, ...]
    records: tuple[str, ...]
    """Ids of the records the verdict rests on."""

    @property
    def line(self) -> str:
        """E.g. ``DGR-054: alpha at fixture class``."""
        return f"{self.gate}: {self.verdict} at {self.evidence_class.value} class"

    def text(self) -> str:
        """The verdict line, then every reason (``+`` met, ``-`` not met)."""
        lines = [self.line]
        if self.evidence_class is EvidenceClass.FIXTURE:
            lines.append("  (fixture evidence: generated models, not real-model or real-hardware)")
        lines += [f"  {'+' if r.ok else '-'} {r.text}" for r in self.reasons]
        return "\n".join(lines)


def _eligible(
    records: Sequence[EvidenceRecord], kind: RecordKind, at: EvidenceClass
) -> list[EvidenceRecord]:
    chosen = [r for r in records if r.kind is kind and r.evidence_class.satisfies(at)]
    return sorted(chosen, key=lambda r: r.started_at)


def _latest_by_family(
    records: Sequence[EvidenceRecord],
) -> dict[str, EvidenceRecord]:
    latest: dict[str, EvidenceRecord] = {}
    for record in records:  # sorted by start: the last one wins
        latest[record.family] = record
    return latest


def _short(record: EvidenceRecord) -> str:
    return f"record {record.record_id[:12]}"


def evaluate_020(records: Sequence[EvidenceRecord], at: EvidenceClass) -> GateResult:
    baseline = _eligible(records, RecordKind.BASELINE, at)
    if not baseline:
        reason = Reason(False, f"no baseline record at {at.value} class or above")
        return GateResult("DGR-020", at, "stop", (reason,), ())
    record = baseline[-1]
    reasons = []
    verdicts = {}
    for rid in ("baseline.parity", "baseline.speed"):
        req = record.requirement(rid)
        verdict = req.verdict if req is not None else Verdict.NOT_MEASURED
        verdicts[rid] = verdict
        detail = req.detail if req is not None else "missing"
        reasons.append(
            Reason(verdict is Verdict.PASS, f"{rid}: {verdict.value} ({detail}; {_short(record)})")
        )
    if verdicts["baseline.parity"] is not Verdict.PASS:
        answer = "stop"
    elif verdicts["baseline.speed"] is Verdict.PASS:
        answer = "go"
    else:
        answer = "optimize baseline"
    return GateResult("DGR-020", at, answer, tuple(reasons), (record.record_id,))


def _bottleneck(record: EvidenceRecord) -> Reason:
    shares = {p: record.figure(f"hop.{p}_share") for p in HOP_PARTS}
    measured = {p: f.value for p, f in shares.items() if f is not None}
    if len(measured) != len(HOP_PARTS):
        return Reason(False, f"bottleneck: per-hop breakdown not measured ({_short(record)})")
    worst = max(measured, key=lambda p: measured[p])
    parts = ", ".join(f"{p} {100 * measured[p]:.0f}%" for p in HOP_PARTS)
    return Reason(
        False,
        f"bottleneck ({record.family}): {worst} ({parts} of a routed token's time; "
        f"{_short(record)})",
    )


def evaluate_054(records: Sequence[EvidenceRecord], at: EvidenceClass) -> GateResult:
    latest = _latest_by_family(_eligible(records, RecordKind.CERTIFICATION, at))
    reasons: list[Reason] = []
    correct = True
    fast = True
    for family in FAMILIES:
        record = latest.get(family)
        if record is None:
            reasons.append(Reason(False, f"{family}: no certification record at {at.value} class"))
            correct = False
            continue
        for rid in CORRECTNESS + SPEED:
            req = record.requirement(rid)
            verdict = req.verdict if req is not None else Verdict.NOT_MEASURED
            detail = req.detail if req is not None else "missing from the record"
            ok = verdict is Verdict.PASS
            if rid in CORRECTNESS:
                correct &= ok
            else:
                fast &= ok
            reasons.append(
                Reason(ok, f"{family} {rid}: {verdict.value} ({detail}; {_short(record)})")
            )
    if not correct:
        answer = "stop"
    elif fast:
        answer = "alpha"
    else:
        answer = "optimize measured bottleneck"
        reasons += [_bottleneck(latest[f]) for f in FAMILIES]
    used = tuple(r.record_id for r in latest.values())
    return GateResult("DGR-054", at, answer, tuple(reasons), used)


def evaluate_070(records: Sequence[EvidenceRecord], lock: Lock, at: EvidenceClass) -> GateResult:
    alpha = evaluate_054(records, at)
    reasons = [Reason(alpha.verdict == "alpha", f"DGR-054 at {at.value} class: {alpha.verdict}")]
    mtp = _eligible(records, RecordKind.MTP, at)
    lower = _eligible(records, RecordKind.MTP, EvidenceClass.FIXTURE)
    for rid in MTP_REQUIREMENTS:
        req = mtp[-1].requirement(rid) if mtp else None
        ok = req is not None and req.verdict is Verdict.PASS
        if ok:
            assert req is not None
            reasons.append(Reason(True, f"{rid}: pass ({_short(mtp[-1])}: {req.detail})"))
            continue
        below = [r for r in lower if (q := r.requirement(rid)) and q.verdict is Verdict.PASS]
        what = "missing (no passing MTP record)"
        if req is not None:
            what = f"{req.verdict.value} ({_short(mtp[-1])}: {req.detail})"
        elif below:
            got = below[-1]
            what = (
                f"missing at {at.value} class; passes at {got.evidence_class.value} class only "
                f"({_short(got)})"
            )
        reasons.append(Reason(False, f"{rid}: {what}"))
    matrix_ok = bool(lock.beta_matrix)
    if not lock.beta_matrix:
        reasons.append(
            Reason(False, "certified hardware/recipe matrix: the lock declares none (beta_matrix)")
        )
    certified = _eligible(
        records,
        RecordKind.CERTIFICATION,
        max(at, EvidenceClass.REAL_HARDWARE, key=lambda c: c.rank),
    )
    for name in lock.beta_matrix:
        hit = any(r.facts.hardware_lane == name for r in certified)
        matrix_ok &= hit
        reasons.append(Reason(hit, f"matrix lane {name}: {'certified' if hit else 'no record'}"))
    complete = all(r.ok for r in reasons)
    if complete:
        verdict = "beta"
    elif alpha.verdict == "alpha":
        verdict = "targeted optimization"
    else:
        verdict = "stop/rollback"
    return GateResult("DGR-070", at, verdict, tuple(reasons), alpha.records)


def evaluate(
    gate: str, records: Sequence[EvidenceRecord], lock: Lock, at: EvidenceClass | None = None
) -> GateResult:
    """Evaluate ``gate`` at class ``at`` (default: the class its story requires)."""
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; known: {', '.join(GATES)}")
    cls = at if at is not None else STORY_CLASS[gate]
    if gate == "DGR-020":
        return evaluate_020(records, cls)
    if gate == "DGR-054":
        return evaluate_054(records, cls)
    return evaluate_070(records, lock, cls)
