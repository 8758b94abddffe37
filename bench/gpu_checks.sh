#!/usr/bin/env bash
# The GPU checks of one session on a lent H100/H200, in one call. Stages, in order of worth (a call
# cut short still returns what ran): benchmark (b) (bench/accelerator.py: the backend's kernel, with
# the layer loop as the model's auto sets it, then on packed rows); `meshlm train` end to end on the
# same shape; the GPU attention kernels' numerics (tests/ops/test_gpu_kernels.py); benchmark (b) with
# the layer loop kept scanned; the kernels' speed and memory alone (bench/gpu_attention.py, unless
# NO_ATTENTION=1). Logs and the first run's profile go to $OUT (the device tool's folder) or
# outputs/gpu. Python packages missing there travel as wheels in .whl/ (installed for `meshlm train`).
#
#     bash bench/gpu_checks.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-outputs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
quiet() { grep -v "^W1\|^I1\|bfc_allocator\|allocation summary"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv >"$out/versions.txt" 2>&1
$py -c "import jax, flax, optax; d = jax.devices()[0]; print('jax', jax.__version__, 'flax', flax.__version__,
'optax', optax.__version__, d, d.compute_capability)" >>"$out/versions.txt" 2>&1
cat "$out/versions.txt"
{
  echo "=== bench/accelerator.py --baseline none (scan_unroll auto)"
  timeout 90 $py bench/accelerator.py --baseline none --top 12 --trace_out "$out/trace.json.gz" 2>&1 | quiet
  echo "=== bench/accelerator.py --baseline none --packed"
  timeout 90 $py bench/accelerator.py --baseline none --top 6 --packed 2>&1 | quiet
} | tee "$out/accelerator.txt"
site=""
if ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && site=/tmp/site
fi
# Stopped once step 30 is logged: the end of the run would save 45 GB of weights and optimizer state.
PYTHONPATH=$site $py -m meshlm train --model=llama3-8b --model.n_layers=8 --dataset=synthetic \
  --batch_size=1 --seq_len=8192 --steps=40 --log_every=10 --output_dir=/tmp/meshlm-run >"$out/train.txt" 2>&1 &
train=$!
for _ in $(seq 150); do
  sleep 1
  grep -q "^step  *30 |" "$out/train.txt" && break
  kill -0 $train 2>/dev/null || break
done
kill $train 2>/dev/null
quiet <"$out/train.txt" | tail -12
JAX_PLATFORMS=cuda timeout 100 $py -m pytest -q -p no:cacheprovider tests/ops/test_gpu_kernels.py 2>&1 | tail -4 \
  | tee "$out/tests.txt"
{
  echo "=== bench/accelerator.py --baseline none --scan_unroll 1"
  timeout 90 $py bench/accelerator.py --baseline none --top 4 --scan_unroll 1 2>&1 | quiet
} | tee -a "$out/accelerator.txt"
if [ "${NO_ATTENTION:-0}" != 1 ]; then
  timeout 150 $py bench/gpu_attention.py 2>&1 | quiet | tee "$out/attention.txt"
fi
