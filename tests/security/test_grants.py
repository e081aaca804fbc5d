"""Route grants (issue 16, part 2), tested as an attacker would: against a real worker process
configured with the tracker's key, every forged, foreign, expired or replayed grant and every
frame or close without the session secret is refused with its status, and a proper client's
session on the same worker goes on producing the whole model's logits. A hypothesis test
mutates valid grants byte by byte: no mutation is ever accepted."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import GrantDenied, GrantUnauthenticated
from dgr_engine.options import EngineOptions
from dgr_engine.reference import InProcessRoute, whole_model_reference
from dgr_engine.security.grants import Grant, GrantIssuer, GrantVerifier, issue, public_pem
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.processes import WorkerProcess, dgr_command
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    Lane,
    ModelIdentity,
    Recipe,
    Route,
    SessionHandle,
    SessionManager,
    SessionResult,
    SessionState,
    StageSpec,
)

KW = {"max_sessions": 4, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 16}
PROMPT = [9, 99, 199, 29, 1]
TRACKER = Ed25519PrivateKey.generate()
ROTATED = Ed25519PrivateKey.generate()


def forged(token: bytes) -> bytes:
    """``token`` with one bit of its signature flipped (never the same token: replacing its
    last characters could leave them as they were)."""
    head, tail = token.split(b".")
    signature = bytearray(base64.urlsafe_b64decode(tail + b"=" * (-len(tail) % 4)))
    signature[0] ^= 1
    return head + b"." + base64.urlsafe_b64encode(bytes(signature)).rstrip(b"=")


def grant(**changes: Any) -> Grant:
    base = Grant(
        session_id="s",
        epoch=1,
        endpoint="127.0.0.1:7000",
        layer_begin=0,
        layer_end=4,
        model_sha256="ab" * 32,
        lane_id="lane",
        expires_at=time.time() + 60,
        key_id="k1",
    )
    return attrs.evolve(base, **changes)


def check(verifier: GrantVerifier, token: bytes, **changes: Any) -> Grant:
    asked: dict[str, Any] = {
        "session_id": "s",
        "epoch": 1,
        "endpoint": "127.0.0.1:7000",
        "layers": (0, 4),
        "model_sha256": "ab" * 32,
        "lane_id": "lane",
    }
    return verifier.verify(token, **{**asked, **changes})


def test_a_grant_opens_exactly_its_session_epoch_stage_model_and_lane_once() -> None:
    verifier = GrantVerifier({"k1": TRACKER.public_key(), "k2": ROTATED.public_key()})
    assert check(verifier, issue(grant(), TRACKER)).session_id == "s"
    assert check(verifier, issue(grant(key_id="k2"), ROTATED)).key_id == "k2"  # rotation
    for field, asked in [
        ("session", {"session_id": "other"}),
        ("epoch", {"epoch": 2}),
        ("stage", {"endpoint": "127.0.0.1:7001"}),
        ("layer range", {"layers": (0, 2)}),
        ("model", {"model_sha256": "cd" * 32}),
        ("lane", {"lane_id": "other-lane"}),
    ]:
        with pytest.raises(GrantDenied, match=f"for another {field} "):
            check(verifier, issue(grant(), TRACKER), **asked)
    with pytest.raises(GrantDenied, match="has expired"):
        check(verifier, issue(grant(expires_at=time.time() - 1), TRACKER))
    once = issue(grant(), TRACKER)
    spent = check(verifier, once)
    with pytest.raises(GrantDenied, match="used before"):
        check(verifier, once)
    verifier.refund(spent)  # the open it was for failed: usable again
    check(verifier, once)
    with pytest.raises(GrantUnauthenticated, match="unknown key 'k9'"):
        check(verifier, issue(grant(key_id="k9"), TRACKER))
    with pytest.raises(GrantUnauthenticated, match="signature does not verify"):
        check(verifier, issue(grant(), ROTATED))  # k1's id, another key
    for bad in (b"", b"x", b"a.b.c", b"!!.!!", b"W10.c2ln"):
        with pytest.raises(GrantUnauthenticated):
            check(verifier, bad)


def test_a_verifier_refuses_grants_issued_before_it_started_and_grants_without_a_time() -> None:
    """A restarted worker's verifier cannot know the nonces its previous instance spent: it
    refuses every grant issued before it was made, however valid otherwise; a grant whose
    signed payload names no issue time (an older issuer's) is malformed, not let through."""
    before = issue(grant(issued_at=time.time() - 1), TRACKER)
    verifier = GrantVerifier({"k1": TRACKER.public_key()})
    with pytest.raises(GrantDenied, match="issued before this worker started"):
        check(verifier, before)
    assert check(verifier, issue(grant(), TRACKER)).issued_at >= verifier.started_at
    fields = attrs.asdict(grant())
    del fields["issued_at"]
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    untimed = b".".join(
        base64.urlsafe_b64encode(part).rstrip(b"=") for part in (payload, TRACKER.sign(payload))
    )
    with pytest.raises(GrantUnauthenticated, match="no issue time"):
        check(verifier, untimed)


def test_a_route_is_granted_stage_by_stage_with_each_next_stage_named() -> None:
    """``GrantIssuer.grant_route`` names, in each stage's grant, where its output may go: the
    next stage, and for the last one the first (a ring links back); ``usage_grant`` opens
    nothing but proves the tracker to ``Usage``."""
    issuer = GrantIssuer(TRACKER, "k1")
    verifier = GrantVerifier({"k1": TRACKER.public_key()})
    lane = Lane(
        backend="cpu",
        llama_cpp_commit="c" * 40,
        patch_stack_hash=bytes(32),
        dgr_version="0.1.0",
        hardware="test",
        lane_id="lane",
    )
    stages = [
        StageSpec(
            endpoint=f"127.0.0.1:{7000 + i}",
            layer_begin=2 * i,
            layer_end=2 * i + 2,
            identity=ModelIdentity(content_hash=bytes(32), arch="llama", n_layer=6),
            recipe=Recipe(quant_types=("F32",), context=64),
            lane=lane,
        )
        for i in range(3)
    ]
    granted = issuer.grant_route("s", 3, Route(stages))
    names = [verifier.signed(stage.grant).next_endpoint for stage in granted.stages]
    assert names == ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7000"]
    usage = issuer.usage_grant("s", "127.0.0.1:7001")
    assert verifier.permits_usage(usage, session_id="s", endpoint="127.0.0.1:7001")
    assert not verifier.permits_usage(usage, session_id="t", endpoint="127.0.0.1:7001")
    assert not verifier.permits_usage(usage, session_id="s", endpoint="127.0.0.1:7002")
    with pytest.raises(GrantDenied, match="another layer range"):
        verifier.verify(
            usage,
            session_id="s",
            epoch=0,
            endpoint="127.0.0.1:7001",
            layers=(2, 4),
            model_sha256="",
            lane_id="",
        )


FIXED = issue(grant(nonce="00" * 16, expires_at=time.time() + 3600), TRACKER)
"""One valid token for every example (Ed25519 signatures are deterministic)."""


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_no_byte_mutation_of_a_valid_grant_is_accepted(data: st.DataObject) -> None:
    token = FIXED
    up = {"started_at": 0.0}  # verifiers of a worker that started before FIXED was issued
    check(GrantVerifier({"k1": TRACKER.public_key()}, **up), token)  # the original is accepted
    verifier = GrantVerifier({"k1": TRACKER.public_key()}, **up)
    mutated = bytearray(token)
    index = data.draw(st.integers(0, len(token) - 1), label="index")
    value = data.draw(st.integers(0, 255).filter(lambda b: b != token[index]), label="byte")
    mutated[index] = value
    with pytest.raises((GrantUnauthenticated, GrantDenied)):
        check(verifier, bytes(mutated))


@pytest.fixture(scope="module")
def worker(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    pem = tmp_path_factory.mktemp("keys") / "tracker.pem"
    pem.write_bytes(public_pem(TRACKER))
    args = [dgr_command(), "worker", "--model", str(tiny_llama), "--layers", "0:4"]
    args += ["--grant-key", f"k1={pem}", "--ctx", "64", "--threads", "1", "--batch", "16"]
    with WorkerProcess.launch(args) as process:
        yield process


@pytest.mark.slow  # starts worker processes
def test_attacks_on_a_worker_with_grants_are_refused_and_a_proper_session_lives_on(
    tiny_llama: Path, worker: WorkerProcess
) -> None:
    with ShardEngine(tiny_llama, **KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        want_prefill = chain.forward(1, 0, PROMPT, 0)[-1]
        want_next = chain.forward(1, 0, [42], len(PROMPT))[-1]

    async def scenario() -> None:
        async with (
            ShardClient(worker.address, timeout=20.0) as tracker_client,
            ShardClient(worker.address, timeout=20.0) as attacker,
        ):
            advert = await tracker_client.describe()
            expect = expectations_of(advert)
            stage = {
                "endpoint": worker.address,
                "layer_begin": 0,
                "layer_end": 4,
                "model_sha256": advert.identity.content_hash.hex(),
                "lane_id": advert.lane.lane_id,
            }

            def token(key: Ed25519PrivateKey = TRACKER, **changes: Any) -> bytes:
                return issue(grant(**{"session_id": "good", **stage, **changes}), key)

            # the proper client: a grant for exactly this session, epoch and stage
            await tracker_client.open("good", 1, expect, grant=token())
            positions = list(range(len(PROMPT)))
            first = await tracker_client.forward("good", 1, 0, expect, positions, tokens=PROMPT)
            assert np.array_equal(np.asarray(first.output)[-1], want_prefill)

            unauthenticated = [
                b"",  # no grant
                forged(token()),  # a forged signature
                token(key=ROTATED),  # signed by a key the worker does not know under k1
                token(key_id="k9"),  # an unknown key id
            ]
            for bad in unauthenticated:
                with pytest.raises(GrantUnauthenticated):
                    await attacker.open("evil", 1, expect, grant=bad)
            denied = [
                token(session_id="other"),  # another session's grant
                token(epoch=2),  # another epoch
                token(endpoint="127.0.0.1:1"),  # another stage
                token(layer_end=2),  # another layer range
                token(model_sha256="00" * 32),  # another model
                token(lane_id="x"),  # another lane
                token(expires_at=time.time() - 1),  # expired
            ]
            for bad in denied:
                with pytest.raises(GrantDenied):
                    await attacker.open("good", 1, expect, grant=bad)  # would discard its KV
            # a replayed grant: a victim's session opened and closed, its grant used again
            victim = token(session_id="victim")
            await tracker_client.open("victim", 1, expect, grant=victim)
            await tracker_client.close("victim", 1)
            with pytest.raises(GrantDenied, match="used before"):
                await attacker.open("victim", 1, expect, grant=victim)
            # frames and closes without the session secret (the attacker never opened "good")
            with pytest.raises(GrantUnauthenticated, match="session secret"):
                await attacker.forward("good", 1, 1, expect, [len(PROMPT)], tokens=[7])
            with pytest.raises(GrantUnauthenticated, match="session secret"):
                await attacker.close("good", 1)
            # the proper session is untouched: its next token's logits are the whole model's
            step = await tracker_client.forward("good", 1, 1, expect, [len(PROMPT)], tokens=[42])
            assert np.array_equal(np.asarray(step.output)[-1], want_next)
            await tracker_client.close("good", 1)

    asyncio.run(scenario())


@pytest.mark.usefixtures("certified_fixtures")
@pytest.mark.slow  # starts worker processes
def test_a_route_session_carries_fresh_grants_across_a_lost_stage(
    tiny_llama: Path, tmp_path: Path
) -> None:
    issuer = GrantIssuer(TRACKER, "k1")
    options = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, 256, size=10)]
    ((want, _),) = whole_model_reference(tiny_llama, [prompt], 10, options)
    layout = [(0, 2), (2, 4)]

    async def scenario(grants: GrantIssuer | None) -> SessionResult:
        provider = LoopbackRouteProvider(
            tiny_llama,
            layout,
            spares=[(2, 4)],
            options=options,
            worker_args=issuer.worker_args(tmp_path),  # every worker checks grants
            grants=grants,
        )
        handles: list[SessionHandle] = []

        def on_token(_token: int) -> None:
            route = handles[0].core.route
            if len(handles[0].tokens) == 4 and route is not None and not provider.reports:
                provider.kill(route.stages[1].endpoint)  # the last stage, mid-decode

        async with provider, GrpcStageTransport(timeout=20.0) as transport:
            policy = FailurePolicy(step_deadline=20.0, max_route_changes=2)
            manager = SessionManager(
                transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
            )
            handles.append(manager.start(prompt, max_new_tokens=10, on_token=on_token))
            result = await handles[0].wait()
            await manager.aclose()
            return result

    granted = asyncio.run(asyncio.wait_for(scenario(issuer), 120))
    assert granted.state is SessionState.DONE, granted.error
    assert list(granted.tokens) == want and granted.epoch == 2  # new epoch, new grants
    refused = asyncio.run(asyncio.wait_for(scenario(None), 120))  # a provider without grants
    assert refused.state is SessionState.FAILED
    assert any("no route grant" in report.detail for report in refused.reports)
