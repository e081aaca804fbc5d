"""Tests for native/build_llama.py: fast, offline, no real llama.cpp build."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "native" / "build_llama.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_llama", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_llama"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


bl = _load()

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")

INNER = "pkg-1.0/vendor/llama.cpp"
ORIGINAL_SRC = "int answer(void) {\n    return 41;\n}\n"
PATCH_OK = b"""\
diff --git a/src/answer.c b/src/answer.c
--- a/src/answer.c
+++ b/src/answer.c
@@ -1,3 +1,3 @@
 int answer(void) {
-    return 41;
+    return 42;
 }
"""
PATCH_NEXT = b"""\
diff --git a/src/answer.c b/src/answer.c
--- a/src/answer.c
+++ b/src/answer.c
@@ -1,3 +1,3 @@
 int answer(void) {
-    return 42;
+    return 43;
 }
"""
PATCH_BAD = b"""\
diff --git a/src/answer.c b/src/answer.c
--- a/src/answer.c
+++ b/src/answer.c
@@ -1,3 +1,3 @@
 int answer(void) {
-    return 7;
+    return 8;
 }
"""


def _tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _fake_sdist() -> bytes:
    return _tar_bytes(
        {
            "pkg-1.0/setup.py": b"# not llama\n",
            f"{INNER}/.git": b"gitdir: ../../.git/modules/vendor/llama.cpp\n",
            f"{INNER}/CMakeLists.txt": b"project(fake)\n",
            f"{INNER}/src/answer.c": ORIGINAL_SRC.encode(),
            f"{INNER}/include/llama.h": b"/* llama */\n",
            f"{INNER}/include/llama-cpp.h": b"/* llama c++ */\n",
            f"{INNER}/ggml/include/ggml.h": b"/* ggml */\n",
            f"{INNER}/ggml/include/gguf.h": b"/* gguf */\n",
            f"{INNER}/src/llama-ext.h": b"/* ext */\n",
            f"{INNER}/src/llama-impl.h": b"/* private */\n",
        }
    )


def _manifest(sha256: str | None = "0" * 64, filename: str = "pkg-1.0.tar.gz") -> dict[str, Any]:
    return {
        "upstream": {"repo": "ggml-org/llama.cpp", "commit": "ab" * 20},
        "sources": [
            {
                "kind": "pypi-sdist",
                "package": "pkg",
                "version": "1.0",
                "filename": filename,
                "sha256": sha256,
                "inner_path": INNER,
            },
            {
                "kind": "url",
                "url": "https://example.invalid/llama.tar.gz",
                "filename": "llama.tar.gz",
                "sha256": None,
                "inner_path": "llama",
            },
        ],
        "cmake": {"target": "llama", "options": {"BUILD_SHARED_LIBS": "OFF"}},
        "outputs": {
            "libs": ["libllama.a", "libggml.a", "libggml-base.a", "libggml-cpu.a"],
            "headers": ["include/*.h", "ggml/include/*.h", "src/llama-ext.h"],
        },
    }


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Any]:
    """A fake repo (manifest, patches/, script copy) plus a cache dir, all under tmp_path."""
    root = tmp_path / "repo"
    (root / "native").mkdir(parents=True)
    (root / "patches").mkdir()
    sdist = _fake_sdist()
    manifest = _manifest(sha256=hashlib.sha256(sdist).hexdigest())
    (root / "native" / bl.MANIFEST_NAME).write_text(json.dumps(manifest))
    script = root / "native" / "build_llama.py"
    script.write_bytes(SCRIPT.read_bytes())
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / "pkg-1.0.tar.gz").write_bytes(sdist)
    paths = bl.BuildPaths(
        repo_root=root,
        manifest=root / "native" / bl.MANIFEST_NAME,
        patches_dir=root / "patches",
        cache_dir=cache,
        workspace=root / ".workspace",
        script=script,
    )
    yield paths


def _key(paths: Any) -> str:
    return str(
        bl.compute_key(
            paths.manifest.read_bytes(),
            bl.read_patches(paths.patches_dir),
            paths.script.read_bytes(),
        )
    )


# --- key ----------------------------------------------------------------------------------


def test_key_changes_when_patch_changes_or_is_added(project: Any) -> None:
    k0 = _key(project)
    assert _key(project) == k0  # deterministic
    (project.patches_dir / "0001-first.patch").write_bytes(PATCH_OK)
    k1 = _key(project)
    assert k1 != k0
    (project.patches_dir / "0001-first.patch").write_bytes(PATCH_OK + b"\n")
    k2 = _key(project)
    assert k2 not in (k0, k1)
    (project.patches_dir / "0002-second.patch").write_bytes(PATCH_NEXT)
    k3 = _key(project)
    assert k3 not in (k0, k1, k2)
    # a rename alone changes the key too (names are part of the order)
    (project.patches_dir / "0002-second.patch").rename(project.patches_dir / "0003-second.patch")
    assert _key(project) != k3
    # files that are not patches do not matter
    (project.patches_dir / "README.md").write_text("notes")
    k4 = _key(project)
    (project.patches_dir / "README.md").write_text("other notes")
    assert _key(project) == k4


def test_key_covers_manifest_and_script(project: Any) -> None:
    k0 = _key(project)
    project.manifest.write_bytes(project.manifest.read_bytes() + b"\n")
    k1 = _key(project)
    assert k1 != k0
    project.script.write_bytes(project.script.read_bytes() + b"\n# edited\n")
    assert _key(project) not in (k0, k1)


def test_patch_order_is_numeric(tmp_path: Path) -> None:
    for name in ("10-late.patch", "2-b.patch", "0001-first.patch", "2-a.patch", "0100-last.patch"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("ignored")
    names = [p.name for p in bl.list_patches(tmp_path)]
    assert names == [
        "0001-first.patch",
        "2-a.patch",
        "2-b.patch",
        "10-late.patch",
        "0100-last.patch",
    ]


def test_misnamed_patch_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "0001-ok.patch").write_bytes(b"x")
    (tmp_path / "fix-thing.patch").write_bytes(b"x")
    with pytest.raises(bl.BuildError, match="fix-thing.patch"):
        bl.list_patches(tmp_path)


def test_missing_patches_dir_means_no_patches(tmp_path: Path) -> None:
    assert bl.list_patches(tmp_path / "nope") == []


def test_patch_stack_hash_covers_names_contents_and_order(tmp_path: Path) -> None:
    def stack() -> bytes:
        return bl.patch_stack_sha256(bl.read_patches(tmp_path))  # type: ignore[no-any-return]

    assert stack() == b""  # no patches: unknown, matches no lane
    (tmp_path / "0001-a.patch").write_text("a")
    (tmp_path / "0002-b.patch").write_text("b")
    (tmp_path / "notes.txt").write_text("ignored")
    first = stack()
    assert len(first) == 32 and first == stack()
    (tmp_path / "0002-b.patch").write_text("b2")
    assert stack() != first
    (tmp_path / "0002-b.patch").write_text("b")
    (tmp_path / "0002-b.patch").rename(tmp_path / "0003-b.patch")
    assert stack() != first


def test_the_binding_states_the_patch_stacks_it_was_built_with() -> None:
    from dgr_engine import _binding

    # a fresh checkout builds its binding from its own patches/: the base stack's hash, and
    # each family patch's by its architecture
    patches = bl.read_patches(REPO / "patches")
    assert _binding.PATCH_STACK_SHA256 == bl.patch_stack_sha256(bl.base_patches(patches))
    assert len(_binding.PATCH_STACK_SHA256) == 32
    families = bl.family_patch_sha256s(patches)
    assert sorted(families) == ["gemma3", "phi3", "qwen2", "qwen3"]
    for arch, digest in families.items():
        assert _binding.family_patch_sha256(arch) == digest, arch
    assert _binding.SUPPORTED_ARCHS == ("llama", "deepseek4", *families)


def test_the_base_stack_is_the_one_every_committed_record_and_the_lock_name() -> None:
    """Family patches stay out of the base stack's hash: the value the lock's hardware lanes
    and every committed record bind is still the one the base stack (0001-0010) hashes to."""
    patches = bl.read_patches(REPO / "patches")
    base = bl.patch_stack_sha256(bl.base_patches(patches)).hex()
    assert [p.name[:4] for p in bl.base_patches(patches)] == [f"{i:04d}" for i in range(1, 11)]
    lock = json.loads((REPO / "certification" / "lock.json").read_text())
    assert {lane["patch_stack_sha256"] for lane in lock["hardware_lanes"]} == {base}
    records = sorted((REPO / "evidence").rglob("*.json"))
    assert records
    assert {json.loads(r.read_text())["lane"]["patch_stack_sha256"] for r in records} == {base}
    assert base == "81a6732a11b68a661916c26cbd883531e2fb667e225bb2475fc5f191da8738b6"
    # every patch still builds: the build key covers the family patches too
    key_all = bl.compute_key(b"m", patches, b"s")
    assert key_all != bl.compute_key(b"m", bl.base_patches(patches), b"s")


def test_every_family_patch_changes_only_its_architectures_builder() -> None:
    families = [p for p in bl.read_patches(REPO / "patches") if p.family is not None]
    assert sorted(p.family for p in families) == ["gemma3", "phi3", "qwen2", "qwen3"]
    for patch in families:
        head = patch.header
        assert head[0].startswith(f"dgr patch {patch.name[:4]}: "), patch.name
        assert f"Family: {patch.family}" in head, patch.name
        assert patch.touched_paths == [f"src/models/{patch.family}.cpp"], patch.name
    bl.check_family_patches(families)  # what the build and the binding check


def _family_patch(path: str, family: str = "gemma3") -> bytes:
    return (
        f"dgr patch 0011: x\n\nFamily: {family}\nWhy: y\nTouches: {path}\n\n"
        f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-a\n+b\n"
    ).encode()


def test_a_family_patch_reaching_past_its_builder_is_refused_by_name() -> None:
    ok = bl.PatchFile("0011-gemma3.patch", _family_patch("src/models/gemma3.cpp"))
    assert ok.family == "gemma3" and ok.touched_paths == ["src/models/gemma3.cpp"]
    bl.check_family_patches([ok])
    for path in ("src/models/llama.cpp", "src/llama-graph.cpp", "src/models/models.h"):
        bad = bl.PatchFile("0012-bad.patch", _family_patch(path))
        with pytest.raises(
            bl.PatchError, match=f"0012-bad.patch \\(family gemma3\\) changes {path}"
        ):
            bl.check_family_patches([ok, bad])
    nameless = bl.PatchFile("0013-x.patch", _family_patch("src/models/x.cpp", family="X Y"))
    with pytest.raises(bl.PatchError, match="names no architecture"):
        bl.check_family_patches([nameless])
    base = bl.PatchFile("0001-base.patch", b"dgr patch 0001: x\nWhy: a Family: line below\n")
    assert base.family is None


def test_a_family_patch_leaves_the_base_hash_and_other_families_alone(tmp_path: Path) -> None:
    (tmp_path / "0001-base.patch").write_bytes(b"dgr patch 0001: base\n")
    before = bl.read_patches(tmp_path)
    (tmp_path / "0002-qwen3.patch").write_bytes(_family_patch("src/models/qwen3.cpp", "qwen3"))
    (tmp_path / "0003-gemma3.patch").write_bytes(_family_patch("src/models/gemma3.cpp"))
    after = bl.read_patches(tmp_path)
    base = bl.patch_stack_sha256(bl.base_patches(after))
    assert base == bl.patch_stack_sha256(before)
    families = bl.family_patch_sha256s(after)
    assert list(families) == ["gemma3", "qwen3"]
    assert families["qwen3"] == bl.patch_stack_sha256([after[1]])
    (tmp_path / "0003-gemma3.patch").write_bytes(_family_patch("src/models/gemma3.cpp") + b"#")
    again = bl.family_patch_sha256s(bl.read_patches(tmp_path))
    assert again["qwen3"] == families["qwen3"] and again["gemma3"] != families["gemma3"]


# --- manifest -----------------------------------------------------------------------------


def test_repo_manifest_is_valid() -> None:
    data = (REPO / "native" / bl.MANIFEST_NAME).read_bytes()
    manifest = bl.parse_manifest(data)
    commit = manifest["upstream"]["commit"]
    assert commit == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    primary, alternative = manifest["sources"]
    assert primary["filename"] == "llama_cpp_python-0.3.36.tar.gz"
    assert primary["sha256"] == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert primary["inner_path"] == "llama_cpp_python-0.3.36/vendor/llama.cpp"
    assert alternative["sha256"] is None
    assert commit in alternative["url"] and alternative["inner_path"] == f"llama.cpp-{commit}"
    options = manifest["cmake"]["options"]
    assert options["BUILD_SHARED_LIBS"] == "OFF" and options["GGML_NATIVE"] == "OFF"
    assert manifest["cmake"]["target"] == "llama"


def test_bad_manifest_is_refused() -> None:
    with pytest.raises(bl.BuildError, match="JSON"):
        bl.parse_manifest(b"{not json")
    broken = _manifest()
    broken["upstream"]["commit"] = "main"
    with pytest.raises(bl.BuildError, match="40 hex"):
        bl.parse_manifest(json.dumps(broken).encode())


# --- fetch --------------------------------------------------------------------------------


def test_cached_download_with_right_sha_is_used(project: Any) -> None:
    manifest = bl.parse_manifest(project.manifest.read_bytes())
    src, archive = bl.fetch_source(manifest, project.downloads, lambda _m: None)
    assert archive == project.downloads / "pkg-1.0.tar.gz"
    assert src["kind"] == "pypi-sdist"


def test_corrupt_cached_download_is_refused_and_deleted(project: Any) -> None:
    manifest = bl.parse_manifest(project.manifest.read_bytes())
    bad = project.downloads / "pkg-1.0.tar.gz"
    bad.write_bytes(b"truncated garbage")
    with pytest.raises(bl.ChecksumError, match="sha256 mismatch") as err:
        bl.fetch_source(manifest, project.downloads, lambda _m: None)
    assert manifest["sources"][0]["sha256"] in str(err.value)
    assert hashlib.sha256(b"truncated garbage").hexdigest() in str(err.value)
    assert not bad.exists()


def test_corrupt_fresh_download_is_refused(project: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = bl.parse_manifest(project.manifest.read_bytes())
    (project.downloads / "pkg-1.0.tar.gz").unlink()
    calls: list[str] = []

    def fake_download(src: dict[str, Any], tmpdir: Path, log: Any) -> Path:
        calls.append(src["filename"])
        out = tmpdir / str(src["filename"])
        out.write_bytes(b"tampered")
        return out

    monkeypatch.setattr(bl, "download_source", fake_download)
    with pytest.raises(bl.ChecksumError, match="sha256 mismatch"):
        bl.fetch_source(manifest, project.downloads, lambda _m: None)
    assert calls == ["pkg-1.0.tar.gz"]  # the unpinned alternative is never tried
    assert list(project.downloads.iterdir()) == []  # nothing bad left in the cache


def test_fresh_download_is_verified_and_cached(
    project: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = bl.parse_manifest(project.manifest.read_bytes())
    good = (project.downloads / "pkg-1.0.tar.gz").read_bytes()
    (project.downloads / "pkg-1.0.tar.gz").unlink()

    def fake_download(src: dict[str, Any], tmpdir: Path, log: Any) -> Path:
        out = tmpdir / str(src["filename"])
        out.write_bytes(good)
        return out

    monkeypatch.setattr(bl, "download_source", fake_download)
    _, archive = bl.fetch_source(manifest, project.downloads, lambda _m: None)
    assert archive.read_bytes() == good
    assert sorted(p.name for p in project.downloads.iterdir()) == ["pkg-1.0.tar.gz"]


def test_unreachable_sources_fail_with_a_summary(
    project: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = bl.parse_manifest(project.manifest.read_bytes())
    (project.downloads / "pkg-1.0.tar.gz").unlink()

    def offline(src: dict[str, Any], tmpdir: Path, log: Any) -> Path:
        raise OSError("network unreachable")

    monkeypatch.setattr(bl, "download_source", offline)
    with pytest.raises(bl.BuildError, match="network unreachable"):
        bl.fetch_source(manifest, project.downloads, lambda _m: None)


# --- extract ------------------------------------------------------------------------------


def test_extract_takes_only_the_inner_tree(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(_fake_sdist())
    dest = tmp_path / "ws" / "llama.cpp-abc"
    dest.mkdir(parents=True)
    (dest / "leftover.txt").write_text("from an earlier build")
    bl.extract_source(archive, INNER, dest)
    assert (dest / "src" / "answer.c").read_text() == ORIGINAL_SRC
    assert (dest / "ggml" / "include" / "ggml.h").is_file()
    assert not (dest / ".git").exists()  # the sdist's submodule link is dropped
    assert not (dest / "leftover.txt").exists()  # fresh tree every time
    assert not (dest / "setup.py").exists()
    assert not (tmp_path / "ws" / "llama.cpp-abc.partial").exists()


def test_extract_refuses_unsafe_members(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar.gz"
    archive.write_bytes(_tar_bytes({f"{INNER}/ok.txt": b"ok", f"{INNER}/../../../evil": b"x"}))
    with pytest.raises(bl.BuildError, match="unsafe"):
        bl.extract_source(archive, INNER, tmp_path / "out")
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "out").exists()


def test_extract_missing_inner_path(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(_fake_sdist())
    with pytest.raises(bl.BuildError, match="nothing under"):
        bl.extract_source(archive, "other/path", tmp_path / "out")


# --- patches ------------------------------------------------------------------------------


def _fake_tree(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "answer.c").write_text(ORIGINAL_SRC)
    return root


@needs_git
def test_patches_apply_in_order(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path / "llama.cpp")
    logs: list[str] = []
    patches = [bl.PatchFile("0001-a.patch", PATCH_OK), bl.PatchFile("0002-b.patch", PATCH_NEXT)]
    bl.apply_patches(tree, patches, logs.append)
    assert "return 43;" in (tree / "src" / "answer.c").read_text()
    assert logs == ["llama.cpp: applied 0001-a.patch", "llama.cpp: applied 0002-b.patch"]


@needs_git
def test_patch_that_does_not_apply_fails_loudly(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path / "llama.cpp")
    patches = [bl.PatchFile("0001-a.patch", PATCH_OK), bl.PatchFile("0002-broken.patch", PATCH_BAD)]
    with pytest.raises(bl.PatchError) as err:
        bl.apply_patches(tree, patches, lambda _m: None)
    message = str(err.value)
    assert "0002-broken.patch" in message and "does not apply" in message
    assert "after 0001-a.patch" in message
    assert "src/answer.c" in message  # git's own output is included
    # the failing patch changed nothing (checked before applying)
    assert "return 42;" in (tree / "src" / "answer.c").read_text()


@needs_git
def test_patch_applies_inside_an_enclosing_git_repo(tmp_path: Path) -> None:
    """The workspace lives inside the dgr checkout, in an ignored directory; without a
    ceiling, git apply would treat paths as relative to the checkout, skip them and exit 0."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text(".workspace/\n")
    tree = _fake_tree(repo / ".workspace" / "llama.cpp-abc")
    bl.apply_patches(tree, [bl.PatchFile("0001-a.patch", PATCH_OK)], lambda _m: None)
    assert "return 42;" in (tree / "src" / "answer.c").read_text()


