"""TLS between clients and workers (issue 16, part 1): a worker with a certificate serves TLS
only, with a client CA it requires client certificates of that CA, it says so in its advert,
and a worker without TLS serves loopback only unless told explicitly. Attacks are refused and
leave a session of a proper client on the same worker producing the whole model's tokens."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import ShardUnavailable
from dgr_engine.reference import InProcessRoute
from dgr_engine.security.tls import (
    ClientTls,
    ServerTls,
    TlsConfigError,
    check_plaintext_bind,
    is_loopback,
)
from dgr_engine.tooling.processes import WorkerProcess, dgr_command
from dgr_engine.tooling.throwaway_ca import Authority, authority
from dgr_engine.worker import ShardWorker, WorkerConfig

KW = {"max_sessions": 2, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 16}
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Authority, Authority]]:
    """The workers' and clients' CA, and another CA nobody trusts."""
    directory = tmp_path_factory.mktemp("pki")
    yield authority(directory, "dgr"), authority(directory, "rogue")


def _whole_model_logits(model: Path) -> np.ndarray:
    with ShardEngine(model, **KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        return chain.forward(1, 0, PROMPT, 0)[-1]


async def _prefill(address: str, tls: ClientTls | None, session: str) -> np.ndarray:
    async with ShardClient(address, timeout=20.0, tls=tls) as client:
        advert = await client.describe()
        expect = expectations_of(advert)
        await client.open(session, 1, expect)
        result = await client.forward(
            session, 1, 0, expect, list(range(len(PROMPT))), tokens=PROMPT
        )
        await client.close(session, 1)
        return np.asarray(result.output)[-1]


async def _refused(address: str, tls: ClientTls | None) -> None:
    async with ShardClient(address, timeout=5.0, tls=tls) as client:
        with pytest.raises(ShardUnavailable):
            await client.describe()


def test_tls_and_mutual_tls_serve_proper_clients_and_refuse_the_rest(
    tiny_llama: Path, pki: tuple[Authority, Authority]
) -> None:
    ours, rogue = pki
    server = ours.issue("worker")
    alice, mallory = ours.issue("alice", client=True), rogue.issue("mallory", client=True)
    want = _whole_model_logits(tiny_llama)
    trusting = ClientTls.from_files(ours.cert)

    async def scenario(mutual: bool) -> None:
        tls = ServerTls.from_files(server.cert, server.key, ours.cert if mutual else None)
        worker = ShardWorker.load(tiny_llama, (0, 4), config=WorkerConfig(tls=tls), **KW)
        address = await worker.start()
        try:
            proper = ClientTls.from_files(ours.cert, alice.cert, alice.key) if mutual else trusting
            async with ShardClient(address, timeout=20.0, tls=proper) as client:
                security = (await client.describe()).security
                assert (security.tls, security.client_certificates) == (True, mutual)
            await _refused(address, None)  # a plaintext client
            await _refused(address, ClientTls.from_files(rogue.cert))  # trusts another CA
            if mutual:
                await _refused(address, trusting)  # no client certificate
                impostor = ClientTls.from_files(ours.cert, mallory.cert, mallory.key)
                await _refused(address, impostor)  # a certificate of another CA
            assert np.array_equal(await _prefill(address, proper, "alice"), want)
            assert worker.table.snapshot().sessions_open == 0
        finally:
            await worker.stop()

    asyncio.run(scenario(mutual=False))
    asyncio.run(scenario(mutual=True))


def test_plaintext_is_for_loopback_unless_allowed_explicitly() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("[::1]") and is_loopback("127.8.9.10")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("::")
    check_plaintext_bind("127.0.0.1", False)
    check_plaintext_bind("0.0.0.0", True)
    with pytest.raises(TlsConfigError, match="refusing to serve plaintext on 0.0.0.0"):
        check_plaintext_bind("0.0.0.0", False)
    with pytest.raises(TlsConfigError, match="not readable"):
        ServerTls.from_files("/nonexistent.crt", "/nonexistent.key")
    with pytest.raises(TlsConfigError, match="needs its key"):
        ClientTls.from_files(__file__, cert=__file__)


def _worker_line(*args: str) -> str:
    done = subprocess.run(
        [dgr_command(), "worker", "--fixture", "tiny-llama", "--layers", "0:4", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "LISTENING" not in done.stdout, done
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.slow  # starts worker processes
def test_the_worker_command_refuses_unsafe_or_half_given_tls(
    pki: tuple[Authority, Authority], tmp_path: Path
) -> None:
    ours, _ = pki
    server = ours.issue("cli-worker")
    assert "refusing to serve plaintext on 0.0.0.0" in _worker_line("--host", "0.0.0.0")
    line = _worker_line("--tls-cert", str(server.cert))
    assert line == "dgr worker: error: --tls-cert and --tls-key go together"
    line = _worker_line("--client-ca", str(ours.cert))
    assert line == "dgr worker: error: --client-ca needs --tls-cert and --tls-key"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    line = _worker_line("--tls-cert", str(not_pem), "--tls-key", str(server.key))
    assert line == f"dgr worker: error: TLS certificate {not_pem}: not a PEM file"
    line = _worker_line("--chain-tls-cert", str(server.cert))
    assert line == "dgr worker: error: --chain-tls-cert and --chain-tls-key need --chain-tls-ca"
    line = _worker_line("--chain-tls-ca", str(not_pem))
    assert line == f"dgr worker: error: CA {not_pem}: not a PEM file"


@pytest.mark.slow  # starts worker processes
def test_a_tls_worker_process_serves_tls_only(
    tiny_llama: Path, pki: tuple[Authority, Authority]
) -> None:
    ours, rogue = pki
    server, alice = ours.issue("proc-worker"), ours.issue("proc-alice", client=True)
    mallory = rogue.issue("proc-mallory", client=True)
    want = _whole_model_logits(tiny_llama)
    args = [dgr_command(), "worker", "--model", str(tiny_llama), "--layers", "0:4"]
    args += ["--tls-cert", str(server.cert), "--tls-key", str(server.key)]
    args += ["--client-ca", str(ours.cert), "--ctx", "64", "--threads", "1", "--batch", "16"]
    proper = ClientTls.from_files(ours.cert, alice.cert, alice.key)
    with WorkerProcess.launch(args) as worker:
        asyncio.run(_refused(worker.address, None))  # plaintext
        asyncio.run(_refused(worker.address, ClientTls.from_files(ours.cert)))  # no certificate
        impostor = ClientTls.from_files(ours.cert, mallory.cert, mallory.key)
        asyncio.run(_refused(worker.address, impostor))  # a certificate of another CA
        got = asyncio.run(_prefill(worker.address, proper, "alice"))
    assert np.array_equal(got, want)
    assert "(mutual TLS)" in worker.stderr_text()
