#!/usr/bin/env bash
# The GPU checks of the reference engine, as one prepared run on a lent device (see docs/benchmarks.md
# section 4): the CUDA tests, the attention forms, re-rotation vs a device copy, and bench.engine on a
# random-weight Llama-3.1-8B-shaped checkpoint (a benchmark input only). Writes each step's log to
# $OUT (or ./gpu-out). Needs the pinned transformers wheel in .whl/ where the image lacks it.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
step() { local name=$1 limit=$2; shift 2; echo "== $name (limit ${limit}s): $*"; local t=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"; echo "== $name rc=$? in $((SECONDS - t)) s" | tee -a "$OUT/steps.txt"; }
step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"'
[ -n "$SKIP_KERNELS" ] || step attention 60 python3 -m bench.attention --device cuda
[ -n "$SKIP_KERNELS" ] || step rotate 60 python3 -m bench.rotate --device cuda
[ -n "$SKIP_ENGINE" ] || step engine ${ENGINE_LIMIT:-300} python3 -m bench.engine --device cuda --shape llama3-8b --dtype bfloat16 \
  --lengths 4096 8192 16384 32768 --reps 3 --cached 32768 --profile
# (test_cuda_path.py needs the shipped SmolLM2 weights, 94 MB: more than a call carries)
[ -n "$SKIP_TESTS" ] || step tests 180 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_families.py tests/test_rope_triton.py \
  tests/test_bench_rotate.py tests/test_rope_fused.py \
  "tests/test_device_placement.py::test_cuda_kv_is_staged_through_pinned_memory_exactly"
# what kvnotes calibrate costs on the 8B shape (random weights: cost only)
[ -n "$SKIP_CALIBRATE" ] || step calibrate ${CALIBRATE_LIMIT:-240} python3 -m bench.calibrate_cost --shape llama3-8b --device cuda \
  --dtype bfloat16 --cases ${CALIBRATE_CASES:-3} --decisions 2