def test_no_patches_is_fine(tmp_path: Path) -> None:
    logs: list[str] = []
    bl.apply_patches(tmp_path, [], logs.append)
    assert logs == ["llama.cpp: no patches in patches/"]


# --- progress -----------------------------------------------------------------------------


def test_build_progress_is_sampled(tmp_path: Path) -> None:
    code = "for i in range(1, 201): print(f'[{i}/200] Building CXX object x{i}.o')"
    logs: list[str] = []
    bl.run_streamed([sys.executable, "-c", code], tmp_path, logs.append, "build", bl._Clock())
    assert 8 <= len(logs) <= 11
    assert "[200/200]" in logs[-1] and "100%" in logs[-1]


def test_failing_command_shows_its_last_lines(tmp_path: Path) -> None:
    code = "import sys; print('[1/2] compiling'); print('error: boom'); sys.exit(3)"
    with pytest.raises(bl.BuildError, match="(?s)exit 3.*error: boom"):
        bl.run_streamed(
            [sys.executable, "-c", code], tmp_path, lambda _m: None, "build", bl._Clock()
        )


# --- cache / ensure_llama -----------------------------------------------------------------


def _fake_cmake(
    src_dir: Path, build_dir: Path, manifest: dict[str, Any], log: Any, clock: Any
) -> dict[str, Any]:
    (build_dir / "src").mkdir(parents=True)
    (build_dir / "ggml" / "src").mkdir(parents=True)
    (build_dir / "src" / "libllama.a").write_bytes(b"!<arch>\nllama")
    for name in ("libggml.a", "libggml-base.a", "libggml-cpu.a"):
        (build_dir / "ggml" / "src" / name).write_bytes(b"!<arch>\n" + name.encode())
    return {"cmake_version": "0.0", "generator": "fake", "jobs": 1}


