"""A deterministic stand-in for a layered model, for the sans-I/O core's tests.

Each layer keeps a running digest per session (its "KV"), so outputs depend on the whole history,
on positions continuing exactly and on every layer seeing every token once; cut points do not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from dgr_session.sampling import greedy

_MASK = (1 << 61) - 1


def _mix(*parts: int) -> int:
    # Hashes of int tuples are deterministic across processes (no hash randomisation for ints).
    return hash(parts) & _MASK


@attrs.frozen
class FakeModel:
    """A deterministic layered "model" with per-layer state, vocabulary ``vocab``."""

    n_layer: int = 6
    """Number of layers."""
    vocab: int = 32
    """Vocabulary size (length of the logits)."""
    width: int = 16
    """Boundary width advertised by stages (the rows themselves are ints, one per token)."""
    hash_layers: int = 2
    """Layers below this index also read the token id (like V4's hash-routed layers), so later
    stages holding them need the token-id sideband."""

    def embed(self, token: int) -> int:
        """Input of layer 0 for ``token``."""
        return _mix(-1, token)

    def seed(self, layer: int) -> int:
        """A layer's state before any position."""
        return _mix(-2, layer)

    def layer(self, layer: int, state: int, x: int, position: int, token: int) -> tuple[int, int]:
        """One layer at one position: ``(new state, output)``."""
        if layer < self.hash_layers:
            state = _mix(layer, state, x, position, token)
        else:
            state = _mix(layer, state, x, position)
        return state, _mix(layer, state)

    def logits(self, x: int) -> list[float]:
        """Logits from the last layer's output."""
        return [float(_mix(x, i) % 1_000_003) for i in range(self.vocab)]

    def reference(
        self, prompt: Sequence[int], max_new_tokens: int, stop_tokens: Iterable[int] = ()
    ) -> tuple[int, ...]:
        """Fault-free whole-model greedy generation (the oracle)."""
        stops = frozenset(stop_tokens)
        states = [self.seed(layer) for layer in range(self.n_layer)]
        history = list(prompt)
        out: list[int] = []
        fed = 0
        while True:
            x = 0
            for position in range(fed, len(history)):
                token = history[position]
                x = self.embed(token)
                for layer in range(self.n_layer):
                    states[layer], x = self.layer(layer, states[layer], x, position, token)
            fed = len(history)
            token = greedy(self.logits(x), 0)
            out.append(token)
            history.append(token)
            if token in stops or len(out) >= max_new_tokens:
                return tuple(out)
