#!/usr/bin/env bash
# The GPU checks of one session on a lent H100/H200, in one call: the versions, the GPU attention
# kernels' numerics on the chip (tests/ops/test_gpu_kernels.py), their speed and memory
# (bench/gpu_attention.py), and benchmark (b) (bench/accelerator.py, the backend's kernel alone) in the
# variants named below. Logs and the first variant's profile go to $OUT (the device tool's folder) or
# outputs/gpu.
#
#     bash bench/gpu_checks.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-outputs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv >"$out/versions.txt" 2>&1
$py -c "import jax, flax, optax; d = jax.devices()[0]; print('jax', jax.__version__, 'flax', flax.__version__,
'optax', optax.__version__, d, d.compute_capability)" >>"$out/versions.txt" 2>&1
# The XLA flag preset must be known to this jaxlib; without it the benchmarks run on XLA's defaults.
if ! $py -c "from meshlm.platform import configure_runtime; configure_runtime(); import jax; jax.devices()" \
    >>"$out/versions.txt" 2>&1; then
  echo "XLA flag preset refused by this jaxlib: MESHLM_XLA_PRESET=0" >>"$out/versions.txt"
  export MESHLM_XLA_PRESET=0
fi
cat "$out/versions.txt"
JAX_PLATFORMS=cuda timeout 150 $py -m pytest -q -p no:cacheprovider tests/ops/test_gpu_kernels.py 2>&1 | tail -25 \
  | tee "$out/tests.txt"
timeout 150 $py bench/gpu_attention.py 2>&1 | grep -v "^W1\|^I1\|bfc_allocator\|allocation summary" | tee "$out/attention.txt"
variants=(
  "--trace_out $out/trace.json.gz"
  "--scan_unroll 2"
  "--scan_unroll 8"
  "--loss_chunk 2048"
  "--packed"
)
for v in "${variants[@]}"; do
  echo "=== bench/accelerator.py --baseline none $v"
  timeout 120 $py bench/accelerator.py --baseline none --top 8 $v 2>&1 | grep -v "^W1\|^I1"
done 2>&1 | tee "$out/accelerator.txt"
echo "=== MESHLM_XLA_PRESET=0 bench/accelerator.py --baseline none" | tee -a "$out/accelerator.txt"
MESHLM_XLA_PRESET=0 timeout 120 $py bench/accelerator.py --baseline none --top 4 2>&1 | grep -v "^W1\|^I1" \
  | tee -a "$out/accelerator.txt"
