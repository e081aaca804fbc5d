"""Whether dgr runs from a release: the facts ``release`` evidence needs, read from git.

A release build is (all of):

* a final version (:func:`~dgr_engine.certification.classify.is_release_version`);
* a release tag of exactly that version (``v<version>``, or ``<version>``) at the commit built;
* a tree that is exactly that commit: no change to a tracked file, no untracked file and no
  ignored file either (a built native module, a virtualenv, a llama.cpp workspace, generated
  fixtures all count), only the tools' caches (``__pycache__``, ``.mypy_cache`` ...) excepted.

A source checkout where dgr's native module was built in place is therefore never a release
tree. Release evidence also needs a certifier key the lock trusts for release; the loader
re-checks a record's release claim (:func:`check_release_claim`) instead of taking it from the
file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import attrs

from dgr_engine.certification.classify import is_release_version
from dgr_engine.certification.errors import ReleaseUnproven

CHECKOUT = Path(__file__).resolve().parents[2]
"""The checkout dgr runs from (when it runs from one)."""
TOOL_CACHES = frozenset(
    {"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}
)
"""Ignored directories that are not part of a build: they never make a tree dirty."""
_COMMIT = re.compile(r"[0-9a-f]{40}")


def release_tags(version: str) -> tuple[str, str]:
    """The tag names a release of ``version`` may carry."""
    return f"v{version}", version


def _git(checkout: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(checkout), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _is_cache(path: str) -> bool:
    parts = [p for p in path.split("/") if p]
    return bool(parts) and (
        any(p in TOOL_CACHES for p in parts) or parts[-1].endswith((".pyc", ".pyo"))
    )


@attrs.frozen
class ReleaseState:
    """What git says about the tree dgr runs from."""

    version: str
    commit: str | None
    """HEAD (``None``: not a git checkout)."""
    tag: str | None
    """The release tag of ``version`` at HEAD, if there is one."""
    dirty: tuple[str, ...]
    """Paths that make the tree other than its commit: changed, untracked or ignored."""

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why this is not a release build (empty: it is one)."""
        out = []
        if not is_release_version(self.version):
            out.append(f"version {self.version!r} is not a final release")
        if self.commit is None:
            out.append("not a git checkout: the commit built is unknown")
        else:
            if self.tag is None:
                tags = " or ".join(release_tags(self.version))
                out.append(f"no release tag {tags} at {self.commit[:12]}")
            if self.dirty:
                shown = ", ".join(self.dirty[:5]) + (" ..." if len(self.dirty) > 5 else "")
                out.append(f"the tree is not its commit: {shown}")
        return tuple(out)

    @property
    def is_release(self) -> bool:
        return not self.reasons


def release_state(version: str, checkout: Path = CHECKOUT) -> ReleaseState:
    """The release facts of ``checkout`` for ``version`` (dgr's own checkout by default)."""
    head = _git(checkout, "rev-parse", "--verify", "-q", "HEAD^{commit}")
    if head is None or not _COMMIT.fullmatch(head.strip()):
        return ReleaseState(version, None, None, ())
    commit = head.strip()
    tags = set((_git(checkout, "tag", "--points-at", commit) or "").split())
    tag = next((t for t in release_tags(version) if t in tags), None)
    status = _git(
        checkout, "status", "--porcelain=v1", "-z", "--ignored", "--untracked-files=normal"
    )
    dirty: list[str] = []
    if status is None:
        dirty.append("(git status failed)")
    else:
        entries = status.split("\0")
        skip = False
        for entry in entries:
            if skip:  # the source path of a rename
                skip = False
                continue
            if len(entry) < 4:
                continue
            code, path = entry[:2], entry[3:]
            skip = "R" in code or "C" in code
            if not _is_cache(path):
                dirty.append(path)
    return ReleaseState(version, commit, tag, tuple(sorted(dirty)))


def check_release_claim(
    commit: str, version: str, *, path: Path | None, checkout: Path | None = CHECKOUT
) -> None:
    """:class:`ReleaseUnproven` unless a record of ``commit`` and ``version`` may be a release
    build: a clean, known commit, a final version and, where ``checkout`` is a git checkout, a
    release tag of that version at that commit there. (Outside a checkout, the release key's
    signature is what vouches for it.)"""

    def refuse(why: str) -> ReleaseUnproven:
        return ReleaseUnproven(
            f"facts.release_build: claims a release build of {version} at {commit}: {why}",
            path=path,
            field="facts.release_build",
        )

    if not _COMMIT.fullmatch(commit):
        raise refuse("not a clean, known commit")
    if not is_release_version(version):
        raise refuse("not a final release version")
    if checkout is None or _git(checkout, "rev-parse", "--is-inside-work-tree") is None:
        return
    for tag in release_tags(version):
        found = _git(checkout, "rev-parse", "--verify", "-q", f"refs/tags/{tag}^{{commit}}")
        if found is not None and found.strip() == commit:
            return
    tags = " or ".join(release_tags(version))
    raise refuse(f"no release tag {tags} points at that commit in {checkout}")
