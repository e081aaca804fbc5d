"""The MTP drafts of dgr's last stage are those llama.cpp's own ``draft-mtp`` path proposes: the
pinned tree's ``llama-server`` (the peers build, no dgr patch) runs ``tiny-v4-mtp`` with
``--spec-type draft-mtp`` at temperature 0 and logs each draft's top candidate; dgr drafts at
the same positions from the same history, on one engine and on the last of two stages."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.tooling import peer_build

PROMPT = [17, 4, 99, 230, 5, 61, 17, 4, 99, 12]
K = 4
N_PREDICT = 8
CANDIDATE = re.compile(rb"draft candidate +0, pos +(\d+): +(\d+) ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[int], bytes]]:
    """The tokens llama-server generates and its debug log (each draft's candidates)."""
    binary = peer_build.ensure_peers(log=lambda _m: None) / "bin" / "llama-server"
    model = ensure_fixture("tiny-v4-mtp")
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    port = free_port()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", "256", "-np", "1", "-t", "1", "-ngl", "0", "--no-warmup", "-lv", "5"]
    argv += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(K), "--spec-draft-p-min", "0"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):  # bounded: the server answers /health once the model is loaded
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    try:  # not up yet: wait on the process itself, which must not exit
                        proc.wait(timeout=0.1)
                    except subprocess.TimeoutExpired:
                        continue
                    pytest.fail(f"llama-server exited: {log_path.read_text()[-2000:]}")
            else:
                pytest.fail("llama-server did not answer /health within 60 s")
            body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0}
            body |= {"cache_prompt": False, "return_tokens": True}
            request = urllib.request.Request(f"{url}/completion", json.dumps(body).encode())
            with urllib.request.urlopen(request, timeout=60) as r:
                tokens = [int(t) for t in json.loads(r.read())["tokens"]]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    yield tokens, log_path.read_bytes()


def server_drafts(log: bytes) -> list[list[int]]:
    """Each draft block's top candidates, in order (``pos`` restarts at 0 per block)."""
    blocks: list[list[int]] = []
    for match in CANDIDATE.finditer(log):
        if int(match.group(1)) == 0:
            blocks.append([])
        blocks[-1].append(int(match.group(2)))
    return blocks


@pytest.mark.parametrize("split", [False, True])
def test_mtp_drafts_equal_llama_cpp_draft_mtp(
    server_run: tuple[list[int], bytes], split: bool
) -> None:
    tokens, log = server_run
    blocks = server_drafts(log)
    assert len(blocks) >= 4 and all(len(b) == K for b in blocks)
    path = ensure_fixture("tiny-v4-mtp")
    kw = {"n_threads": 1, "max_sessions": 1, "n_ctx_per_session": 64}
    engines = (
        [
            ShardEngine(path, layers=(0, 3), **kw),
            ShardEngine(path, layers=(3, 6), load_mtp=True, **kw),
        ]
        if split
        else [ShardEngine(path, load_mtp=True, **kw)]
    )
    try:
        for e in engines:
            e.open_session(1, 0)

        def forward(ids: list[int], start: int) -> np.ndarray:
            pos = np.arange(start, start + len(ids))
            rows = None
            for e in engines:
                tok = ids if e.info.needs_token_ids else None
                rows = e.forward(1, 0, pos, tokens=tok, rows=rows)
            assert rows is not None
            return rows

        out = [int(np.argmax(forward(PROMPT, 0)[-1]))]
        ours = []
        for j in range(len(blocks)):
            ours.append(engines[-1].mtp_draft(1, 0, out[-1], K))
            out.append(int(np.argmax(forward([out[-1]], len(PROMPT) + j)[-1])))
    finally:
        for e in engines:
            e.close()
    assert out[: len(tokens)] == tokens[: len(out)]  # greedy decoding agrees first
    assert ours == blocks
