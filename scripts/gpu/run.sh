#!/bin/bash
# On the GPU machine, over what scripts/gpu/stage.sh staged: run the steps named, in order; logs and
# results go to $OUT. Each step is bounded (minutes below) so that a call stays inside 10 minutes.
#   receive   copy the parts carried in this call (.gpu/p*) to /tmp/gpu-parts          (seconds)
#   install   receive, then unpack every part and the wheels of .gpu/whl into /tmp/site     (1-2)
#   probe     GPU, python, torch, fbgemm, torchrec; stops (exit 3) if the torch loaded is not
#             the one the staged fbgemm is built for                                        (<1)
#   smoke     one CUDA test                                                                 (1)
#   tests     tests/test_cuda.py: every class bit for bit against its reference             (<=8)
#   csan      every class under PyTorch's CUDA sanitizer (scripts/gpu/csan.py)              (<=6)
#   memory    peak memory in flight per class, keep-alive against record_stream and
#             torchrec's class (scripts/gpu/memory.py, gpu-large)                           (<=8)
#   bench     benchmarks demo, input-dist-heavy, compute-heavy                              (<=9)
#   uvm       benchmarks tiered, tiered-skewed (UVM-caching kernel)                         (<=7)
#   large     benchmarks gpu-large, gpu-uvm                                                 (<=8)
#   example   examples/dlrm/train.py under torchrun on one GPU, each --pipeline             (<=6)
# WORLD=N runs the benchmarks on N ranks (one per GPU); BENCH is the benchmark command
# (default "python3 -m benchmarks run"). DRY=1 prints the commands instead of running them.
# GPU_DIR=.gpu is where stage.sh's parts and wheels were carried.
set -o pipefail
export PYTHONUNBUFFERED=1
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
STEPS="receive install probe smoke tests csan memory bench uvm large example"
[ $# -gt 0 ] || usage 2 >&2
for step in "$@"; do
  case " $STEPS -h --help " in *" $step "*) ;; *) echo "run.sh: unknown step '$step'; steps: $STEPS" >&2; exit 2 ;; esac
  case $step in -h|--help) usage 0 ;; esac
done
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
BENCH=${BENCH:-python3 -m benchmarks run}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD
do_() { if [ "${DRY:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
quiet() { grep -v -E "WARNING:root|_fbgemm_torch_compat|cannot determine|^\s*$|\[0m|\[33m"; }
G=${GPU_DIR:-.gpu}
stack() { [ -f "$G/whl/stack.env" ] && cat "$G/whl/stack.env" || cat /tmp/site/.stack.env 2>/dev/null; }
receive() { do_ mkdir -p /tmp/gpu-parts; for d in "$G"/p*; do [ -d "$d" ] && do_ cp "$d"/part.* /tmp/gpu-parts/; done; true; }
install() {
  receive
  [ -f "$G/whl/stack.env" ] || { echo "install: carry $G/whl in this call (stage.sh wrote it)" >&2; return 1; }
  eval "$(tr '\n' ' ' < "$G/whl/stack.env")"
  have=$(ls /tmp/gpu-parts/part.* 2>/dev/null | wc -l)
  [ "$have" = "$PARTS" ] || { echo "install: $have of $PARTS parts in /tmp/gpu-parts: make the calls of every part first" >&2; return 1; }
  do_ mkdir -p /tmp/site
  [ "${DRY:-0}" = 1 ] || { cat /tmp/gpu-parts/part.* | xz -d -T0 | tar -x -C /tmp/site || return 1; }
  do_ python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl || return 1
  do_ cp "$G/whl/stack.env" /tmp/site/.stack.env
}
probe() {
  [ "${DRY:-0}" = 1 ] && { echo "+ probe: nvidia-smi; python3 (torch, fbgemm_gpu, torchrec)"; return 0; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
  eval "$(stack | tr '\n' ' ')"
  NEEDS=$NEEDS python3 - <<'EOF' 2>&1 | quiet | tee -a "$OUT/gpu.txt"
import os, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, torch.__file__, "cuda", torch.version.cuda)
if not torch.__version__.startswith(os.environ["NEEDS"]):
    print(f"probe: torch {torch.__version__} is loaded, the staged fbgemm needs torch {os.environ['NEEDS']}: "
          "stage with `bash scripts/gpu/stage.sh --for-image` for the image's torch, or stage that torch")
    sys.exit(3)
import fbgemm_gpu, torchrec
print("fbgemm_gpu", fbgemm_gpu.__version__, "torchrec", torchrec.__version__, "gpu", torch.cuda.get_device_name())
torch.ops.fbgemm.asynchronous_complete_cumsum(torch.arange(4, device="cuda"))  # a CUDA op of fbgemm loads
EOF
}
bench() {  # name, seconds, configs...
  local name=$1 limit=$2; shift 2
  do_ timeout "$limit" $BENCH --device cuda --world-size "${WORLD:-1}" --configs "$@" \
    --variants plain ours-base ours-sparse-dist ours-prefetch torchrec-base torchrec-sparse-dist torchrec-prefetch \
    --steps 100 --warmup 30 --auto-warmup 80 --rounds 3 --profile-steps 0 \
    --json "$OUT/$name.json" --md "$OUT/$name.md" 2>&1 | quiet | tee "$OUT/$name.log"
}
for step in "$@"; do
  echo "== $step"
  case $step in
    receive) receive ;;
    install) install || exit 1 ;;
    probe) probe || exit 3 ;;
    smoke) do_ timeout 120 python3 -m pytest -q -x -p no:cacheprovider "tests/test_cuda.py::test_hbm_kernel_bitwise_equal[TrainPipelineSparseDist-dlrm-table_wise]" 2>&1 | quiet | tee "$OUT/smoke.log" || exit 1 ;;
    tests) do_ timeout 480 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | quiet | tee "$OUT/test_cuda.log" ;;
    csan) do_ timeout 360 python3 scripts/gpu/csan.py 2>&1 | quiet | grep -E "^CSAN|^\+ |fbgemm::|aten::|argument" | tee "$OUT/csan.log" ;;
    memory) do_ timeout 480 python3 scripts/gpu/memory.py --config gpu-large --json "$OUT/memory.json" 2>&1 | quiet | tee "$OUT/memory.log" ;;
    bench) bench bench_cuda 540 demo input-dist-heavy compute-heavy ;;
    uvm) bench bench_uvm 420 tiered tiered-skewed ;;
    large) bench bench_large 480 gpu-large gpu-uvm ;;
    example) for p in none base sparse-dist prefetch; do  # examples/dlrm/README.md's one-GPU command
               do_ timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node=1 examples/dlrm/train.py \
                 --device cuda --pipeline $p --batch-size 8192 --num-embeddings 1000000 --embedding-dim 64 \
                 --steps 100 > "$OUT/example_$p.log" 2>&1
               echo "--pipeline $p: exit $?"; grep -E "^(device|sharding|step_time_ms|samples_per_second|train_loss) " "$OUT/example_$p.log"
             done | tee "$OUT/example.log" ;;
  esac
done
