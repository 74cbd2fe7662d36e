#!/bin/bash
# On the GPU machine (see stage.sh): install the carried stack into /tmp/site once, then run the steps
# named on the command line; logs and results go to $OUT. Steps:
#   smoke  one CUDA test      tests  tests/test_cuda.py (49 tests)
#   bench  demo, input-dist-heavy, compute-heavy     uvm  tiered, tiered-skewed (UVM-caching kernel)
#   large  gpu-large, gpu-uvm                         csan  the pipelines under PyTorch's CUDA sanitizer
#   example  examples/dlrm/train.py under torchrun on one GPU, each --pipeline
# The benchmarks run WORLD ranks (default 1), one per GPU.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/fb "$OUT" && cp .fb2/part.* /tmp/fb/
if [ ! -f /tmp/site/.ready ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  cat /tmp/fb/part.* | xz -d -T0 | tar -x -C /tmp/site || exit 1
  touch /tmp/site/.ready
fi
export PYTHONPATH=/tmp/site:$PWD
quiet() { grep -v -E "WARNING:root|_fbgemm_torch_compat|cannot determine|^\s*$|\[0m|\[33m"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, fbgemm_gpu, torchrec; print(torch.__version__, fbgemm_gpu.__version__, torchrec.__version__)" 2>&1 | quiet | tee -a "$OUT/gpu.txt"
bench() {  # name, seconds, configs...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m benchmarks run --device cuda --world-size "${WORLD:-1}" --configs "$@" \
    --variants plain ours-base ours-sparse-dist ours-prefetch torchrec-base torchrec-sparse-dist torchrec-prefetch \
    --steps 100 --warmup 30 --auto-warmup 80 --rounds 3 --profile-steps 0 \
    --json "$OUT/$name.json" --md "$OUT/$name.md" 2>&1 | quiet | tee "$OUT/$name.log"
}
for step in "$@"; do
  case $step in
    smoke) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py::test_family_fused_lookup_bitwise_equal 2>&1 | quiet | tee "$OUT/smoke.log" || exit 1 ;;
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | quiet | tee "$OUT/test_cuda.log" ;;
    bench) bench bench_cuda 500 demo input-dist-heavy compute-heavy ;;
    uvm) bench bench_uvm 400 tiered tiered-skewed ;;
    large) bench bench_large 450 gpu-large gpu-uvm ;;
    csan) timeout 300 python3 scripts/gpu/csan.py 2>&1 | quiet | grep -E "^CSAN|fbgemm::|aten::|argument" | tee "$OUT/csan.log" ;;
    example) for p in none base sparse-dist prefetch; do  # examples/dlrm/README.md's one-GPU command
               timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node=1 examples/dlrm/train.py \
                 --device cuda --pipeline $p --batch-size 8192 --num-embeddings 1000000 --embedding-dim 64 \
                 --steps 100 > "$OUT/example_$p.log" 2>&1
               echo "--pipeline $p: exit $?"; grep -E "^(device|sharding|step_time_ms|samples_per_second|train_loss) " "$OUT/example_$p.log"
             done | tee "$OUT/example.log" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
