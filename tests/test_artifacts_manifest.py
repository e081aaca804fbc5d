"""The hashed manifest: built from GGUF files, canonical (pinned), parsed back, and refused in
one line when it is malformed or disagrees with itself."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import attrs
import pytest

from dgr_engine.artifacts.manifest import (
    MANIFEST_SCHEMA,
    FileEntry,
    Manifest,
    ManifestInvalid,
    build_manifest,
    load_manifest,
    parse_manifest,
)
from dgr_engine.fixtures import ensure_fixture

OUT, Q0 = "output.weight", "blk.0.attn_q.weight"
SMALL = Manifest(
    arch="llama",
    n_layer=2,
    official_target_sha=None,
    files=[
        FileEntry("m-00001-of-00002.gguf", 5, "aa", 4, ["c1", "c2"], [OUT, "token_embd.weight"]),
        FileEntry("m-00002-of-00002.gguf", 4, "bb", 4, ["c3"], [Q0, "blk.1.ffn_up.weight"]),
    ],
)


def test_the_canonical_form_is_pinned() -> None:
    assert SMALL.text() == (
        '{"files":[{"chunk_bytes":4,"chunks":["c1","c2"],"layers":[],"name":'
        '"m-00001-of-00002.gguf","sha256":"aa","size":5,"tensors":["output.weight",'
        '"token_embd.weight"]},{"chunk_bytes":4,"chunks":["c3"],"layers":[0,1],"name":'
        '"m-00002-of-00002.gguf","sha256":"bb","size":4,"tensors":["blk.0.attn_q.weight",'
        '"blk.1.ffn_up.weight"]}],"model":{"arch":"llama","n_layer":2,'
        '"official_target_sha":null},"schema":"dgr.manifest/1"}'
    )
    assert SMALL.sha256 == hashlib.sha256(SMALL.text().encode()).hexdigest()
    assert parse_manifest(SMALL.text()) == SMALL


def test_a_shard_needs_its_layers_files_and_the_shared_ones() -> None:
    first, second = SMALL.files
    assert first.shared and first.layers == ()
    assert not second.shared and second.layers == (0, 1)
    assert SMALL.files_for((0, 1)) == (first, second)
    three = attrs.evolve(
        SMALL,
        files=[*SMALL.files, FileEntry("x", 1, "cc", 4, ["c4"], ["blk.5.ffn_up.weight"])],
    )
    assert [f.name for f in three.files_for((5, 6))] == ["m-00001-of-00002.gguf", "x"]


@pytest.mark.parametrize(("fixture", "n_layer"), [("tiny-llama", 4), ("tiny-v4", 6)])
def test_a_single_file_manifest_hashes_every_chunk(fixture: str, n_layer: int) -> None:
    path = ensure_fixture(fixture)
    data = path.read_bytes()
    manifest = build_manifest([path], chunk_bytes=1 << 16)
    (entry,) = manifest.files
    assert (manifest.arch, manifest.n_layer) == (("llama", 4) if n_layer == 4 else ("deepseek4", 6))
    assert entry.size == len(data) and entry.sha256 == hashlib.sha256(data).hexdigest()
    assert len(entry.chunks) == -(-len(data) // (1 << 16))
    assert entry.chunks[1] == hashlib.sha256(data[1 << 16 : 2 << 16]).hexdigest()
    assert entry.layers == tuple(range(n_layer)) and entry.shared
    assert parse_manifest(manifest.text()) == manifest


def test_a_manifest_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(SMALL.text())
    assert load_manifest(path) == SMALL
    with pytest.raises(ManifestInvalid, match="not readable"):
        load_manifest(tmp_path / "absent.json")


def _broken(change: dict[str, object], file_change: dict[str, object] | None = None) -> str:
    data = json.loads(SMALL.text())
    data.update(change)
    if file_change:
        data["files"][0].update(file_change)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("[]", "not a JSON object"),
        (_broken({"schema": "dgr.manifest/2"}), "schema 'dgr.manifest/2': this dgr reads"),
        (_broken({"files": []}), "files: empty"),
        (_broken({}, {"size": "5"}), r"files\[0\].size: wrong type"),
        (_broken({}, {"chunks": ["c1"]}), r"files\[0\].chunks: 1 chunk hashes for 5 bytes"),
        (_broken({}, {"layers": [3]}), r"files\[0\].layers: \[3\] disagrees"),
        (_broken({"model": {"arch": "llama"}}), "model.n_layer: missing"),
    ],
)
def test_a_bad_manifest_is_refused_naming_the_field(
    text: str, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ManifestInvalid, match=message):
        parse_manifest(text)
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ManifestInvalid, match=str(path)):
        load_manifest(path)


def test_the_schema_constant() -> None:
    assert MANIFEST_SCHEMA == "dgr.manifest/1"


def test_dgr_artifacts_manifest_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dgr_engine import cli

    path = ensure_fixture("tiny-llama")
    out = tmp_path / "m" / "manifest.json"
    assert cli.main(["artifacts", "manifest", str(path), "--out", str(out)]) == 0
    manifest = load_manifest(out)
    assert f"manifest sha256 {manifest.sha256}" in capsys.readouterr().err
    assert manifest == build_manifest([path])
    assert cli.main(["artifacts", "manifest", str(tmp_path / "absent.gguf")]) == 2
    assert capsys.readouterr().err.startswith("dgr artifacts manifest: ")
