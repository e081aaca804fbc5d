"""llama.cpp's own converter (``convert_hf_to_gguf.py``) at the pinned commit, run on an HF
directory.

The converter is never vendored: its tree is extracted from the same verified source archive the
build uses (``native/llama.cpp.manifest.json``, sha256-checked by ``native/build_llama.py``) into
``<cache>/converter/<commit12>/`` once, and run there in a child process with this Python (it
imports the ``gguf`` package of its own tree, not dgr's). Conversion writes to a temporary file
renamed into place, so a failed or interrupted conversion leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from loguru import logger

from dgr_engine.atomic import replacing
from dgr_engine.baseline.errors import (
    ArchitectureNotCovered,
    BaselineError,
    ConversionFailed,
    HfModelInvalid,
)
from dgr_engine.tooling.llama_build import CHECKOUT, CheckoutMissing, build_module

CONVERTER_TIMEOUT_SECONDS: Final = 900.0
OUTTYPES: Final = ("f32", "f16", "bf16", "q8_0")
"""Tensor types the converter is asked for (``--outtype``)."""

COVERED: Final[Mapping[str, str]] = {
    "LlamaForCausalLM": "llama",
    "DeepseekV4ForCausalLM": "deepseek4",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}
"""HF architectures dgr runs (the range-ownership patches cover their GGUF architectures)."""

Log = Callable[[str], None]


def converter_tree(log: Log = lambda _text: None) -> Path:
    """The pinned llama.cpp tree holding ``convert_hf_to_gguf.py`` (extracted on first use)."""
    try:
        build = build_module()
    except CheckoutMissing as exc:
        raise BaselineError(str(exc)) from None
    paths = build.BuildPaths.default(repo_root=CHECKOUT)
    manifest = build.parse_manifest(paths.manifest.read_bytes())
    commit = manifest["upstream"]["commit"]
    tree = paths.cache_dir / "converter" / commit[:12]
    script = tree / "convert_hf_to_gguf.py"
    if script.is_file():
        return tree
    tree.parent.mkdir(parents=True, exist_ok=True)
    with build.file_lock(tree.parent / ".extract.lock", log):
        if not script.is_file():
            src, archive = build.fetch_source(manifest, paths.downloads, log)
            count = build.extract_source(archive, src["inner_path"], tree)
            log(f"converter: extracted llama.cpp {commit[:12]} ({count} files) into {tree}")
    return tree


def read_config(hf_dir: Path) -> dict[str, Any]:
    """The HF directory's ``config.json``; :class:`HfModelInvalid` when the directory lacks it
    or its weights, or the config is not a JSON object."""
    if not hf_dir.is_dir():
        raise HfModelInvalid("not a directory", path=hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise HfModelInvalid("no config.json: not a Hugging Face model directory", path=hf_dir)
    weights = sorted(hf_dir.glob("*.safetensors")) + sorted(hf_dir.glob("pytorch_model*.bin"))
    if not weights:
        raise HfModelInvalid("no weights (*.safetensors or pytorch_model*.bin)", path=hf_dir)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HfModelInvalid(f"config.json is not readable JSON: {exc}", path=hf_dir) from None
    if not isinstance(config, dict):
        raise HfModelInvalid("config.json is not a JSON object", path=hf_dir)
    return config


def covered_arch(config: Mapping[str, Any], *, path: Path | None = None) -> str:
    """The GGUF architecture dgr runs the config's model as; :class:`ArchitectureNotCovered`
    when it runs none."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ArchitectureNotCovered("config.json names no architectures", path=path)
    for arch in archs:
        if arch in COVERED:
            return COVERED[arch]
    raise ArchitectureNotCovered(
        f"architecture {', '.join(map(str, archs))} is not covered: dgr runs "
        f"{', '.join(COVERED)} (GGUF {', '.join(sorted(set(COVERED.values())))})",
        path=path,
    )


def convert(
    hf_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    outtype: str = "f32",
    model_name: str | None = None,
    log: Log = lambda _text: None,
    timeout: float = CONVERTER_TIMEOUT_SECONDS,
) -> float:
    """Converts ``hf_dir`` to the GGUF ``out`` with the pinned converter; returns its seconds.

    Refuses before converting a directory without config or weights and an architecture dgr
    does not cover; :class:`ConversionFailed` carries the converter's last error line."""
    hf_dir, out = Path(hf_dir), Path(out)
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {', '.join(OUTTYPES)}; got {outtype!r}")
    config = read_config(hf_dir)
    covered_arch(config, path=hf_dir)
    script = converter_tree(log) / "convert_hf_to_gguf.py"
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    started = time.perf_counter()
    with replacing(out) as tmp:
        cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(tmp)]
        cmd += ["--outtype", outtype] + (["--model-name", model_name] if model_name else [])
        try:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise ConversionFailed(f"the converter ran past {timeout:g} s", path=hf_dir) from None
        if done.returncode != 0:
            raise ConversionFailed(
                f"llama.cpp's converter failed (exit {done.returncode}): "
                f"{_last_error(done.stderr or done.stdout)}{_step_hint(config)}",
                path=hf_dir,
            )
    seconds = time.perf_counter() - started
    logger.bind(model=str(hf_dir)).debug("converted to {} in {:.1f} s", out, seconds)
    return seconds


def _step_hint(config: dict[str, Any]) -> str:
    """What to do when the converter refused a DeepSeek V4 saved by ``transformers`` (its
    config lacks keys the release config has): dgr's pre-conversion step."""
    if config.get("model_type") == "deepseek_v4" and "num_hash_layers" not in config:
        return (
            "; a DeepSeek V4 saved by transformers converts after dgr's pre-conversion step: "
            "dgr_engine.baseline.v4_save.prepare(SAVED, OUT), then convert OUT "
            "(docs/v4-from-transformers.md)"
        )
    return ""


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("ERROR") or "Error" in line.split(":", 1)[0]:
            return line
    return lines[-1] if lines else "no output"
