#!/usr/bin/env bash
# One command for a machine with one GPU and jax, flax, optax, numpy and scipy installed (no Ray, no PuLP),
# run from the repository root: installs alpa-like from the source tree, then
#   - examples/benchmarks/gpu_costs.py: the cost model's measurements (matmuls, bandwidth, kernels, steps);
#   - examples/benchmarks/gpu.py: every SPMD method against jax.jit (correctness, step time, the prediction);
#   - alongside, on the other CPU cores, the test suite on 8 virtual CPU devices under this machine's jax
#     (PYTHONPATH may add PuLP and import-linter, e.g. from wheels), to list what fails on that version.
# Writes every log and JSON to $OUT (default results/gpu).
#
#   bash examples/benchmarks/gpu_run.sh
set -u
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
CORES=$(nproc)
GPU_CORES=0-$(( CORES > 8 ? 5 : 0 ))
TEST_CORES=$(( CORES > 8 ? 6 : 0 ))-$(( CORES - 1 ))
TEST_WORKERS=$(( CORES > 8 ? CORES - 6 : 1 ))
SUITE_SECONDS=${SUITE_SECONDS:-430}
command -v taskset >/dev/null || taskset() { shift 2; "$@"; }

if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    # setup.py's package_dir maps compiler/ and runtime/ into alpa_like: lay that tree out by hand
    rm -rf /tmp/alpa-like-src && mkdir -p /tmp/alpa-like-src && cp -r alpa_like /tmp/alpa-like-src/ \
        && cp -r compiler runtime /tmp/alpa-like-src/alpa_like/ && echo "pip failed; using a copied tree" >>"$OUT/install.log"
    export PYTHONPATH=/tmp/alpa-like-src${PYTHONPATH:+:$PYTHONPATH}
    SUITE_PYTHONPATH=/tmp/alpa-like-src${SUITE_PYTHONPATH:+:$SUITE_PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv >"$OUT/nvidia-smi.txt" 2>&1
$PY -c "import jax, flax, optax, numpy; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'numpy', numpy.__version__, jax.devices())" | tee "$OUT/versions.txt"

(JAX_PLATFORMS=cpu PYTHONPATH=${SUITE_PYTHONPATH:-} timeout "$SUITE_SECONDS" taskset -c "$TEST_CORES" \
    $PY -P -m pytest tests -q -n "$TEST_WORKERS" --dist loadgroup -rfE --junitxml="$OUT/suite.xml" \
    >"$OUT/suite.log" 2>&1; echo "suite exit $?" >>"$OUT/suite.log") &

JAX_COMPILATION_CACHE_DIR=/tmp/alpa-like-gpu-jax-cache taskset -c "$GPU_CORES" $PY examples/benchmarks/gpu_costs.py --time-budget "${COSTS_SECONDS:-170}" \
    --out "$OUT/gpu_costs.json" 2>&1 | tee "$OUT/gpu_costs.log" | grep -v "^wrote"
JAX_COMPILATION_CACHE_DIR=/tmp/alpa-like-gpu-jax-cache taskset -c "$GPU_CORES" $PY examples/benchmarks/gpu.py --methods DataParallel Zero3Parallel ShardParallel \
    --time-budget "${METHODS_SECONDS:-220}" --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.log"
wait
tail -n 40 "$OUT/suite.log"
