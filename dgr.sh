#!/usr/bin/env bash
# dgr's two commands, each installing what it needs into ./.venv first:
#   ./dgr.sh demo   the main job: a chat answer from the real SmolLM2-135M-Instruct (fetched once,
#                   verified) over local workers, a stage lost and recovered, text equal to the
#                   whole model's; a generated fixture with --fixture NAME or without the real model
#   ./dgr.sh test   ruff, mypy and the whole test suite
# The first run fetches, patches and builds llama.cpp at the pinned commit (about 3 min on 2 cores,
# progress on stderr, cached in ~/.cache/dgr by manifest + patches + build script), then the cffi
# binding; `test` also builds llama.cpp's own tools (about 4.5 min cold, cached) before pytest.
set -euo pipefail
cd "$(dirname "$0")"

pick_python() {
    for candidate in "${PYTHON:-}" python3.11 python3; do
        if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            echo "$candidate"
            return
        fi
    done
    echo "dgr needs Python >= 3.11 (set PYTHON=...)" >&2
    exit 2
}

# with_ticker WHAT COMMAND...: runs COMMAND, saying "dgr: still WHAT, N s" on stderr every
# DGR_TICK_SECONDS (default 15) while it runs (pip -q is silent for minutes on a fresh
# machine); the ticker ends with the command, or with this script. Returns the command's status.
with_ticker() {
    local what=$1
    shift
    local began ticker status=0
    began=$(date +%s)
    (
        while sleep "${DGR_TICK_SECONDS:-15}" && kill -0 "$$" 2>/dev/null; do
            echo "dgr: still $what, $(($(date +%s) - began)) s" >&2
        done
    ) &
    ticker=$!
    "$@" || status=$?
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    return "$status"
}

# ensure_debian_programs PROGRAM...: installs Debian's package of each program that is not on
# PATH (the package is named like the program), where this machine allows it (root and apt);
# elsewhere says which tests will fail without it.
ensure_debian_programs() {
    local missing=() program
    for program in "$@"; do
        command -v "$program" >/dev/null 2>&1 || missing+=("$program")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "dgr: installing ${missing[*]} (Debian's) for the tests that drive them" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -q "${missing[@]}" >/dev/null; } ||
            echo "dgr: installing ${missing[*]} failed - the tests that drive them will fail" >&2
    else
        echo "dgr: ${missing[*]} missing and not installable here (root and apt) - the tests" \
            "that drive them will fail: install Debian's ${missing[*]}" >&2
    fi
}

ensure_env() {
    if [ ! -x .venv/bin/python ]; then
        echo "dgr: creating .venv" >&2
        "$(pick_python)" -m venv .venv
    fi
    # reinstall (and rebuild the binding) when anything it is built from changes
    local stamp
    stamp=$(cat pyproject.toml setup.py cffi_build.py native/llama.cpp.manifest.json \
        native/build_llama.py native/include/* native/src/* patches/*.patch 2>/dev/null | sha256sum | cut -c1-16)
    if [ "$(cat .venv/.dgr-stamp 2>/dev/null)" != "$stamp" ] ||
        ! .venv/bin/python -c 'import dgr_engine._native' 2>/dev/null; then
        local began=$SECONDS
        echo "dgr: installing the build tools (pip, cmake, ninja, cffi)" >&2
        with_ticker "installing the build tools" .venv/bin/python -m pip install -q --upgrade pip
        with_ticker "installing the build tools" .venv/bin/python -m pip install -q \
            "setuptools>=77" wheel "cffi>=1.16" "cmake>=3.21" ninja scikit-build-core
        if [ -z "${DGR_LLAMA_PREFIX:-}" ]; then
            # the pinned, patched llama.cpp, built here where its progress shows (each step and
            # every 10 % of the compile, on stderr; cached in ~/.cache/dgr, where the binding's
            # build below finds it)
            echo "dgr: llama.cpp at the pinned commit (a cold build takes about 3 min on 2 cores;" \
                "cached after)" >&2
            .venv/bin/python native/build_llama.py --print-prefix ${DGR_SANITIZE:+--sanitize} >/dev/null
        fi
        echo "dgr: installing dgr and its dependencies, building the binding" >&2
        with_ticker "installing dgr" .venv/bin/python -m pip install -q --no-build-isolation -e ".[test,baseline]"
        echo "$stamp" > .venv/.dgr-stamp
        echo "dgr: ready in $((SECONDS - began)) s" >&2
    fi
}

export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # no OpenMP spin-waiting on small shared machines

case "${1:-}" in
    demo)
        shift
        ensure_env
        exec .venv/bin/dgr demo "$@"
        ;;
    test)
        shift
        ensure_env
        # programs some tests drive, from Debian, installed where missing and this machine
        # allows it (root, apt); nothing else is downloaded: headless Chromium for the page of
        # `dgr serve`, tmux for `dgr chat` in a terminal, iptables for the faults between
        # hosts (network namespaces, tests/e2e/test_between_hosts.py)
        ensure_debian_programs chromium tmux iptables
        # llama.cpp's own tools, from the same pinned, patched source (llama-bench, RPC,
        # llama-server), which the tests measuring dgr against them run: built here, with
        # progress, once per machine (about 4.5 min cold on 2 cores; cached in ~/.cache/dgr),
        # not inside whichever test asks first, where it would spend that test's time limit;
        # ruff and mypy run meanwhile
        echo "dgr: llama.cpp's tools (llama-bench, RPC, llama-server; cached after the first build)" >&2
        .venv/bin/python -m benchmarks.peer_build --print-prefix >/dev/null &
        peers=$!
        echo "dgr: ruff" >&2
        .venv/bin/ruff check . || { kill "$peers" 2>/dev/null; exit 1; }
        .venv/bin/ruff format --check . || { kill "$peers" 2>/dev/null; exit 1; }
        echo "dgr: mypy" >&2
        .venv/bin/mypy || { kill "$peers" 2>/dev/null; exit 1; }
        wait "$peers" || { echo "dgr: building llama.cpp's tools failed (above)" >&2; exit 1; }
        echo "dgr: pytest" >&2
        exec .venv/bin/python -m pytest "$@"
        ;;
    *)
        echo "usage: ./dgr.sh demo | ./dgr.sh test [pytest args]" >&2
        exit 2
        ;;
esac
