"""DGR-019: the lock. Comparable lanes and every threshold, declared before any result exists.

The lock is one JSON file in the repo (``certification/lock.json``). Its SHA-256 (of the
canonical JSON) goes into every record; its time is the later of the ``locked_at`` it declares
and, in a git checkout, the commit time of the last commit that changed it. A record made under
another lock, or started before the lock's time, is refused (:meth:`Lock.admit`), and no result
may be made under a lock with uncommitted changes (:meth:`Lock.require_committed`).

The lock also declares the certifiers it trusts: each an Ed25519 public key and the evidence
classes its signature may vouch for (:meth:`Lock.check_signature`). The fixture certifier,
whose private half is public (:data:`~dgr_engine.certification.signing.FIXTURE_CERTIFIER`), may
be trusted for fixture evidence only.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dgr_engine.certification import signing
from dgr_engine.certification.errors import (
    EvidenceInvalid,
    LockMismatch,
    LockNotCommitted,
    SignatureRefused,
)
from dgr_engine.certification.lane import canonical_sha256
from dgr_session.identity import EvidenceClass

LOCK_SCHEMA = "dgr.lock/1"
LOCK_ENV = "DGR_LOCK"
"""Environment variable naming the lock file (else the checkout's ``certification/lock.json``)."""
_CHECKOUT = Path(__file__).resolve().parents[2]


def parse_time(text: Any, *, field: str, path: Path | None = None) -> dt.datetime:
    """An ISO 8601 time with a zone (``Z`` allowed), as an aware datetime."""
    if not isinstance(text, str):
        raise EvidenceInvalid(f"{field}: not a time string: {text!r}", path=path, field=field)
    try:
        value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise EvidenceInvalid(
            f"{field}: not an ISO time: {text!r}", path=path, field=field
        ) from None
    if value.tzinfo is None:
        raise EvidenceInvalid(f"{field}: time without a zone: {text!r}", path=path, field=field)
    return value


def format_time(value: dt.datetime) -> str:
    """UTC, seconds resolution, ``Z``."""
    return value.astimezone(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def family_of(arch: str) -> str:
    """The model family a lock's lanes name for a GGUF architecture: ``"v4"`` (DeepSeek V4) or
    ``"dense"``."""
    return "v4" if arch == "deepseek4" else "dense"


@attrs.frozen
class Speed:
    """The useful-speed gate."""

    stage_counts: tuple[int, ...]
    decode_ratio_min: float
    prefill_ratio_min: float
    vs_rpc_decode_ratio_min: float
    decode_tokens: int
    prefill_tokens: int
    rounds: int


@attrs.frozen
class QuantizedBaseline:
    """DGR-020 for a quantized GGUF: whole-model llama.cpp against ``transformers`` running the
    same GGUF's weights dequantized to float32, teacher-forced over seeded prompts."""

    prompt_tokens_min: int
    """Teacher-forced positions over all prompts, at least."""
    kld_mean_max: float
    """Mean KL divergence (nats) of the next-token distributions, reference to llama.cpp."""
    kld_p99_max: float
    """Its 99th percentile over positions."""
    top1_agreement_min: float
    """Share of positions whose top-1 token agrees."""
    decode_ratio_min: float
    """llama.cpp decode speed over ``transformers``' at least this."""


@attrs.frozen
class Thresholds:
    """Every threshold a verdict is measured against."""

    baseline_max_abs_logit: float
    """DGR-020: largest |logit difference| of whole-model llama.cpp against safetensors."""
    baseline_top1_agreement_min: float
    """DGR-020: share of positions whose top-1 token agrees."""
    baseline_decode_ratio_min: float
    """DGR-020: llama.cpp decode speed over safetensors' at least this."""
    layout_stage_counts: tuple[int, ...]
    """Stage counts of the parity layouts (each capped by the model's layers; 10+ only where
    the model has them)."""
    speed: Speed
    recovery_max_seconds: float
    """A stage lost mid-decode: the session's re-prefill (detection to next token) within."""
    step_deadline_seconds: float
    """The failure policy's step deadline during certification."""
    rss_factor: float
    rss_slack_mib: float
    """Peak RSS of a shard <= factor x (weight share + KV) + slack."""
    isolation_sessions: int
    isolation_tokens: int
    max_route_changes: int
    quantized: QuantizedBaseline
    """DGR-020's thresholds for a quantized GGUF (no safetensors: its own weights
    dequantized)."""


@attrs.frozen
class RealModel:
    """A real model the lock names: only its declared content hashes are its weights."""

    name: str
    arch: str
    official_target_sha: str
    content_sha256: tuple[str, ...]


@attrs.frozen
class HardwareLane:
    """An exact hardware and build on which a real model's records count as real-hardware."""

    name: str
    hardware: str
    llama_cpp_commit: str
    patch_stack_sha256: str
    backend: str


@attrs.frozen
class ComparableLane:
    """A family of lanes the lock compares results within (one evidence class, one backend,
    one model family; for real models, one named model)."""

    name: str
    evidence_class: EvidenceClass
    backend: str
    family: str
    real_model: str | None


@attrs.frozen
class Certifier:
    """A key the lock trusts to sign records of some evidence classes."""

    name: str
    key_id: str
    """The key's fingerprint (:func:`~dgr_engine.certification.signing.key_id_of`)."""
    public_key: Ed25519PublicKey = attrs.field(eq=False, repr=False)
    classes: tuple[EvidenceClass, ...]
    """The classes of the records this key may sign."""


@attrs.frozen
class Lock:
    """A loaded lock."""

    path: Path
    sha256: str
    """Hex SHA-256 of the lock's canonical JSON: what records carry."""
    declared_at: dt.datetime
    commit_time: dt.datetime | None
    """Commit time of the last commit that changed the file (``None``: not in git)."""
    committed: bool
    """False when the file has uncommitted changes (or is untracked) in its git checkout."""
    thresholds: Thresholds
    real_models: tuple[RealModel, ...]
    hardware_lanes: tuple[HardwareLane, ...]
    beta_matrix: tuple[str, ...]
    """Names of the hardware lanes beta requires certified (DGR-070)."""
    lanes: tuple[ComparableLane, ...]
    certifiers: tuple[Certifier, ...] = ()
    """The keys whose signatures the lock admits, each for its classes."""

    def certifier(self, key_id: str) -> Certifier | None:
        """The declared certifier of ``key_id``, if any."""
        return next((c for c in self.certifiers if c.key_id == key_id), None)

    def check_signature(
        self,
        record_id: str,
        signature: signing.RecordSignature | None,
        evidence_class: EvidenceClass,
        *,
        path: Path | None,
    ) -> Certifier:
        """The certifier whose signature of ``record_id`` counts for ``evidence_class``;
        :class:`SignatureRefused` saying which key and why not otherwise."""
        if signature is None:
            raise SignatureRefused(
                "signature: unsigned: no certifier signature (records are signed with "
                "'dgr certify --sign-key')",
                path=path,
                reason="unsigned",
            )
        key_id = signature.key_id
        certifier = self.certifier(key_id)
        if certifier is None:
            raise SignatureRefused(
                f"signature: signed by key {key_id!r}, which the lock ({self.path}) does not "
                "declare: unknown key",
                path=path,
                key_id=key_id,
                reason="unknown key",
            )
        if not signature.verifies(certifier.public_key, record_id):
            raise SignatureRefused(
                f"signature: does not verify under key {key_id!r} ({certifier.name}): bad "
                "signature (the record was edited after it was signed, or the signature is "
                "another record's)",
                path=path,
                key_id=key_id,
                reason="bad signature",
            )
        if evidence_class not in certifier.classes:
            trusted = ", ".join(c.value for c in certifier.classes) or "nothing"
            raise SignatureRefused(
                f"signature: key {key_id!r} ({certifier.name}) is trusted for {trusted}, not "
                f"{evidence_class.value} evidence: key not trusted for class",
                path=path,
                key_id=key_id,
                reason="key not trusted for class",
            )
        return certifier

    def require_comparable_lane(
        self, evidence_class: EvidenceClass, backend: str, arch: str, real_model: str | None
    ) -> ComparableLane:
        """The declared lane a result on a model of ``arch`` belongs to
        (:meth:`comparable_lane`); :class:`LockMismatch` when the lock declares none, so no
        threshold was locked for the result."""
        family = family_of(arch)
        lane = self.comparable_lane(evidence_class, backend, family, real_model)
        if lane is None:
            raise LockMismatch(
                f"lanes: the lock declares no comparable lane for {evidence_class.value} "
                f"evidence of a {family} model on {backend}: its thresholds were not locked for "
                "this result",
                path=self.path,
                field="lanes",
            )
        return lane

    def comparable_lane(
        self, evidence_class: EvidenceClass, backend: str, family: str, real_model: str | None
    ) -> ComparableLane | None:
        """The declared lane a result of this class, backend, family and model belongs to."""
        for lane in self.lanes:
            if (lane.backend, lane.family) != (backend, family):
                continue
            if evidence_class is EvidenceClass.FIXTURE and lane.evidence_class is evidence_class:
                return lane
            if evidence_class is not EvidenceClass.FIXTURE and lane.real_model == real_model:
                if lane.evidence_class is not EvidenceClass.FIXTURE:
                    return lane
        return None

    @property
    def locked_at(self) -> dt.datetime:
        """The lock's time: records must start at or after it."""
        if self.commit_time is None:
            return self.declared_at
        return max(self.declared_at, self.commit_time)

    def real_model_of(self, model_sha256: str) -> RealModel | None:
        """The real model whose declared hashes include ``model_sha256``, if any."""
        for model in self.real_models:
            if model_sha256 in model.content_sha256:
                return model
        return None

    def hardware_lane_of(
        self, hardware: str, llama_cpp_commit: str, patch_stack_sha256: str, backend: str
    ) -> HardwareLane | None:
        """The declared hardware lane that names exactly this hardware and build, if any."""
        for lane in self.hardware_lanes:
            if (lane.hardware, lane.llama_cpp_commit, lane.patch_stack_sha256, lane.backend) == (
                hardware,
                llama_cpp_commit,
                patch_stack_sha256,
                backend,
            ):
                return lane
        return None

    def require_committed(self) -> None:
        """:class:`LockNotCommitted` when results may not be made under this lock yet."""
        if not self.committed:
            raise LockNotCommitted(
                "the lock has uncommitted changes (or is untracked): commit it before making "
                "results under it, so its time is known",
                path=self.path,
            )

    def admit(self, lock_sha256: str, started_at: dt.datetime, *, path: Path | None) -> None:
        """:class:`LockMismatch` unless a record with this lock hash and start time counts."""
        if lock_sha256 != self.sha256:
            raise LockMismatch(
                f"lock_sha256: made under lock {lock_sha256[:16]}, the lock evaluated is "
                f"{self.sha256[:16]} ({self.path}): the lock changed after the record was made",
                path=path,
                field="lock_sha256",
            )
        if started_at < self.locked_at:
            raise LockMismatch(
                f"started_at: made at {format_time(started_at)}, before the lock's time "
                f"{format_time(self.locked_at)}: results made before the lock do not count",
                path=path,
                field="started_at",
            )


def default_lock_path() -> Path:
    """``$DGR_LOCK``, else the checkout's ``certification/lock.json``."""
    env = os.environ.get(LOCK_ENV)
    return Path(env) if env else _CHECKOUT / "certification" / "lock.json"


def _git(path: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(path.parent), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git_state(path: Path) -> tuple[dt.datetime | None, bool]:
    """(commit time of the last commit changing ``path``, whether the file is clean)."""
    if _git(path, "rev-parse", "--is-inside-work-tree") != "true":
        return None, True  # not in a checkout: the declared time is the lock's time
    status = _git(path, "status", "--porcelain", "--", path.name)
    stamp = _git(path, "log", "-1", "--format=%cI", "--", path.name)
    if not stamp:
        return None, False  # untracked
    when = parse_time(stamp, field="git commit time", path=path)
    return when, status == ""


class _Reader:
    """Typed field access that names the field and the file on every refusal."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get(self, data: Any, dotted: str, kind: type | tuple[type, ...]) -> Any:
        value = data
        for part in dotted.split("."):
            if not isinstance(value, Mapping) or part not in value:
                raise EvidenceInvalid(f"{dotted}: missing", path=self.path, field=dotted)
            value = value[part]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise EvidenceInvalid(
                f"{dotted}: wrong type {type(value).__name__}", path=self.path, field=dotted
            )
        return value

    def number(self, data: Any, dotted: str, *, minimum: float = 0.0) -> float:
        value = float(self.get(data, dotted, (int, float)))
        if not value >= minimum:
            raise EvidenceInvalid(f"{dotted}: {value} < {minimum}", path=self.path, field=dotted)
        return value

    def count(self, data: Any, dotted: str) -> int:
        value = self.get(data, dotted, int)
        if value < 1:
            raise EvidenceInvalid(f"{dotted}: must be >= 1", path=self.path, field=dotted)
        return int(value)

    def counts(self, data: Any, dotted: str) -> tuple[int, ...]:
        values = self.get(data, dotted, list)
        if not values or not all(isinstance(v, int) and v >= 1 for v in values):
            raise EvidenceInvalid(
                f"{dotted}: must be a non-empty list of counts", path=self.path, field=dotted
            )
        return tuple(values)

    def strings(self, data: Any, dotted: str) -> tuple[str, ...]:
        values = self.get(data, dotted, list)
        if not all(isinstance(v, str) for v in values):
            raise EvidenceInvalid(f"{dotted}: must be strings", path=self.path, field=dotted)
        return tuple(values)


def _thresholds(r: _Reader, data: Any) -> Thresholds:
    t = "thresholds"
    if r.get(data, f"{t}.parity.split_vs_whole", str) != "bit-exact":
        raise EvidenceInvalid(
            f"{t}.parity.split_vs_whole: only 'bit-exact' is defined",
            path=r.path,
            field=f"{t}.parity.split_vs_whole",
        )
    speed = Speed(
        stage_counts=r.counts(data, f"{t}.speed.stage_counts"),
        decode_ratio_min=r.number(data, f"{t}.speed.decode_ratio_min"),
        prefill_ratio_min=r.number(data, f"{t}.speed.prefill_ratio_min"),
        vs_rpc_decode_ratio_min=r.number(data, f"{t}.speed.vs_rpc_decode_ratio_min"),
        decode_tokens=r.count(data, f"{t}.speed.decode_tokens"),
        prefill_tokens=r.count(data, f"{t}.speed.prefill_tokens"),
        rounds=r.count(data, f"{t}.speed.rounds"),
    )
    return Thresholds(
        baseline_max_abs_logit=r.number(data, f"{t}.parity.baseline_max_abs_logit"),
        baseline_top1_agreement_min=r.number(data, f"{t}.parity.baseline_top1_agreement_min"),
        baseline_decode_ratio_min=r.number(
            data, f"{t}.baseline.llama_cpp_vs_safetensors_decode_ratio_min"
        ),
        layout_stage_counts=r.counts(data, f"{t}.layouts.stage_counts"),
        speed=speed,
        recovery_max_seconds=r.number(data, f"{t}.recovery.max_seconds"),
        step_deadline_seconds=r.number(data, f"{t}.recovery.step_deadline_seconds"),
        rss_factor=r.number(data, f"{t}.resources.rss_factor", minimum=1.0),
        rss_slack_mib=r.number(data, f"{t}.resources.rss_slack_mib"),
        isolation_sessions=r.count(data, f"{t}.isolation.sessions"),
        isolation_tokens=r.count(data, f"{t}.isolation.tokens"),
        max_route_changes=r.count(data, f"{t}.failure.max_route_changes"),
        quantized=QuantizedBaseline(
            prompt_tokens_min=r.count(data, f"{t}.baseline_quantized.prompt_tokens_min"),
            kld_mean_max=r.number(data, f"{t}.baseline_quantized.kld_mean_max"),
            kld_p99_max=r.number(data, f"{t}.baseline_quantized.kld_p99_max"),
            top1_agreement_min=r.number(data, f"{t}.baseline_quantized.top1_agreement_min"),
            decode_ratio_min=r.number(
                data, f"{t}.baseline_quantized.llama_cpp_vs_transformers_decode_ratio_min"
            ),
        ),
    )


def _objects(r: _Reader, data: Any, name: str) -> list[Mapping[str, Any]]:
    items = r.get(data, name, list)
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise EvidenceInvalid(f"{name}[{i}]: not an object", path=r.path, field=f"{name}[{i}]")
    return items


def load_lock(path: str | os.PathLike[str] | None = None) -> Lock:
    """Read and check the lock; :class:`EvidenceInvalid` naming the file and the field."""
    lock_path = Path(path) if path is not None else default_lock_path()
    try:
        text = lock_path.read_text()
    except FileNotFoundError:
        if path is not None or os.environ.get(LOCK_ENV):
            raise EvidenceInvalid("cannot read the lock: No such file", path=lock_path) from None
        raise EvidenceInvalid(
            "no lock: dgr runs outside a checkout; name one with --lock FILE or $DGR_LOCK "
            "(dgr lock new FILE --from LOCK makes one: docs/locks.md)",
            path=lock_path,
        ) from None
    except OSError as exc:
        raise EvidenceInvalid(f"cannot read the lock: {exc.strerror}", path=lock_path) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvidenceInvalid(
            f"not JSON ({exc.msg} at line {exc.lineno})", path=lock_path
        ) from None
    r = _Reader(lock_path)
    schema = r.get(data, "schema", str)
    if schema != LOCK_SCHEMA:
        raise EvidenceInvalid(
            f"schema: unknown lock schema {schema!r} (this dgr reads {LOCK_SCHEMA!r})",
            path=lock_path,
            field="schema",
        )
    real_models = tuple(
        RealModel(
            name=r.get(m, "name", str),
            arch=r.get(m, "arch", str),
            official_target_sha=r.get(m, "official_target_sha", str),
            content_sha256=r.strings(m, "content_sha256"),
        )
        for m in _objects(r, data, "real_models")
    )
    hardware = tuple(
        HardwareLane(
            name=r.get(h, "name", str),
            hardware=r.get(h, "hardware", str),
            llama_cpp_commit=r.get(h, "llama_cpp_commit", str),
            patch_stack_sha256=r.get(h, "patch_stack_sha256", str),
            backend=r.get(h, "backend", str),
        )
        for h in _objects(r, data, "hardware_lanes")
    )
    lanes = []
    for i, lane in enumerate(_objects(r, data, "lanes")):
        cls = r.get(lane, "class", str)
        if cls not in {c.value for c in EvidenceClass}:
            raise EvidenceInvalid(
                f"lanes[{i}].class: unknown evidence class {cls!r}",
                path=lock_path,
                field=f"lanes[{i}].class",
            )
        model = lane.get("real_model")
        if model is not None and model not in {m.name for m in real_models}:
            raise EvidenceInvalid(
                f"lanes[{i}].real_model: {model!r} is not a declared real model",
                path=lock_path,
                field=f"lanes[{i}].real_model",
            )
        lanes.append(
            ComparableLane(
                name=r.get(lane, "name", str),
                evidence_class=EvidenceClass(cls),
                backend=r.get(lane, "backend", str),
                family=r.get(lane, "family", str),
                real_model=model,
            )
        )
    beta = r.strings(data, "beta_matrix")
    known = {h.name for h in hardware}
    for name in beta:
        if name not in known:
            raise EvidenceInvalid(
                f"beta_matrix: {name!r} is not a declared hardware lane",
                path=lock_path,
                field="beta_matrix",
            )
    certifiers = _certifiers(r, data)
    commit_time, committed = _git_state(lock_path.resolve())
    return Lock(
        path=lock_path,
        sha256=canonical_sha256(data),
        declared_at=parse_time(r.get(data, "locked_at", str), field="locked_at", path=lock_path),
        commit_time=commit_time,
        committed=committed,
        thresholds=_thresholds(r, data),
        real_models=real_models,
        hardware_lanes=hardware,
        beta_matrix=beta,
        lanes=tuple(lanes),
        certifiers=certifiers,
    )


def _certifiers(r: _Reader, data: Any) -> tuple[Certifier, ...]:
    out: list[Certifier] = []
    known = {c.value for c in EvidenceClass}
    for i, item in enumerate(_objects(r, data, "certifiers")):
        where = f"certifiers[{i}]"

        def bad(field: str, why: str, where: str = where) -> EvidenceInvalid:
            return EvidenceInvalid(f"{where}.{field}: {why}", path=r.path, field=f"{where}.{field}")

        name = r.get(item, "name", str)
        try:
            key = signing.parse_public_key(r.get(item, "public_key", str))
        except ValueError as exc:
            raise bad("public_key", f"not an Ed25519 public key: {exc}") from None
        classes = r.strings(item, "classes")
        if not classes:
            raise bad("classes", "names no evidence class")
        for cls in classes:
            if cls not in known:
                raise bad("classes", f"unknown evidence class {cls!r}")
        key_id = signing.key_id_of(key)
        if key_id == signing.FIXTURE_CERTIFIER_ID and set(classes) != {"fixture"}:
            raise bad(
                "classes",
                "the fixture certifier's private key is public: it may vouch for fixture "
                "evidence only",
            )
        if any(c.key_id == key_id or c.name == name for c in out):
            raise bad("public_key", f"{name!r} / {key_id} is declared twice")
        out.append(
            Certifier(
                name=name,
                key_id=key_id,
                public_key=key,
                classes=tuple(EvidenceClass(c) for c in classes),
            )
        )
    return tuple(out)
