"""The main job, as far as it exists: a route of shard engines on a generated fixture model,
a stage lost mid-decode and recovered under a new epoch, output equal to the whole model.

Stages are in-process ``ShardEngine``s for now (gRPC worker processes come with the worker
issue). Every figure printed is fixture evidence on this machine, not real-model evidence.

    python -m dgr_engine.demo [--fixture tiny-llama] [--stages 3] [--sessions 3] [--steps 24]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from dgr_engine.chain import LocalChain, split_points
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import EngineClosed
from dgr_engine.fixtures import ensure_fixture

ENGINE_KW: dict[str, Any] = {
    "max_sessions": 8,
    "n_ctx_per_session": 256,
    "n_threads": 2,
    "n_batch": 64,
}


def prompts(n_sessions: int, n_vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(0, n_vocab, size=12)] for _ in range(n_sessions)]


def whole_model_tokens(path: Path, prompt: list[int], n_steps: int) -> list[int]:
    with ShardEngine(path, **ENGINE_KW) as whole:
        chain = LocalChain([whole])
        chain.open(0, 0)
        tokens, _ = chain.greedy(0, 0, prompt, n_steps)
    return tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default="tiny-llama")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--lose-stage", type=int, default=1, help="stage index lost mid-decode")
    parser.add_argument("--lose-at", type=int, default=8, help="decode step at which it is lost")
    args = parser.parse_args(argv)

    path = ensure_fixture(args.fixture)
    print(f"model     {path.name} (generated fixture: fixture evidence only)")
    with ShardEngine(path, layers=(0, 1), **ENGINE_KW) as probe:
        n_layer = probe.info.n_layer
    ranges = split_points(n_layer, args.stages)
    engines = [ShardEngine(path, layers=r, **ENGINE_KW) for r in ranges]
    info = engines[0].info
    print(f"route     {' -> '.join(f'[{a},{b})' for a, b in ranges)}  ({args.stages} stages)")
    all_prompts = prompts(args.sessions, info.n_vocab)
    expected = [whole_model_tokens(path, p, args.steps) for p in all_prompts]

    epoch = 0
    chain = LocalChain(engines)
    histories = [list(p) for p in all_prompts]
    generated: list[list[int]] = [[] for _ in all_prompts]
    last_logits: list[np.ndarray] = []
    for sid, prompt in enumerate(all_prompts):
        chain.open(sid, epoch)
        last_logits.append(chain.forward(sid, epoch, prompt, 0)[-1])
    t0 = time.perf_counter()
    seam_bytes = 0
    recovered = False
    step = 0
    while step < args.steps:
        if step == args.lose_at and not recovered:
            lost = engines[args.lose_stage]
            print(
                f"step {step:>3}  stage {args.lose_stage} {lost.info.layers} lost (engine closed)"
            )
            lost.close()
        try:
            for sid in range(len(all_prompts)):
                token = int(np.argmax(last_logits[sid]))
                out = chain.forward(sid, epoch, [token], len(histories[sid]))
                histories[sid].append(token)
                generated[sid].append(token)
                last_logits[sid] = out[-1]
                seam_bytes += sum(e.info.out_width * 4 for e in engines[:-1])
            step += 1
        except EngineClosed:
            # route change: a replacement stage for the lost range, a new epoch, a cache miss
            # and a replay of prompt + accepted tokens; nothing migrates between stages
            epoch += 1
            engines[args.lose_stage] = ShardEngine(
                path, layers=ranges[args.lose_stage], **ENGINE_KW
            )
            chain = LocalChain(engines)
            print(f"step {step:>3}  replacement stage for {ranges[args.lose_stage]}: epoch {epoch}")
            for sid, prompt in enumerate(all_prompts):
                accepted = generated[sid][: len(histories[sid]) - len(prompt)]
                chain.open(sid, epoch)
                _, logits = chain.greedy(sid, epoch, prompt, 0, accepted=accepted)
                last_logits[sid] = logits[-1][-1]
                print(
                    f"          session {sid}: re-prefilled {len(prompt)} + {len(accepted)} tokens"
                )
            recovered = True
    elapsed = time.perf_counter() - t0

    ok = True
    for sid, (got, want) in enumerate(zip(generated, expected, strict=True)):
        same = got == want
        ok &= same
        print(f"session {sid}  epoch {epoch}  tokens {got[:12]}...  whole-model equal: {same}")
    print()
    print(
        f"{'stage':>5}  {'layers':>8}  {'rows':>6}  {'calls':>6}  {'ms/call':>8}  {'weights':>10}"
    )
    for i, e in enumerate(engines):
        s = e.stats()
        per_call = 1000 * s.forward_seconds / max(1, s.forward_calls)
        print(
            f"{i:>5}  {str(e.info.layers):>8}  {s.rows_forwarded:>6}  {s.forward_calls:>6}  "
            f"{per_call:>8.3f}  {s.weight_bytes:>10,}"
        )
    print(f"seam bytes {seam_bytes:,} over {args.steps} decode steps; wall {elapsed:.3f}s")
    for e in engines:
        e.close()
    print("PARITY OK" if ok else "PARITY FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
