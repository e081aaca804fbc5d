"""One side of the baseline each: ``transformers`` on the CPU in float32 from the safetensors
(or from a GGUF, its weights dequantized), or whole-model llama.cpp (``ShardEngine`` over every
layer) from the GGUF.

Both run the same work with the same number of threads: teacher-forced logits at every position
of each prompt (one prefill each), then greedy decoding of ``n_decode`` tokens from each prompt
with a KV cache. Each side runs in its own child process (spawned), so its peak RSS is its own:
the interpreter, the library and the weights (torch alone adds ~300 MiB to the transformers side).
"""

from __future__ import annotations

import pickle
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs
import numpy as np

from dgr_engine.baseline.errors import ArchitectureNotCovered
from dgr_engine.numerics import Numerics

CHILD_TIMEOUT_SECONDS: Final = 1200.0
T = TypeVar("T")


@attrs.frozen
class Work:
    """What both sides run."""

    prompts: tuple[tuple[int, ...], ...]
    n_decode: int
    threads: int


@attrs.frozen
class SideResult:
    """What one side computed and what it cost."""

    logits: tuple[np.ndarray, ...] = attrs.field(eq=False)
    """Per prompt: ``[len(prompt), vocab]`` float32, teacher-forced."""
    tokens: tuple[tuple[int, ...], ...]
    """Per prompt: the greedy continuation."""
    prefill_seconds: float
    decode_seconds: float
    load_seconds: float
    peak_rss_bytes: int

    def prefill_rate(self, work: Work) -> float:
        """Prompt tokens per second."""
        return sum(len(p) for p in work.prompts) / self.prefill_seconds

    def decode_rate(self, work: Work) -> float:
        """Decoded tokens per second (the first token of each prompt comes from its prefill)."""
        return len(work.prompts) * (work.n_decode - 1) / self.decode_seconds


def _peak_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def run_transformers(hf_dir: str, work: Work) -> SideResult:
    """The reference side from safetensors (call it in a child: :func:`in_child`)."""
    import torch
    import transformers

    torch.set_num_threads(work.threads)
    transformers.utils.logging.disable_progress_bar()
    began = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return _transformers_side(model, time.perf_counter() - began, work)


def run_transformers_gguf(gguf: str, work: Work) -> SideResult:
    """The reference side from a GGUF, its weights dequantized to float32 by ``transformers``
    (through the ``gguf`` package) (call it in a child: :func:`in_child`)."""
    import torch
    import transformers

    torch.set_num_threads(work.threads)
    transformers.utils.logging.disable_progress_bar()
    path = Path(gguf)
    began = time.perf_counter()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch.float32,
            attn_implementation="eager",
        ).eval()
    except ValueError as exc:
        if "is not supported" in str(exc):  # transformers' own words for an unknown arch
            raise ArchitectureNotCovered(
                f"transformers cannot load this GGUF: {exc}", path=path
            ) from None
        raise
    return _transformers_side(model, time.perf_counter() - began, work)


def _transformers_side(model: Any, load: float, work: Work) -> SideResult:
    """Warm-up, then teacher-forced logits and greedy decoding of ``work`` with ``model``."""
    import torch

    logits, tokens = [], []
    prefill = decode = 0.0
    with torch.inference_mode():
        warm = model(input_ids=torch.tensor([list(work.prompts[0])]), use_cache=True)
        model(input_ids=warm.logits[:, -1:].argmax(-1), past_key_values=warm.past_key_values)
        for prompt in work.prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            prefill += time.perf_counter() - t0
            logits.append(out.logits[0].float().numpy().copy())
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
            seq = [token]
            t0 = time.perf_counter()
            for _ in range(work.n_decode - 1):
                step = model(
                    input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True
                )
                past, token = step.past_key_values, int(step.logits[0, -1].argmax())
                seq.append(token)
            decode += time.perf_counter() - t0
            tokens.append(tuple(seq))
    return SideResult(tuple(logits), tuple(tokens), prefill, decode, load, _peak_rss())


