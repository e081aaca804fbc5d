"""DGR-020: the safetensors baseline against whole-model llama.cpp, and the converter-made models
it (and the parity suite) run on.

* :mod:`~dgr_engine.baseline.errors`: typed refusals (bad HF directory, uncovered architecture,
  failed conversion, GGUF metadata that disagrees with the config, extras not installed).
* :mod:`~dgr_engine.baseline.converter`: llama.cpp's own ``convert_hf_to_gguf.py`` at the pinned
  commit, extracted from the verified source archive, run on an HF directory.
* :mod:`~dgr_engine.baseline.gguf_copy`: a GGUF copied with metadata values set (the fixture
  mark; the negative control's changed RoPE base).
* :mod:`~dgr_engine.baseline.tiny_hf`: tiny models made with ``transformers`` from a config and a
  seed (the converter-made fixture family).
* :mod:`~dgr_engine.baseline.compare`: logits and tokens of two implementations, compared.
* :mod:`~dgr_engine.baseline.runs`: one side each (transformers, whole-model llama.cpp) in its own
  process: teacher-forced logits, greedy tokens, speed, peak memory.
* :mod:`~dgr_engine.baseline.runner`: both sides, the DGR-020 record and the gate's verdict.

``torch``/``transformers`` are the optional extra ``dgr[baseline]``; nothing here imports them at
module level.
"""
