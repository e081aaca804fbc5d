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
        FileEntry(
            "m-00001-of-00002.gguf", 5, "aa", 4, ["c1", "c2"], [OUT, "token_embd.weight"], ["F32"]
        ),
        FileEntry(
            "m-00002-of-00002.gguf", 4, "bb", 4, ["c3"], [Q0, "blk.1.ffn_up.weight"], ["F16"]
        ),
    ],
)


def test_the_canonical_form_is_pinned() -> None:
    assert SMALL.text() == (
        '{"files":[{"chunk_bytes":4,"chunks":["c1","c2"],"layers":[],"name":'
        '"m-00001-of-00002.gguf","sha256":"aa","size":5,"tensors":["output.weight",'
        '"token_embd.weight"],"types":["F32"]},{"chunk_bytes":4,"chunks":["c3"],"layers":[0,1],'
        '"name":"m-00002-of-00002.gguf","sha256":"bb","size":4,"tensors":['
        '"blk.0.attn_q.weight","blk.1.ffn_up.weight"],"types":["F16"]}],"model":{"arch":'
        '"llama","n_layer":2,"official_target_sha":null},"schema":"dgr.manifest/1"}'
    )
    assert SMALL.quant_types == ("F16", "F32")
    assert SMALL.sha256 == hashlib.sha256(SMALL.text().encode()).hexdigest()
    assert parse_manifest(SMALL.text()) == SMALL


def _entry(name: str, *tensors: str) -> FileEntry:
    return FileEntry(name, 1, "00", 4, ["00"], sorted(tensors), ["F32"] if tensors else [])


FOUR = Manifest(
    arch="llama",
    n_layer=4,
    official_target_sha=None,
    files=[
        _entry("meta"),
        _entry("embd", "token_embd.weight", Q0),
        _entry("mid", "blk.1.ffn_up.weight", "blk.2.ffn_up.weight"),
        _entry("head", "blk.3.ffn_up.weight", "output_norm.weight", OUT),
    ],
)


def test_a_shard_needs_the_metadata_its_layers_and_its_end_tensors_only() -> None:
    def names(manifest: Manifest, layers: tuple[int, int] | None) -> list[str]:
        return [f.name for f in manifest.files_for(layers)]

    assert names(FOUR, (0, 2)) == ["meta", "embd", "mid"]
    assert names(FOUR, (2, 3)) == ["meta", "mid"]  # no embedding, no head
    assert names(FOUR, (3, 4)) == names(FOUR, (3, -1)) == ["meta", "head"]
    assert names(FOUR, None) == ["meta", "embd", "mid", "head"]
    tied = attrs.evolve(FOUR, files=[*FOUR.files[:3], _entry("head", "blk.3.ffn_up.weight")])
    assert names(tied, (3, 4)) == ["meta", "embd", "head"]  # the embedding is the output head
    everyone = attrs.evolve(
        FOUR, files=[*FOUR.files[:2], _entry("mid", "rope_freqs.weight"), FOUR.files[3]]
    )
    assert names(everyone, (3, 4)) == ["meta", "mid", "head"]  # a tensor every shard loads
    assert FOUR.files[1].shared and not FOUR.files[2].shared and FOUR.files[2].layers == (1, 2)


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


@pytest.mark.parametrize(
    ("file_change", "message"),
    [
        ({"size": -1, "chunks": []}, r"files\[0\]\.size: -1 bytes: a GGUF file is never empty"),
        ({"size": -5}, r"files\[0\]\.size: -5 bytes"),
        ({"size": 0, "chunks": []}, r"files\[0\]\.size: 0 bytes"),
        ({"size": 0, "chunks": ["c1"]}, r"files\[0\]\.size: 0 bytes"),
        ({"chunk_bytes": (256 << 20) + 1}, r"files\[0\]\.chunk_bytes: 268435457: chunks are 1"),
        ({"chunk_bytes": 1 << 30}, r"files\[0\]\.chunk_bytes: 1073741824"),
        ({"chunk_bytes": 0}, r"files\[0\]\.chunk_bytes: 0"),
        ({"chunks": ["c1", 7]}, r"files\[0\]\.chunks: not a list of strings"),
        ({"name": "m.gguf.part"}, r"files\[0\]\.name: 'm.gguf.part' ends in .part"),
    ],
)
def test_a_hostile_manifest_is_refused_at_validation(
    file_change: dict[str, object], message: str
) -> None:
    with pytest.raises(ManifestInvalid, match=message):
        parse_manifest(_broken({}, file_change))
    entry = SMALL.files[0]
    fields = {**attrs.asdict(entry), **file_change}
    with pytest.raises(ManifestInvalid):  # made in code, the same entry is refused too
        FileEntry(**fields)
    # honest entries beside it: the cap itself is allowed, and the pinned manifest still parses
    at_cap = attrs.evolve(entry, size=10, chunk_bytes=256 << 20, chunks=["c1"])
    assert parse_manifest(attrs.evolve(SMALL, files=[at_cap, SMALL.files[1]]).text()).files[0] == (
        at_cap
    )
    assert parse_manifest(SMALL.text()) == SMALL


def test_a_manifest_in_code_with_no_or_twice_named_files_is_refused() -> None:
    with pytest.raises(ManifestInvalid, match="files: empty"):
        attrs.evolve(SMALL, files=[])
    with pytest.raises(ManifestInvalid, match="files: a file name appears twice"):
        attrs.evolve(SMALL, files=[SMALL.files[0], SMALL.files[0]])
    with pytest.raises(ManifestInvalid, match="model.n_layer: -1"):
        attrs.evolve(SMALL, n_layer=-1)


def test_the_cli_caps_chunks_as_the_manifest_does(capsys: pytest.CaptureFixture[str]) -> None:
    from dgr_engine import cli
    from dgr_engine.artifacts.manifest import MAX_CHUNK_BYTES
    from dgr_engine.cli.artifacts import MAX_CHUNK_MIB

    assert MAX_CHUNK_MIB << 20 == MAX_CHUNK_BYTES == 256 << 20
    path = str(ensure_fixture("tiny-llama"))
    with pytest.raises(SystemExit) as refused:
        cli.main(["artifacts", "manifest", path, "--chunk-mib", str(MAX_CHUNK_MIB + 1)])
    assert refused.value.code == 2
    assert "--chunk-mib" in capsys.readouterr().err
    assert cli.main(["artifacts", "manifest", path, "--chunk-mib", str(MAX_CHUNK_MIB)]) == 0
    assert f'"chunk_bytes":{MAX_CHUNK_BYTES}' in capsys.readouterr().out