def test_cache_hit_returns_existing_prefix_without_building(
    project: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = _key(project)
    prefix = project.llama_root / key[:16]
    (prefix / "lib").mkdir(parents=True)
    (prefix / "include").mkdir()
    for name in ("libllama.a", "libggml.a", "libggml-base.a", "libggml-cpu.a"):
        (prefix / "lib" / name).write_bytes(b"lib")
    (prefix / "BUILD_INFO.json").write_text(json.dumps({"key": key}))

    def must_not_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("build_prefix called on a cache hit")

    monkeypatch.setattr(bl, "build_prefix", must_not_build)
    logs: list[str] = []
    assert bl.ensure_llama(log=logs.append, paths=project) == prefix
    assert logs == [f"llama.cpp: cached build {key[:16]} at {prefix}"]


def test_stale_or_incomplete_prefix_is_rebuilt(
    project: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = _key(project)
    prefix = project.llama_root / key[:16]
    prefix.mkdir(parents=True)
    (prefix / "BUILD_INFO.json").write_text(json.dumps({"key": "f" * 64}))
    calls: list[str] = []
    monkeypatch.setattr(bl, "build_prefix", lambda *a, **k: calls.append(a[3]))
    assert bl.ensure_llama(log=lambda _m: None, paths=project) == prefix
    assert calls == [key]


@needs_git
def test_full_pipeline_with_fake_cmake(project: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """fetch (cached) -> extract -> patch -> (fake) build -> install -> cache hit."""
    (project.patches_dir / "0001-answer.patch").write_bytes(PATCH_OK)
    monkeypatch.setattr(bl, "run_cmake", _fake_cmake)
    logs: list[str] = []
    prefix = bl.ensure_llama(log=logs.append, paths=project)
    key = _key(project)
    assert prefix == project.cache_dir / "llama" / key[:16]
    assert sorted(p.name for p in (prefix / "lib").iterdir()) == [
        "libggml-base.a",
        "libggml-cpu.a",
        "libggml.a",
        "libllama.a",
    ]
    assert sorted(p.name for p in (prefix / "include").iterdir()) == [
        "ggml.h",
        "gguf.h",
        "llama-cpp.h",
        "llama-ext.h",
        "llama.h",
    ]
    info = json.loads((prefix / "BUILD_INFO.json").read_text())
    assert info["key"] == key and info["commit"] == "ab" * 20
    assert info["patches"] == [
        {"name": "0001-answer.patch", "sha256": hashlib.sha256(PATCH_OK).hexdigest()}
    ]
    assert info["cmake_options"] == {"BUILD_SHARED_LIBS": "OFF"}
    assert isinstance(info["build_seconds"], float) and info["timestamp"]
    src_dir = project.workspace / f"llama.cpp-{'ab' * 6}"
    assert "return 42;" in (src_dir / "src" / "answer.c").read_text()
    assert not list(project.llama_root.glob(".tmp-*"))  # staged then renamed
    assert not (prefix / "src").exists()  # sources are not copied into the cache

    # second call: cache hit, no build
    monkeypatch.setattr(bl, "run_cmake", None)
    logs.clear()
    assert bl.ensure_llama(log=logs.append, paths=project) == prefix
    assert logs == [f"llama.cpp: cached build {key[:16]} at {prefix}"]

    # a new patch means a new key and a rebuild from a pristine tree
    (project.patches_dir / "0002-next.patch").write_bytes(PATCH_NEXT)
    monkeypatch.setattr(bl, "run_cmake", _fake_cmake)
    prefix2 = bl.ensure_llama(log=lambda _m: None, paths=project)
    assert prefix2 != prefix
    assert "return 43;" in (src_dir / "src" / "answer.c").read_text()


@needs_git
def test_concurrent_builds_build_once(project: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """flock serialises two builders of the same key; the second one reuses the first's."""
    calls: list[int] = []
    started = threading.Event()
    second_is_waiting = threading.Event()

    def slow_cmake(*args: Any) -> dict[str, Any]:
        calls.append(1)
        started.set()
        # hold the lock until the second builder has found it held (bounded)
        assert second_is_waiting.wait(10)
        return _fake_cmake(*args)

    def second_log(line: str) -> None:
        logs.append(line)
        if "waiting for lock" in line:
            second_is_waiting.set()

    monkeypatch.setattr(bl, "run_cmake", slow_cmake)
    results: list[Path] = []
    logs: list[str] = []
    first = threading.Thread(target=lambda: results.append(bl.ensure_llama(paths=project)))
    first.start()
    assert started.wait(10)
    results.append(bl.ensure_llama(log=second_log, paths=project))
    first.join(10)
    assert len(calls) == 1
    assert len(results) == 2 and results[0] == results[1]
    assert any("waiting for lock" in line for line in logs)
    assert logs[-1].startswith("llama.cpp: cached build")


@needs_git
def test_broken_patch_stops_the_build(project: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (project.patches_dir / "0001-broken.patch").write_bytes(PATCH_BAD)
    monkeypatch.setattr(bl, "run_cmake", None)  # must not get that far
    with pytest.raises(bl.PatchError, match="0001-broken.patch"):
        bl.ensure_llama(log=lambda _m: None, paths=project)
    built = [p for p in project.llama_root.iterdir() if not p.name.startswith(".")]
    assert built == []  # no prefix was installed


def test_cli_print_prefix_on_cache_hit(
    project: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    def fake_ensure(
        force: bool = False, log: Any = print, paths: Any = None, sanitize: bool = False
    ) -> Path:
        seen["force"] = force
        log("llama.cpp: progress line")
        return Path(project.cache_dir) / "llama" / "0123456789abcdef"

    monkeypatch.setattr(bl, "ensure_llama", fake_ensure)
    assert bl.main(["--print-prefix", "--force"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{project.cache_dir / 'llama' / '0123456789abcdef'}\n"
    assert "progress line" in err and seen["force"] is True


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "c"))
    assert bl.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DGR_CACHE_DIR")
    assert bl.default_cache_dir() == Path.home() / ".cache" / "dgr"
