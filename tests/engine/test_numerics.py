"""KV cache type and flash-attention mode: through the C ABI, the engine, the options, the worker's
advert and lane; splits stay bit-identical to the whole model at every setting."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine._binding import ffi, lib
from dgr_engine.errors import InvalidArgument
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.numerics import EXACT, FLASH_ATTN_MODES, KV_TYPES, Numerics
from dgr_engine.options import EngineOptions
from dgr_engine.reference import InProcessRoute
from dgr_engine.wire import advert as wire_advert
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker import ShardWorker

PROMPT = [int(t) for t in (np.arange(12) * 37 + 11) % 256]
N_DECODE = 6
KW = {"max_sessions": 1, "n_ctx_per_session": 64, "n_threads": 2, "n_batch": 32}


def greedy(path: Path, cuts: tuple[int, ...], numerics: Numerics) -> tuple[list[int], list]:
    ranges = list(zip(cuts[:-1], cuts[1:], strict=True))
    engines = [ShardEngine(path, layers=r, numerics=numerics, **KW) for r in ranges]
    try:
        chain = InProcessRoute(engines)
        chain.open(1, 0)
        return chain.greedy(1, 0, PROMPT, N_DECODE)
    finally:
        for engine in engines:
            engine.close()


def test_numerics_are_validated_and_default_to_llama_cpps() -> None:
    assert Numerics() == Numerics("f16", "auto")
    assert (KV_TYPES[0], FLASH_ATTN_MODES[0]) == ("f16", "auto")
    assert EXACT.exact and not Numerics().exact
    with pytest.raises(InvalidArgument, match="kv_type must be one of f16, f32, q8_0; got 'bf16'"):
        Numerics(kv_type="bf16")
    with pytest.raises(ValueError, match="flash_attn must be one of auto, off, on"):
        Numerics(flash_attn="yes")
    assert str(EXACT) == "kv f32, flash attention off"


@pytest.mark.parametrize(
    ("fixture", "kv", "fa"),
    [
        ("tiny-llama", "f16", "auto"),
        ("tiny-llama", "f32", "off"),
        ("tiny-llama", "f32", "on"),
        ("tiny-v4", "f16", "off"),
        ("tiny-v4", "f32", "off"),
        ("tiny-v4", "q8_0", "on"),
    ],
)
def test_splits_equal_the_whole_at_every_setting(fixture: str, kv: str, fa: str) -> None:
    path = ensure_fixture(fixture)
    numerics = Numerics(kv, fa)
    n_layer = 4 if fixture == "tiny-llama" else 6
    tokens, logits = greedy(path, (0, n_layer), numerics)
    for cuts in [(0, 1, n_layer), (0, 2, 3, n_layer)]:
        split_tokens, split_logits = greedy(path, cuts, numerics)
        assert split_tokens == tokens
        assert all(np.array_equal(a, b) for a, b in zip(logits, split_logits, strict=True))


def test_the_settings_reach_the_engine(tiny_llama: Path) -> None:
    # f32 KV takes twice the bytes of f16; the exact setting computes other bits than the default
    sizes = {}
    for kv in ("f16", "f32"):
        with ShardEngine(tiny_llama, numerics=Numerics(kv, "off"), **KW) as engine:
            sizes[kv] = engine.stats().kv_bytes
            assert engine.numerics == Numerics(kv, "off")
    assert sizes["f32"] == 2 * sizes["f16"] > 0
    _, default = greedy(tiny_llama, (0, 4), Numerics())
    _, exact = greedy(tiny_llama, (0, 4), EXACT)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(default, exact, strict=True))
    assert 0 < diff < 0.1


def test_a_quantized_kv_cache_without_flash_attention_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(InvalidArgument, match="q8_0 KV cache needs flash attention"):
        ShardEngine(tiny_llama, numerics=Numerics("q8_0", "off"), **KW)


def test_the_c_abi_refuses_unknown_values_and_a_kv_overflow(tiny_llama: Path) -> None:
    path = ffi.new("char[]", str(tiny_llama).encode())
    for field, value, text in [
        ("kv_type", 7, b"kv_type 7 is not a dgr_kv_type"),
        ("flash_attn", -1, b"flash_attn -1 is not a dgr_flash_attn"),
        ("max_sessions", 256, b"KV cells is more than"),
    ]:
        params = lib.dgr_engine_default_params()
        params.model_path = path
        setattr(params, field, value)
        if field == "max_sessions":
            params.n_ctx_per_session = 1 << 24
        out = ffi.new("dgr_engine **")
        assert lib.dgr_engine_open(ffi.addressof(params), out) == lib.DGR_E_INVALID_ARGUMENT
        assert out[0] == ffi.NULL
        assert text in ffi.string(lib.dgr_last_error())
    defaults = lib.dgr_engine_default_params()
    assert (defaults.kv_type, defaults.flash_attn) == (lib.DGR_KV_F16, lib.DGR_FLASH_ATTN_AUTO)


def test_engine_options_carry_the_numerics_to_the_engine_and_the_worker_command() -> None:
    options = EngineOptions(kv_type="f32", flash_attn="off")
    assert options.numerics == EXACT
    assert options.engine_kwargs()["numerics"] == EXACT
    argv = options.worker_argv()
    assert argv[argv.index("--kv-type") + 1] == "f32"
    assert argv[argv.index("--flash-attn") + 1] == "off"
    parser = argparse.ArgumentParser()
    EngineOptions.add_arguments(parser)
    assert EngineOptions.from_args(parser.parse_args(argv)) == options
    assert EngineOptions.from_args(parser.parse_args([])).numerics == Numerics()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-type", "bf16"])
    with pytest.raises(InvalidArgument):
        EngineOptions(flash_attn="sometimes")


def test_the_advert_and_the_lane_state_the_numerics(tiny_llama: Path) -> None:
    lanes = {}
    for numerics in (Numerics(), EXACT):
        worker = ShardWorker.load(tiny_llama, (0, 2), numerics=numerics, **KW)
        try:
            advert = worker.advert()
            assert (advert.recipe.kv_type, advert.recipe.flash_attn) == (
                numerics.kv_type,
                numerics.flash_attn,
            )
            assert (worker.lane_key.kv_type, worker.lane_key.flash_attn) == (
                numerics.kv_type,
                numerics.flash_attn,
            )
            back = wire_advert.advert_from_proto(wire_advert.advert_to_proto(advert))
            assert back.recipe == advert.recipe
            lanes[numerics] = worker.lane_key
        finally:
            worker.engine.close()
    assert lanes[Numerics()].differences(lanes[EXACT]) == ["kv_type", "flash_attn"]


def test_an_advert_without_the_field_reads_as_llama_cpps_default(tiny_llama: Path) -> None:
    worker = ShardWorker.load(tiny_llama, (0, 2), **KW)
    try:
        message = wire_advert.advert_to_proto(worker.advert())
    finally:
        worker.engine.close()
    message.compatibility.ClearField("flash_attn")
    old = pb.Advert.FromString(message.SerializeToString())
    assert wire_advert.advert_from_proto(old).recipe.flash_attn == "auto"
