#!/usr/bin/env bash
# The engine's in-process tests under AddressSanitizer + UndefinedBehaviorSanitizer (issue 12).
#   scripts/sanitize.sh [pytest args]     (after ./dgr.sh test has built .venv)
# Builds the sanitized libllama (native/build_llama.py --sanitize: its own cache key, under
# ~/.cache/dgr/llama/asan-*) and dgr's C ABI with the same flags into .workspace/asan (never the
# installed module), then runs the tests with that copy first on PYTHONPATH and the sanitizer
# runtimes preloaded (CPython itself is not instrumented). Any ASan report or undefined
# behaviour aborts the run. docs/sanitizers.md has the last result.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "sanitize: run ./dgr.sh test first (it builds .venv)" >&2; exit 2; }
out=.workspace/asan
began=$(date +%s)
rm -rf "$out/src"
mkdir -p "$out/src"
cp -r dgr_engine dgr_session native "$out/src/"  # native/: cffi compiles in there
find "$out/src" \( -name '_native*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
DGR_SANITIZE=1 OUT="$out/src" .venv/bin/python -c '
import os, sys
sys.path.insert(0, os.getcwd())
import cffi_build
cffi_build.ffibuilder.compile(tmpdir=os.environ["OUT"])
' >"$out/build.log" 2>&1 || { tail -40 "$out/build.log" >&2; exit 1; }
built=$(date +%s)
echo "sanitize: sanitized build ready in $((built - began)) s (log: $out/build.log)" >&2

preload="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export LD_PRELOAD="$preload"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:verify_asan_link_order=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$PWD/$out/src"
export OMP_WAIT_POLICY=PASSIVE
.venv/bin/python -P -c '
import dgr_engine._native as native, os, sys
where = os.path.realpath(native.__file__)
assert where.startswith(os.path.realpath(os.environ["PYTHONPATH"])), where
print(f"sanitize: testing {where}", file=sys.stderr)
'
set +e
.venv/bin/python -P -m pytest -p no:cacheprovider -q \
    tests/engine/test_binding.py tests/engine/test_engine_parity.py tests/engine/test_engine_errors.py \
    tests/engine/test_v4_parity.py tests/engine/test_v4_errors.py tests/engine/test_chain.py \
    tests/engine/test_finite_values.py tests/worker/test_data_paths.py tests/engine/test_native_link.py \
    tests/engine/test_sealed_link.py \
    --deselect tests/engine/test_chain.py::test_shard_memory_benchmark_runs_on_the_tiny_fixture \
    "$@"  # (the memory benchmark's RSS bound cannot hold with ASan's shadow memory)
code=$?
set -e
echo "sanitize: tests exited $code after $(( $(date +%s) - built )) s" >&2
exit $code
