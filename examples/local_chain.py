"""The README's example as a file: a route of three in-process shard engines against the whole
model, then a route change.

Run from anywhere with the project's interpreter: ``.venv/bin/python examples/local_chain.py``.
The block between the ``readme`` markers is the README's snippet, word for word (a test keeps
them equal); what is outside the markers only sets up and cleans up.

- ``ensure_fixture("tiny-llama")`` builds (once, cached) a generated 4-layer GGUF with random
  weights: fixture evidence, never real-model evidence.
- Each ``ShardEngine(path, layers=(a, b))`` loads only layers ``[a, b)`` (plus the token
  embedding on the first stage and the output head on the last); ``LocalChain`` relays token
  ids into stage 0, boundary rows between stages and logits out of the last one.
- The route's tokens and logits equal the whole model's, bit for bit on CPU.
- ``route.open(1, epoch=1)`` is a route change: a new epoch discards the old one's KV (a cache
  miss), so the session re-prefills the prompt and replays the tokens it already accepted
  (``accepted=``, never resampled) before decoding on.
"""

from __future__ import annotations

# --- readme:begin ---
from dgr_engine import ShardEngine
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.reference import LocalChain

path = ensure_fixture("tiny-llama")  # 4 layers, n_embd 64, random weights
stages = [ShardEngine(path, layers=r) for r in [(0, 1), (1, 3), (3, 4)]]
route, whole = LocalChain(stages), LocalChain([ShardEngine(path)])
for chain in (route, whole):
    chain.open(session_id=1, epoch=0)
tokens, logits = route.greedy(1, 0, prompt=[1, 2, 3, 4], n_steps=16)
ref_tokens, ref_logits = whole.greedy(1, 0, prompt=[1, 2, 3, 4], n_steps=16)
assert tokens == ref_tokens  # and every logit, bit for bit
route.open(1, epoch=1)  # route change: cache miss, empty KV
again, _ = route.greedy(1, 1, [1, 2, 3, 4], 8, accepted=tokens[:8])
assert tokens[:8] + again == ref_tokens
# --- readme:end ---

try:
    # "and every logit, bit for bit": the snippet's comment, checked here.
    assert len(logits) == len(ref_logits)
    for mine, theirs in zip(logits, ref_logits, strict=True):
        assert mine.tobytes() == theirs.tobytes()
    print(f"route {[e.info.layers for e in route.engines]} == whole model: {tokens}")
    print(f"after the route change (epoch 1): {again} == the whole model's last 8 tokens")
finally:
    # Engines hold native memory: close them explicitly (``with ShardEngine(...)`` works too).
    # Closing an engine drops the sessions it still holds.
    for engine in [*route.engines, *whole.engines]:
        engine.close()
print("local_chain: OK")
