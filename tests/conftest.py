"""Shared fixtures: generated GGUF models (built on demand, cached) and engine factories."""

from __future__ import annotations

import os
import shutil

# OpenMP threads spin-wait by default; on a loaded 2-core machine two engines' spinning threads
# starve each other (chains 10-200x slower). Set before the engine's libgomp is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dgr_engine.certification.record import EVIDENCE_DIR_ENV
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.tooling.processes import dgr_command

# Nothing a test runs may write certification records into the checkout's evidence/: by
# default they go to (and workers read) an empty directory of this run. Tests that route over
# real workers use ``certified_fixtures``.
_RUN_EVIDENCE = tempfile.TemporaryDirectory(prefix="dgr-test-evidence-")
os.environ[EVIDENCE_DIR_ENV] = _RUN_EVIDENCE.name

CERTIFIED_FIXTURES = ("tiny-llama", "tiny-v4")
"""The fixtures whose lanes (``dgr certify``'s default engine options) the suite certifies."""
CO_BATCH_FIXTURES = ("tiny-llama",)
"""Fixtures whose co-batching lanes (``--batching co-batch``) the suite certifies as well."""


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return ensure_fixture("tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_tied() -> Path:
    return ensure_fixture("tiny-llama-tied")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return ensure_fixture("tiny-qwen2")


@pytest.fixture()
def closing() -> Iterator[list]:
    """Collects engines (or anything with ``close()``) and closes them after the test."""
    items: list = []
    yield items
    for item in items:
        item.close()


@pytest.fixture(scope="session")
def fixture_evidence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An evidence directory holding the records ``dgr certify`` made in this test run for the
    lanes of :data:`CERTIFIED_FIXTURES` on this machine (run as a user would: the CLI)."""
    root = tmp_path_factory.mktemp("evidence")
    for name in CERTIFIED_FIXTURES:
        _certify(root, name)
    return root


def _certify(root: Path, name: str, *extra: str) -> None:
    """``dgr certify --fixture NAME`` into ``root``, its output kept beside ``root``."""
    done = subprocess.run(
        [dgr_command(), "certify", "--fixture", name, "--evidence", str(root), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    what = " ".join([name, *extra])
    assert done.returncode == 0, f"dgr certify --fixture {what}:\n{done.stdout}{done.stderr}"
    (root.parent / f"certify-{'-'.join([name, *extra[1:]])}.log").write_text(done.stdout)


@pytest.fixture(scope="session")
def co_batch_evidence(fixture_evidence: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`fixture_evidence`'s records plus those of the co-batching lanes of
    :data:`CO_BATCH_FIXTURES` (``dgr certify --batching co-batch``), in a directory of their
    own (the gates' tests count the plain records)."""
    root = tmp_path_factory.mktemp("evidence-co-batch")
    shutil.copytree(fixture_evidence, root, dirs_exist_ok=True)
    for name in CO_BATCH_FIXTURES:
        _certify(root, name, "--batching", "co-batch")
    return root


@pytest.fixture()
def certified_co_batch(co_batch_evidence: Path) -> Iterator[Path]:
    """:func:`certified_fixtures` with the co-batching lanes' records as well, for one test
    (the default evidence directory is put back after it)."""
    before = os.environ[EVIDENCE_DIR_ENV]
    os.environ[EVIDENCE_DIR_ENV] = str(co_batch_evidence)
    yield co_batch_evidence
    os.environ[EVIDENCE_DIR_ENV] = before


@pytest.fixture(scope="session")
def certified_fixtures(fixture_evidence: Path) -> Iterator[Path]:
    """Makes the suite's certification records the default evidence directory (what spawned
    workers read) for the rest of the run; yields it."""
    os.environ[EVIDENCE_DIR_ENV] = str(fixture_evidence)
    yield fixture_evidence
    os.environ[EVIDENCE_DIR_ENV] = _RUN_EVIDENCE.name


class EvidenceKit:
    """Makes locks, lanes and evidence records for the certification tests (in ``root``).

    The kit's lock is the repo's plus two test certifiers made for the kit: ``operator``,
    trusted for real-model and real-hardware evidence, and ``releaser``, trusted for release.
    :meth:`write` signs a record with the key its class calls for (the fixture certifier for
    fixture evidence)."""

    def __init__(self, root: Path) -> None:
        import json

        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from dgr_engine.certification.lock import load_lock
        from dgr_engine.certification.signing import public_key_text

        self.root = root
        self.operator = Ed25519PrivateKey.generate()
        self.releaser = Ed25519PrivateKey.generate()
        data = json.loads((Path(__file__).parents[1] / "certification/lock.json").read_text())
        data["certifiers"] += [
            {
                "name": "test-operator",
                "public_key": public_key_text(self.operator.public_key()),
                "classes": ["real-model", "real-hardware"],
            },
            {
                "name": "test-releaser",
                "public_key": public_key_text(self.releaser.public_key()),
                "classes": ["release"],
            },
        ]
        self.lock_path = root / "lock.json"
        self.lock_path.write_text(json.dumps(data, indent=2))
        self.lock = load_lock(self.lock_path)  # outside git: its time is the declared one

    def edit_lock(self, edit: Any) -> Any:
        """Rewrites the lock (``edit`` changes the parsed JSON in place) and reloads it."""
        import json

        from dgr_engine.certification.lock import load_lock

        data = json.loads(self.lock_path.read_text())
        edit(data)
        self.lock_path.write_text(json.dumps(data))
        self.lock = load_lock(self.lock_path)
        return self.lock

    @staticmethod
    def lane(**changes: Any) -> Any:
        from dgr_engine.certification.lane import LaneKey

        fields: dict[str, Any] = {
            "backend": "cpu",
            "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
            "patch_stack_sha256": "ab" * 32,
            "dgr_version": "0.1.0",
            "build_flags": "GGML_NATIVE=OFF",
            "system_info": "CPU : AVX2 = 1 |",
            "hardware": "x86_64 | Test CPU | avx avx2",
            "model_sha256": "cd" * 32,
            "arch": "llama",
            "n_layer": 4,
            "quant_types": ("F32",),
            "kv_type": "f16",
            "flash_attn": "auto",
            "context_per_session": 256,
            "placement": "cpu",
        }
        fields.update(changes)
        return LaneKey(**fields)

    @staticmethod
    def fixture_facts(**changes: Any) -> Any:
        from dgr_engine.certification.classify import EvidenceFacts

        fields: dict[str, Any] = {
            "fixture_mark": "dgr-fixtures/2 tiny-llama",
            "real_model": None,
            "hardware_lane": None,
            "release_build": False,
        }
        fields.update(changes)
        return EvidenceFacts(**fields)

    def record(
        self,
        *,
        kind: str = "certification",
        family: str = "dense",
        failing: tuple[str, ...] = (),
        shares: dict[str, float] | None = None,
        requirement_ids: tuple[str, ...] | None = None,
        **changes: Any,
    ) -> Any:
        """A record made now under the kit's lock; every requirement passes but ``failing``."""
        import datetime as dt

        from dgr_engine.certification import gates
        from dgr_engine.certification.record import (
            EvidenceRecord,
            Figure,
            RecordKind,
            Requirement,
            Verdict,
        )

        ids = requirement_ids
        if ids is None:
            ids = {
                "certification": gates.CORRECTNESS + gates.SPEED,
                "baseline": ("baseline.parity", "baseline.speed"),
                "mtp": gates.MTP_REQUIREMENTS,
            }[kind]
        shares = shares or {"engine": 0.4, "worker": 0.1, "transit": 0.3, "client": 0.2}
        now = dt.datetime.now(dt.UTC)
        fields: dict[str, Any] = {
            "kind": RecordKind(kind),
            "lane": self.lane(arch="deepseek4" if family == "v4" else "llama"),
            "lock_sha256": self.lock.sha256,
            "facts": self.fixture_facts(),
            "family": family,
            "command": ("dgr", "certify", "--fixture", "tiny-llama"),
            "dgr_commit": "0" * 40,
            "machine": {"hardware": "x86_64 | Test CPU | avx avx2", "cpus": "2"},
            "started_at": now,
            "ended_at": now + dt.timedelta(seconds=8),
            "figures": [Figure("speed.decode_ratio", 0.5, "whole/route", "2 stages")]
            + [Figure(f"hop.{p}_share", v, "share", "decode") for p, v in shares.items()],
            "requirements": [
                Requirement(r, Verdict.FAIL if r in failing else Verdict.PASS, f"{r} detail")
                for r in ids
            ],
        }
        fields.update(changes)
        return EvidenceRecord(**fields)

    def key_for(self, record: Any) -> Any:
        """The key the kit signs ``record`` with: the one its class calls for."""
        from dgr_engine.certification.signing import FIXTURE_CERTIFIER
        from dgr_session.identity import EvidenceClass

        return {
            EvidenceClass.FIXTURE: FIXTURE_CERTIFIER,
            EvidenceClass.REAL_MODEL: self.operator,
            EvidenceClass.REAL_HARDWARE: self.operator,
            EvidenceClass.RELEASE: self.releaser,
        }[record.evidence_class]

    def write(self, record: Any, directory: Path | None = None, *, key: Any = None) -> Path:
        """``record`` written under ``directory`` (default: the kit's evidence/), signed by
        ``key`` (default: :meth:`key_for`)."""
        from dgr_engine.certification.record import write_record

        key = key if key is not None else self.key_for(record)
        path: Path = write_record(record, directory or self.root / "evidence", key=key)
        return path


@pytest.fixture()
def kit(tmp_path: Path) -> EvidenceKit:
    return EvidenceKit(tmp_path)
