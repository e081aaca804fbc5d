"""benchmarks/peers.py and benchmarks/peer_build.py: the parsing and the RPC split arithmetic,
then the real thing end to end at the smallest scale (the peers built from the pinned source,
cached; tiny-llama, one round), run by benchmarks/targets.py beside benchmarks/chain.py and
benchmarks/control_plane.py, with issue 15's table of every target."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from benchmarks import concurrent_route, targets
from dgr_engine.reference import split_points
from dgr_engine.tooling import peer_build
from dgr_engine.tooling import rpc_peer as peers
from dgr_engine.tooling.llama_build import build_module

REPO = Path(__file__).resolve().parents[2]

# llama-bench -o json at the pinned commit (fields abridged; order as it writes them)
BENCH_JSON = """
[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU,RPC",
    "model_filename": "mid-llama.gguf",
    "n_batch": 128,
    "n_ubatch": 128,
    "n_threads": 1,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 13,
    "flash_attn": -1,
    "tensor_split": "0.00",
    "n_prompt": 128,
    "n_gen": 0,
    "n_depth": 0,
    "avg_ns": 640000000,
    "avg_ts": 200.000000,
    "stddev_ts": 0.000000
  },
  {
    "build_commit": "0c1e570",
    "backends": "CPU,RPC",
    "n_threads": 1,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 13,
    "flash_attn": -1,
    "tensor_split": "0.00",
    "n_prompt": 0,
    "n_gen": 64,
    "n_depth": 128,
    "avg_ts": 61.5
  }
]
"""


def test_parse_llama_bench_reads_every_test() -> None:
    results = peers.parse_llama_bench("warming up [1/2]\n" + BENCH_JSON)
    assert len(results) == 2
    pp = peers.pick(results, 128, 0, 0)
    tg = peers.pick(results, 0, 64, 128)
    assert (pp.avg_ts, tg.avg_ts) == (200.0, 61.5)
    assert (tg.n_threads, tg.type_k, tg.type_v, tg.flash_attn) == (1, "f16", "f16", -1)
    assert (tg.n_gpu_layers, tg.backends) == (13, "CPU,RPC")
    with pytest.raises(LookupError):
        peers.pick(results, 0, 64, 0)


def test_parse_llama_bench_refuses_what_is_not_its_json() -> None:
    with pytest.raises(ValueError, match="no llama-bench JSON"):
        peers.parse_llama_bench("error: failed to load model\n")
    with pytest.raises(ValueError, match="lacks a field"):
        peers.parse_llama_bench('[{"n_prompt": 1}]')


def test_flash_attn_values_as_llama_bench_writes_them() -> None:
    item = json.loads(BENCH_JSON)[1]
    for written, code in ((-1, -1), (0, 0), (1, 1), (True, 1), (False, 0), ("auto", -1)):
        assert peers.BenchResult.from_json({**item, "flash_attn": written}).flash_attn == code


def test_parse_batched_bench_jsonl() -> None:
    line = (
        '{"n_kv_max": 1600, "n_batch": 128, "n_ubatch": 128, "flash_attn": -1, '
        '"is_pp_shared": 0, "n_gpu_layers": 0, "n_threads": 1, "n_threads_batch": 1, "pp": 128, '
        '"tg": 64, "pl": %d, "n_kv": 1536, "t_pp": 1.0, "speed_pp": 100.0, "t_tg": 2.0, '
        '"speed_tg": %f, "t": 3.0, "speed": 80.0}'
    )
    text = "main: log line\n" + "\n".join(line % (n, 10.0 * n) for n in (1, 4, 8))
    rows = peers.parse_batched_bench(text)
    assert sorted(rows) == [1, 4, 8]
    assert rows[8]["speed_tg"] == 80.0
    with pytest.raises(ValueError):
        peers.parse_batched_bench("|    PP |     TG |    B |\n")


def test_resolved_flash_attn_from_llama_logs() -> None:
    assert peers.resolved_flash_attn("resolve_fused_ops: Flash Attention enabled\n") == "on"
    off = "resolve_fused_ops: Flash Attention not supported, set to disabled\n"
    assert peers.resolved_flash_attn(off) == "off"
    assert peers.resolved_flash_attn("nothing said\n") is None


def test_rpc_split_of_24_layers() -> None:
    # the example: -ngl 13 puts layers 12-23 and the output layer on the one server
    assert peers.rpc_split(24, 2) == (13, [])
    ngl, weights = peers.rpc_split(24, 4)
    assert ngl == 19
    assert peers.ts_arg(weights) == "5.5/6/7.5"
    assignment = peers.rpc_assignment(24, ngl, weights, 3)
    assert assignment == [-1] * 6 + [0] * 6 + [1] * 6 + [2] * 6 + [2]


def test_rpc_split_matches_dgr_layout_everywhere() -> None:
    for n_layer in range(2, 65):
        for stages in range(2, min(n_layer, 8) + 1):
            ngl, weights = peers.rpc_split(n_layer, stages)
            want = [
                d - 1
                for d, (lo, hi) in enumerate(split_points(n_layer, stages))
                for _ in range(lo, hi)
            ]
            want.append(stages - 2)  # the output layer goes with the last server
            got = peers.rpc_assignment(n_layer, ngl, weights, stages - 1)
            assert got == want, (n_layer, stages, ngl, weights)


def test_even_tensor_split_would_not_match() -> None:
    # why -ts is not 1/1/1: the output layer counts, so the first server would get 7 layers
    assert peers.rpc_assignment(24, 19, [1, 1, 1], 3)[6:13] == [0] * 7


def test_aggregate_tps() -> None:
    # two sessions of 5 tokens each, 1 s apart, overlapping in (1, 4]
    stamps = [[0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0]]
    assert concurrent_route.aggregate_tps(stamps) == pytest.approx(6 / 3)
    assert concurrent_route.aggregate_tps([[0.0, 0.5, 1.0]]) == pytest.approx(2.0)
    # barely overlapping: every token after each first over the whole span
    assert concurrent_route.aggregate_tps([[0.0, 1.0], [1.0, 2.0]]) == pytest.approx(2 / 2)


def test_peer_key_follows_the_options_and_the_peer_patches() -> None:
    options = {"GGML_RPC": "ON"}
    PatchFile = build_module().PatchFile  # noqa: N806 (the build script's own class)
    fix = PatchFile("0001-fix.patch", b"diff")
    key = peer_build.peer_key("a" * 64, options, [fix])
    assert key == peer_build.peer_key("a" * 64, dict(options), [PatchFile(fix.name, b"diff")])
    assert key != peer_build.peer_key("b" * 64, options, [fix])
    assert key != peer_build.peer_key("a" * 64, {"GGML_RPC": "OFF"}, [fix])
    assert key != peer_build.peer_key("a" * 64, options, [])
    assert key != peer_build.peer_key("a" * 64, options, [PatchFile(fix.name, b"diff 2")])


def test_the_peer_patches_apply_after_the_main_stack_and_only_to_the_peers() -> None:
    # patches/peers/ is not part of the engine's stack (so no lane changes with it), and every
    # one of its patches is named, described and applied after the main stack in the peers' copy
    build = build_module()
    paths = build.BuildPaths.default(repo_root=REPO)
    main = [p.name for p in build.read_patches(paths.patches_dir)]
    peers = build.read_patches(paths.patches_dir / peer_build.PEER_PATCHES_DIR)
    assert [p.name for p in peers] == ["0001-batched-bench-drain-log-at-exit.patch"]
    assert not set(main) & {p.name for p in peers}
    assert all(p.header and "Why:" in "\n".join(p.header) for p in peers)
    *_, applied, _main_key, _options, _key = peer_build._inputs(build)
    assert [p.name for p in applied] == main + [p.name for p in peers]


@pytest.mark.slow
def test_peers_benchmark_end_to_end(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the committed records are reused; a lane certified here lands in tmp, not in evidence/
    evidence = tmp_path / "evidence"
    shutil.copytree(REPO / "evidence", evidence)
    monkeypatch.setenv("DGR_EVIDENCE_DIR", str(evidence))
    prefix = peer_build.ensure_peers(log=lambda _m: None)
    for name in peer_build.TARGETS:
        assert (prefix / "bin" / name).is_file()
    argv = ["--fixture", "tiny-llama", "--repeats", "1", "--out", str(tmp_path / "out")]
    argv += ["--peers", "--prompt 16 --decode 8 --stages 2 --sessions 1 4 8 --accepted 8"]
    argv += ["--chain", "--rtts 0,30 --stages 4 --tokens 8 --prompt 8"]
    argv += ["--control-plane", "--sessions 300"]
    assert targets.main(argv) == 0  # chain's tokens were exact
    out = capfd.readouterr().out  # the benchmarks run in processes of their own
    result = json.loads((tmp_path / "out" / "peers.json").read_text())
    assert (tmp_path / "out" / "peers.png").read_bytes().startswith(b"\x89PNG")

    names = [row["name"] for row in result["table"]]
    variants = [v["name"] for v in result["settings"]["variants"]]
    want = [
        "decode tok/s, whole model",
        "decode tok/s, 2 stages (ratio to whole)",
        "decode tok/s, 2 stages [ring-grpc] (ratio to whole)",
        "decode tok/s, 2 stages [ring] (ratio to whole)",
        "decode tok/s, 2 stages [ring-native] (ratio to whole)",
        "prefill 16 tok/s, whole model",
        "prefill 16 tok/s, 2 stages (ratio to whole)",
        "prefill 16 tok/s, 2 stages [ring-grpc] (ratio to whole)",
        "prefill 16 tok/s, 2 stages [ring] (ratio to whole)",
        "prefill 16 tok/s, 2 stages [ring-native] (ratio to whole)",
        "sampled decode tok/s, 2 stages [ring-native, the default path]",
        "sampled decode tok/s, 2 stages, against greedy [ring-native]",
        "time to first token, prompt 16 (s), whole model",
        "time to first token, prompt 16 (s), 2 stages",
        "time to first token, prompt 16 (s), 2 stages [ring-grpc]",
        "time to first token, prompt 16 (s), 2 stages [ring]",
        "time to first token, prompt 16 (s), 2 stages [ring-native]",
    ]
    for variant in variants:
        want += [
            f"{n} session{'s' if n > 1 else ''}, 2 stages, aggregate decode tok/s [{variant}]"
            for n in (1, 4, 8)
        ]
        want.append(f"8 sessions / 1 session, 2 stages [{variant}]")
    want.append("recovery at 8 accepted tokens (s)")
    assert names == want
    for row in result["table"]:
        assert f"| {row['name']} |" in out
        assert math.isfinite(row["dgr"]) and row["dgr"] > 0, row
        if row["peer"] is not None:
            assert math.isfinite(row["peer"]) and row["peer"] > 0, row
        if row["target"]:
            assert isinstance(row["met"], bool)
    assert result["all_finite"] is True
    # peak RSS per shard: the whole model and the 2-stage route's shards, each judged
    assert [(r["stages"], r["layers"]) for r in result["memory"]] == [
        (1, [0, 4]),
        (2, [0, 2]),
        (2, [2, 4]),
    ]
    for r in result["memory"]:
        assert r["met"] == (r["peak_rss_bytes"] <= r["weight_bytes"] + r["kv_bytes"] + (64 << 20))
    assert "target: peak RSS <= weights + KV + 64 MiB on every shard:" in out
    # every dgr route row's decode token, part by part, and one hop of each data path
    for name in ("dgr 2", "dgr 2 ring-grpc", "dgr 2 ring", "dgr 2 ring-native"):
        parts = result["speeds"]["speeds"][name]["parts_ms"]
        assert set(parts) == {"engine", "llama.cpp", "worker", "transit", "client"}, name
        assert parts["engine"] > 0 and all(math.isfinite(v) for v in parts.values()), parts
        # the workers say how much of each engine call was llama.cpp's own: most of it
        assert 0 < parts["llama.cpp"] <= parts["engine"], parts
        assert f"| {name} | " in out
    assert result["speeds"]["speeds"]["dgr 2 ring"]["parts_ms"]["client"] == 0.0  # off the path
    native = result["speeds"]["speeds"]["dgr 2 ring-native"]["parts_ms"]
    # no Python on a native ring's path: its engine time is all llama.cpp's, and no worker code
    assert native["client"] == 0.0 and native["llama.cpp"] == native["engine"] > 0, native
    # (its transit is the wall time less the engines': a ring runs ahead of the client's
    # clock, so on a tiny model it can come out a hair below zero; it is not checked)
    assert native["worker"] == 0.0, native
    hops = result["hop_cost"]["rows"]
    assert [row["path"] for row in hops] == ["tcp echo", "frame link", "grpc"]
    assert all(math.isfinite(row["hop_ms"]) and row["hop_ms"] > 0 for row in hops)
    assert "| frame link | " in out
    assert "dgr >= 1.0 x RPC decode at 2 stages:" in out
    assert "fixture evidence" in out

    # the checks it makes hold: tokens equal the whole model's, the peers used our settings
    assert all(result["speeds"]["tokens_equal"].values())
    assert result["speeds"]["tokens_equal"]["dgr 2 sampled"] is True  # seeded: its own tokens
    for variant in ("plain", "co-batch"):  # co-batched rows keep their bits (patch 0010)
        assert result["aggregate"]["tokens_exact"][variant] == {"1": 1, "4": 4, "8": 8}
    assert all(row["exact"] for row in result["recovery"])
    checks = result["speeds"]["peer_checks"] + result["aggregate"]["peer_checks"]
    assert {c["peer"].split(" (")[0] for c in checks} >= {
        "llama-bench whole",
        "rpc 2",
        "llama-batched-bench",
    }
    assert all(c["same"] for c in checks), checks
    assert all(v == "on" for v in result["dgr_flash_attn_resolved"].values())
    assert result["flash_attn_resolved_same"] is True

    # issue 15's table: every target line of the three benchmarks, in the issue's part order
    table = json.loads((tmp_path / "out" / "targets.json").read_text())["targets"]
    assert [row["name"] for row in table if row["part"].startswith(("1", "2", "4"))] == sorted(
        (row["name"] for row in result["table"] if row["target"]),
        key=lambda name: ("recovery" not in name, "session" not in name),
    )
    chain_result = json.loads((tmp_path / "out" / "chain.json").read_text())
    assert all(cell["exact"] for cell in chain_result["cells"])
    # behind the 30 ms links, every mode's token crosses at least one link each way: the
    # delay applies to the chained frames too (they take gRPC behind the proxy)
    delayed = [run for run in chain_result["runs"] if run["rtt_ms"] == 30]
    assert {run["mode"] for run in delayed} == {"relay", "chain", "ring"}
    assert all(run["ms_per_token"] >= 30 for run in delayed), delayed
    # llama.cpp RPC ran beside the routes in every cell, its 3 servers behind the same links:
    # its main process awaits each server's answer in turn, 3 round trips a token at 30 ms
    for cell in chain_result["cells"]:
        assert math.isfinite(cell["rpc_tps"]) and cell["rpc_tps"] > 0, cell
        assert cell["ring_vs_rpc"] == pytest.approx(cell["ring_tps"] / cell["rpc_tps"])
        if cell["rtt_ms"] == 30:
            assert 1000 / cell["rpc_tps"] >= 3 * 30, cell
    assert "rpc tok/s" in out
    assert [row["name"] for row in table if row["part"].startswith("3")] == [
        "decode tok/s, at 30 ms, 4 stages: chain / relay",
        "decode tok/s, at 30 ms, 4 stages: ring / relay",
        "decode tok/s, loopback, 4 stages: chain / relay",
        "decode tok/s, loopback, 4 stages: ring / relay",
    ]
    assert len([row for row in table if row["part"].startswith("5")]) == 5
    assert [row["part"][0] for row in table] == sorted(row["part"][0] for row in table)
    for row in table:
        assert f"| {row['part']} | {row['name']} |" in out
        assert isinstance(row["met"], bool)
        if row["ratio"] is not None:
            assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
    missed = sum(not row["met"] for row in table)
    assert f"{len(table)} targets: {len(table) - missed} met, {missed} missed" in out


def test_assembling_without_a_benchmark_output_says_which_to_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="peers.json: run its benchmark first"):
        targets.main(["--assemble", "--out", str(tmp_path)])
