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
* :mod:`~dgr_engine.baseline.tiny_v4`: the tiny DeepSeek V4 made with ``transformers`` (experts
  on the MXFP4 grid, GPT-2's tokenizer from the pinned tree).
* :mod:`~dgr_engine.baseline.v4_save`: the pre-conversion step that rewrites ``transformers``'
  V4 save in the release layout the converter reads; :mod:`~dgr_engine.baseline.mxfp4`: MXFP4
  in the release layout and in ggml's blocks.
* :mod:`~dgr_engine.baseline.compare`: logits and tokens of two implementations, compared.
* :mod:`~dgr_engine.baseline.runs`: one side each (transformers, whole-model llama.cpp) in its own
  process: teacher-forced logits, greedy tokens, speed, peak memory.
* :mod:`~dgr_engine.baseline.runner`: both sides, the DGR-020 record and the gate's verdict.

``torch``/``transformers`` are the optional extra ``dgr[baseline]``; nothing here imports them at
module level.
"""
