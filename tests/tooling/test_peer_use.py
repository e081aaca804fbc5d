"""When ``dgr certify`` runs llama.cpp's peers (``--rpc auto|build|off``), without building or
starting anything: the cache look-up and the build are replaced where a test needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr_engine.tooling import peer_build
from dgr_engine.tooling.llama_build import CheckoutMissing
from dgr_engine.tooling.peer_build import PeersUnavailable, PeerUse, find_peers
from dgr_engine.tooling.rpc_peer import BenchResult, PeerConfig, settings_differ


def quiet(_text: str) -> None:
    pass


def not_cached(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    built: list[str] = []
    monkeypatch.setattr(peer_build, "cached_prefix", lambda: None)

    def ensure(force: bool = False, log: object = None) -> Path:
        built.append("built")
        return Path("/peers")

    monkeypatch.setattr(peer_build, "ensure_peers", ensure)
    return built


def test_off_never_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_build, "cached_prefix", lambda: pytest.fail("looked"))
    found = find_peers(PeerUse.OFF, build_when_missing=True, log=quiet)
    assert found.prefix is None and "--rpc off" in found.reason


def test_auto_takes_a_cached_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_build, "cached_prefix", lambda: Path("/cached"))
    assert find_peers(PeerUse.AUTO, build_when_missing=False, log=quiet).prefix == Path("/cached")


def test_auto_without_a_build_says_how_to_make_one(monkeypatch: pytest.MonkeyPatch) -> None:
    built = not_cached(monkeypatch)
    found = find_peers(PeerUse.AUTO, build_when_missing=False, log=quiet)
    assert found.prefix is None and not built
    assert "not built" in found.reason and peer_build.BUILD_COMMAND in found.reason


def test_auto_builds_for_real_evidence_and_build_always(monkeypatch: pytest.MonkeyPatch) -> None:
    built = not_cached(monkeypatch)
    lines: list[str] = []
    assert find_peers(PeerUse.AUTO, build_when_missing=True, log=lines.append).prefix
    assert any("building them now" in line for line in lines)
    assert find_peers(PeerUse.BUILD, build_when_missing=False, log=quiet).prefix
    assert built == ["built", "built"]


def test_no_checkout_refuses_build_and_is_a_reason_for_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing() -> Path:
        raise CheckoutMissing("no native/build_llama.py")

    monkeypatch.setattr(peer_build, "cached_prefix", missing)
    found = find_peers(PeerUse.AUTO, build_when_missing=True, log=quiet)
    assert found.prefix is None and "no native/build_llama.py" in found.reason
    with pytest.raises(PeersUnavailable, match="--rpc build: no native/build_llama.py"):
        find_peers(PeerUse.BUILD, build_when_missing=False, log=quiet)


def test_a_failed_build_is_a_reason_for_auto_and_refuses_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peer_build, "cached_prefix", lambda: None)

    def fails(force: bool = False, log: object = None) -> Path:
        raise OSError("No space left on device")

    monkeypatch.setattr(peer_build, "ensure_peers", fails)
    found = find_peers(PeerUse.AUTO, build_when_missing=True, log=quiet)
    assert found.prefix is None and "No space left" in found.reason
    with pytest.raises(PeersUnavailable, match="building the peers failed"):
        find_peers(PeerUse.BUILD, build_when_missing=False, log=quiet)


def test_a_peer_that_reports_other_settings_is_named() -> None:
    config = PeerConfig(Path("m"), Path("b"), Path("bb"), 1, "f16", "auto", 64)
    result = BenchResult(0, 16, 64, 100.0, 1, "f16", "f16", -1, 13, "", "CPU,RPC")
    assert settings_differ(result, config) is None
    other = BenchResult(0, 16, 64, 100.0, 2, "f16", "q8_0", 1, 13, "", "CPU,RPC")
    assert settings_differ(other, config) == (
        "threads 2 (wanted 1); type_v q8_0 (wanted f16); flash_attn 1 (wanted -1)"
    )
