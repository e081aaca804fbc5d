"""The storage policy: an explicit root, never under /home (symlinks followed), never in the
checkout, in a temporary directory only when allowed; free space checked before fetching."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr_engine.artifacts.storage import (
    STORAGE_ENV,
    StorageRefused,
    check_free_space,
    storage_root,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_root_is_explicit(tmp_path: Path) -> None:
    with pytest.raises(StorageRefused, match=f"pass --root or set {STORAGE_ENV}"):
        storage_root(None, environ={})
    assert storage_root(None, allow_temp=True, environ={STORAGE_ENV: str(tmp_path)}) == tmp_path
    flag = tmp_path / "flag"
    assert storage_root(flag, allow_temp=True, environ={STORAGE_ENV: "/elsewhere"}) == flag


def test_home_is_refused_even_through_a_symlink(tmp_path: Path) -> None:
    with pytest.raises(StorageRefused, match="under /home: no model artifact may be there"):
        storage_root("/home/someone/models", environ={})
    link = tmp_path / "models"
    link.symlink_to("/home/someone/models")
    with pytest.raises(StorageRefused, match="is under /home"):
        storage_root(link, allow_temp=True, environ={})


def test_the_checkout_and_temporary_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(StorageRefused, match="inside dgr's source checkout"):
        storage_root(ROOT / "models", environ={})
    with pytest.raises(StorageRefused, match=r"temporary directory \S+ \(allowed for tests only\)"):
        storage_root(tmp_path, environ={})
    assert storage_root(tmp_path, allow_temp=True, environ={}) == tmp_path
    assert storage_root("/mnt/models", environ={}) == Path("/mnt/models").resolve()


def test_free_space_is_checked_against_the_nearest_existing_parent(tmp_path: Path) -> None:
    check_free_space(tmp_path / "not" / "yet", 1)
    with pytest.raises(StorageRefused, match=r"GiB free, .* GiB are needed"):
        check_free_space(tmp_path / "not" / "yet", 1 << 60)