def run_llama(gguf: str, numerics: Numerics, work: Work) -> SideResult:
    """The whole-model llama.cpp side (call it in a child: :func:`in_child`)."""
    from dgr_engine.engine import ShardEngine

    context = max(len(p) for p in work.prompts) + work.n_decode
    began = time.perf_counter()
    engine = ShardEngine(
        Path(gguf),
        max_sessions=1,
        n_ctx_per_session=context,
        n_threads=work.threads,
        n_batch=max(len(p) for p in work.prompts),
        n_ubatch=max(len(p) for p in work.prompts),
        numerics=numerics,
    )
    load = time.perf_counter() - began
    logits, tokens = [], []
    prefill = decode = 0.0
    try:
        _warm_up(engine, work.prompts[0])
        for index, prompt in enumerate(work.prompts):
            engine.open_session(index, 0)
            n = len(prompt)
            t0 = time.perf_counter()
            rows = engine.forward(
                index,
                0,
                np.arange(n, dtype=np.int32),
                tokens=np.asarray(prompt, dtype=np.int32),
                want=np.ones(n, dtype=np.uint8),
            )
            prefill += time.perf_counter() - t0
            logits.append(np.array(rows, dtype=np.float32))
            token = int(np.argmax(rows[-1]))
            seq = [token]
            t0 = time.perf_counter()
            for pos in range(n, n + work.n_decode - 1):
                out = engine.forward(
                    index,
                    0,
                    np.array([pos], dtype=np.int32),
                    tokens=np.array([token], dtype=np.int32),
                )
                token = int(np.argmax(out[-1]))
                seq.append(token)
            decode += time.perf_counter() - t0
            engine.close_session(index, 0)
            tokens.append(tuple(seq))
    finally:
        engine.close()
    return SideResult(tuple(logits), tuple(tokens), prefill, decode, load, _peak_rss())


def _warm_up(engine: Any, prompt: Sequence[int]) -> None:
    """One untimed prefill and decode step (first-call allocations), as transformers gets."""
    n = len(prompt)
    engine.open_session(1 << 30, 0)
    engine.forward(1 << 30, 0, np.arange(n, dtype=np.int32), tokens=np.asarray(prompt, np.int32))
    engine.forward(1 << 30, 0, np.array([n], np.int32), tokens=np.array([prompt[0]], np.int32))
    engine.close_session(1 << 30, 0)


def _child_main() -> None:
    """Entry of the child: reads ``(function name, args)`` pickled on stdin, writes
    ``(ok, value)`` pickled to the file named by ``argv[1]``."""
    name, args = pickle.load(sys.stdin.buffer)
    try:
        outcome: tuple[bool, Any] = (True, _SIDES[name](*args))
    except Exception as exc:  # noqa: BLE001 - handed to the parent as it is
        outcome = (False, exc)
    Path(sys.argv[1]).write_bytes(pickle.dumps(outcome))


def in_child(fn: Callable[..., T], *args: Any, timeout: float = CHILD_TIMEOUT_SECONDS) -> T:
    """``fn(*args)`` (one of this module's sides) in a child Python process, so its peak RSS is
    its own; its exception re-raised here; bounded by ``timeout``."""
    if _SIDES.get(fn.__name__) is not fn:
        raise ValueError(f"{fn.__name__} is not a baseline side")
    code = "from dgr_engine.baseline import runs; runs._child_main()"
    with tempfile.TemporaryDirectory(prefix="dgr-baseline-") as tmp:
        out = Path(tmp) / "result.pickle"
        try:
            done = subprocess.run(
                [sys.executable, "-c", code, str(out)],
                input=pickle.dumps((fn.__name__, args)),
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{fn.__name__} ran past {timeout:g} s") from None
        if not out.is_file():
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(
                f"{fn.__name__} died (exit code {done.returncode}) with no result: "
                f"{tail[0] if tail else 'no output'}"
            )
        ok, value = pickle.loads(out.read_bytes())
    if not ok:
        raise value
    return value


_SIDES: Final[dict[str, Callable[..., SideResult]]] = {
    "run_transformers": run_transformers,
    "run_transformers_gguf": run_transformers_gguf,
    "run_llama": run_llama,
}
