"""The README's example as a file: a route of three in-process shard engines against the whole
model, then a route change.

Run from anywhere with the project's interpreter: ``.venv/bin/python examples/in_process_route.py``.
The block between the ``readme`` markers is the README's snippet, word for word (a test keeps
them equal); what is outside the markers only sets up and cleans up.

- ``resolve_model("smollm2-135m-instruct")`` is the real model of dgr's catalog
  (SmolLM2-135M-Instruct Q4_1, 30 layers), fetched once through ``dgr models`` and verified
  against dgr's manifest; the prompt goes through the model's own chat template.
- Each ``ShardEngine(path, layers=(a, b))`` loads only layers ``[a, b)`` (plus the token
  embedding on the first stage and the output head on the last); ``InProcessRoute`` relays token
  ids into stage 0, boundary rows between stages and logits out of the last one.
- The route's tokens and logits equal the whole model's, bit for bit on CPU.
- ``route.open(1, epoch=1)`` is a route change: a new epoch discards the old one's KV (a cache
  miss), so the session re-prefills the prompt and replays the tokens it already accepted
  (``accepted=``, never resampled) before decoding on.
"""

from __future__ import annotations

# --- readme:begin ---
from dgr_engine import ShardEngine, Tokenizer
from dgr_engine.client.text import prompt_ids
from dgr_engine.models import resolve_model
from dgr_engine.reference import InProcessRoute

path = resolve_model("smollm2-135m-instruct")  # a real GGUF: fetched once, verified
stages = [ShardEngine(path, layers=r) for r in [(0, 10), (10, 20), (20, 30)]]
route, whole = InProcessRoute(stages), InProcessRoute([ShardEngine(path)])
tokenizer = Tokenizer(path)
prompt = prompt_ids(tokenizer, "What is the capital of France?", chat=True)
for chain in (route, whole):
    chain.open(session_id=1, epoch=0)
tokens, logits = route.greedy(1, 0, prompt, n_steps=7)
ref_tokens, ref_logits = whole.greedy(1, 0, prompt, n_steps=7)
assert tokens == ref_tokens  # and every logit, bit for bit
print(tokenizer.decode(tokens))  # The capital of France is Paris.
# --- readme:end ---

route.open(1, epoch=1)  # route change: cache miss, empty KV
again, _ = route.greedy(1, 1, prompt, 3, accepted=tokens[:4])
assert tokens[:4] + again == ref_tokens

try:
    # "and every logit, bit for bit": the snippet's comment, checked here.
    assert len(logits) == len(ref_logits)
    for mine, theirs in zip(logits, ref_logits, strict=True):
        assert mine.tobytes() == theirs.tobytes()
    print(f"route {[e.info.layers for e in route.engines]} == whole model: {tokens}")
    print(f"after the route change (epoch 1): {again} == the whole model's last 3 tokens")
finally:
    # Engines hold native memory: close them explicitly (``with ShardEngine(...)`` works too).
    # Closing an engine drops the sessions it still holds.
    for engine in [*route.engines, *whole.engines]:
        engine.close()
    tokenizer.close()
print("in_process_route: OK")
