"""The sanitizer build option of native/build_llama.py (issue 12): offline, nothing built — the
build step is replaced by a recorder. The sanitized run itself is ``scripts/sanitize.sh``
(docs/sanitizers.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_llama", REPO / "native" / "build_llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_llama"] = module
    spec.loader.exec_module(module)
    return module


bl = _load()


def planned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sanitize: bool) -> dict[str, Any]:
    """What ensure_llama would build (the build itself recorded, not run)."""
    seen: dict[str, Any] = {}

    def record(paths: Any, manifest: Any, patches: Any, key: str, prefix: Path, log: Any) -> None:
        seen.update(manifest=manifest, key=key, prefix=prefix)

    monkeypatch.setattr(bl, "build_prefix", record)
    paths = bl.BuildPaths.default(cache_dir=tmp_path / "cache")
    paths = bl.BuildPaths(**{**paths.__dict__, "workspace": tmp_path / "ws"})
    (tmp_path / "ws").mkdir(exist_ok=True)
    prefix = bl.ensure_llama(log=lambda _m: None, paths=paths, sanitize=sanitize)
    assert prefix == seen["prefix"]
    return seen


def test_the_sanitized_build_has_its_flags_its_own_key_and_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    normal = planned(tmp_path, monkeypatch, sanitize=False)
    asan = planned(tmp_path, monkeypatch, sanitize=True)
    assert asan["key"] != normal["key"]
    assert asan["prefix"].name == f"asan-{asan['key'][:16]}"
    assert normal["prefix"].name == normal["key"][:16]
    options, base = asan["manifest"]["cmake"]["options"], normal["manifest"]["cmake"]["options"]
    for key in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
        assert "-fsanitize=address,undefined" in options[key]
        assert "-fno-sanitize-recover=undefined" in options[key]
        assert key not in base
    assert "-fsanitize=address,undefined" in options["CMAKE_SHARED_LINKER_FLAGS"]
    # everything else is the normal build's
    assert {k: v for k, v in options.items() if k in base} == base


def test_the_script_runs_the_engine_tests_with_the_runtimes_preloaded() -> None:
    script = (REPO / "scripts" / "sanitize.sh").read_text()
    assert "DGR_SANITIZE=1" in script and "LD_PRELOAD" in script
    assert "halt_on_error=1" in script and "detect_leaks=0" in script
    for test in ("test_engine_parity.py", "test_v4_parity.py", "test_engine_errors.py"):
        assert f"tests/engine/{test}" in script
        assert (REPO / "tests" / "engine" / test).is_file()
