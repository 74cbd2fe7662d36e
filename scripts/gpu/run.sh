#!/bin/bash
# On the GPU machine, over what scripts/gpu/stage.sh staged: run the steps named, in order; logs and
# results go to $OUT. Each step is killed at its budget (B_<step>, seconds, below).
#   receive   copy the parts carried in this call (.gpu/p*) to /tmp/gpu-parts
#   install   unpack every part received and the wheels of .gpu/whl into /tmp/site
#   probe     GPU, python, torch, fbgemm, torchrec; stops (exit 3) if the torch loaded is not
#             the one the staged fbgemm is built for
#   tests     tests/test_cuda.py: every class bit for bit against its reference
#   csan      every class under PyTorch's CUDA sanitizer (scripts/gpu/csan.py)
#   memory    peak memory in flight per class (scripts/gpu/memory.py, gpu-large)
#   sequence  with DRY=1, here: the whole sequence of device calls on CPU (each call's carry and
#             commands, every part and path checked, the budgets summed against the device time)
# Off the sequence, each with its own limit: smoke (one CUDA test), bench, uvm, large (benchmarks),
# example (the DLRM example). WORLD=N runs the benchmarks on N ranks; BENCH is the benchmark command.
# DRY=1 prints the commands instead of running them. GPU_DIR=.gpu is where stage.sh's parts and
# wheels were carried.
set -o pipefail
export PYTHONUNBUFFERED=1
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
# The budgets, in seconds; scripts/gpu/README.md's table gives what each rests on, and
# tests/test_gpu_scripts.py fails when the two differ or the sequence's sum passes DEVICE_S.
B_receive=20 B_install=60 B_probe=40 B_tests=120 B_csan=210 B_memory=75
START_S=60     # the machine's start, paid by the first call (30-40 s seen on an H200)
CALL_S=30      # each call: the upload of its carry, the files back, the wait for the next call
COMMAND_S=600  # one command's limit (the calls' timeout_s)
DEVICE_S=${DEVICE_S:-780}  # 13 of the session's 15 minutes: 2 left to hand the machine back
LAST="receive install probe tests csan memory"  # the last call's steps; each earlier call: receive
STEPS="receive install probe tests csan memory sequence smoke bench uvm large example"
[ $# -gt 0 ] || usage 2 >&2
for step in "$@"; do
  case " $STEPS -h --help " in *" $step "*) ;; *) echo "run.sh: unknown step '$step'; steps: $STEPS" >&2; exit 2 ;; esac
  case $step in -h|--help) usage 0 ;; esac
done
self=$(realpath "$0")
cd "$(dirname "$self")/../.." || exit 1
OUT=${OUT:-/tmp/out}
BENCH=${BENCH:-python3 -m benchmarks run}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD
do_() { if [ "${DRY:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
quiet() { grep -v -E "WARNING:root|_fbgemm_torch_compat|cannot determine|^\s*$|\[0m|\[33m"; }
G=${GPU_DIR:-.gpu}
# A step's budget holds its kill: SIGTERM at the budget less 5 s, SIGKILL 5 s later, to the step's
# process group (a rank stuck in NCCL may ignore SIGTERM and would hold the GPU for the next step).
bound() { local b=$1; shift; do_ timeout -k 5 $((b - 5)) "$@"; }
budget() { local s=0 step; for step in "$@"; do s=$((s + B_$step)); done; echo $s; }
stack() { [ -f "$G/whl/stack.env" ] && cat "$G/whl/stack.env" || cat /tmp/site/.stack.env 2>/dev/null; }
receive() {
  do_ mkdir -p /tmp/gpu-parts
  for d in ${CARRIED:-"$G"/p*}; do [ -d "$d" ] && { bound "$B_receive" cp "$d"/part.* /tmp/gpu-parts/ || return 1; }; done; true
}
install() {
  [ -f "$G/whl/stack.env" ] || { echo "install: carry $G/whl in this call (stage.sh wrote it)" >&2; return 1; }
  eval "$(tr '\n' ' ' < "$G/whl/stack.env")"
  # /tmp lives only while the machine is warm (30 s after a call): a late call finds no earlier part.
  have=$(ls /tmp/gpu-parts/part.* 2>/dev/null | wc -l)
  [ "${DRY:-0}" = 1 ] || [ "$have" = "$PARTS" ] || {
    echo "install: $have of $PARTS parts in /tmp/gpu-parts: the machine went cold between the calls" >&2; return 1; }
  bound "$B_install" bash -c "mkdir -p /tmp/site && cat /tmp/gpu-parts/part.* | xz -d -T0 | tar -x -C /tmp/site &&
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/whl/*.whl &&
    cp $G/whl/stack.env /tmp/site/.stack.env"
}
probe() {
  [ "${DRY:-0}" = 1 ] && { echo "+ timeout 5 nvidia-smi; timeout -k 5 $((B_probe - 10)) python3 (torch, fbgemm_gpu, torchrec, one fbgemm CUDA op)"; return 0; }
  timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
  eval "$(stack | tr '\n' ' ')"
  NEEDS=$NEEDS timeout -k 5 $((B_probe - 10)) python3 - <<'EOF' 2>&1 | quiet | tee -a "$OUT/gpu.txt"
import os, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, torch.__file__, "cuda", torch.version.cuda)
if not torch.__version__.startswith(os.environ["NEEDS"]):
    print(f"probe: torch {torch.__version__} is loaded, the staged fbgemm needs torch {os.environ['NEEDS']}: "
          "stage again with `bash scripts/gpu/stage.sh --image-torch X.Y.Z` (the torch loaded)")
    sys.exit(3)
import fbgemm_gpu, torchrec
print("fbgemm_gpu", fbgemm_gpu.__version__, "torchrec", torchrec.__version__, "gpu", torch.cuda.get_device_name())
torch.ops.fbgemm.asynchronous_complete_cumsum(torch.arange(4, device="cuda"))  # a CUDA op of fbgemm loads
EOF
}
fail() { echo "sequence: $*" >&2; exit 1; }
sequence() {  # DRY=1 only: the calls span machines' warm windows, no one command can run them
  [ "${DRY:-0}" = 1 ] || fail "it spans several device calls: run it with DRY=1 here, then make the calls it prints"
  [ -f "$G/whl/stack.env" ] || fail "no $G/whl/stack.env: run scripts/gpu/stage.sh first"
  eval "$(tr '\n' ' ' < "$G/whl/stack.env")"
  for path in tests/test_cuda.py tests/cuda_cases.py scripts/gpu/csan.py scripts/gpu/memory.py; do
    [ -f "$path" ] || fail "$path is missing"
  done
  ls "$G"/whl/torchrec-*.whl > /dev/null 2>&1 || fail "no torchrec wheel in $G/whl"
  local tree i steps carry bytes s total=$START_S
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
  for i in $(seq 1 "$PARTS"); do
    ls "$G/p$i"/part.* > /dev/null 2>&1 || fail "$G/p$i has no part: stage again"
    steps=receive carry="\"$G/p$i\"" bytes=$((tree + $(du -cb "$G/p$i" | tail -1 | cut -f1)))
    if [ "$i" = "$PARTS" ]; then
      steps=$LAST carry="$carry, \"$G/whl\"" bytes=$((bytes + $(du -cb "$G/whl" | tail -1 | cut -f1)))
    fi
    [ "$bytes" -le $((64 * 1048576)) ] || fail "call $i carries $bytes bytes, over 64 MiB"
    s=$(budget $steps)
    [ "$s" -le $((COMMAND_S - CALL_S)) ] || fail "call $i's steps sum to $s s, over $((COMMAND_S - CALL_S)) s"
    total=$((total + s + CALL_S))
    echo "call $i of $PARTS, timeout_s $COMMAND_S, carry [$carry] ($bytes bytes): bash scripts/gpu/run.sh $steps  (steps $s s)"
    CARRIED=$G/p$i GPU_DIR=$G bash "$self" $steps | sed 's/^/    /' || fail "call $i's dry run failed"
  done
  echo "device time: start $START_S s + steps + $CALL_S s a call = $total s of $DEVICE_S"
  [ "$total" -le "$DEVICE_S" ] || fail "$total s is over the $DEVICE_S s of device time"
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
    receive) receive || exit 1 ;;
    install) install || exit 1 ;;
    probe) probe || exit 3 ;;
    sequence) sequence ;;
    # Tests first: the sanitizer and the memory table come after, so a step cut at its budget loses
    # only its own later cases (each prints its line as it ends).
    tests) bound "$B_tests" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | quiet | tee "$OUT/test_cuda.log" ;;
    csan) bound "$B_csan" python3 scripts/gpu/csan.py --timeout "$((B_csan - 10))" 2>&1 | quiet | tee "$OUT/csan_full.log" | grep -E "^CSAN|^\+ |fbgemm::|aten::|argument" | tee "$OUT/csan.log" ;;
    memory) bound "$B_memory" python3 scripts/gpu/memory.py --config gpu-large --steps 10 --json "$OUT/memory.json" 2>&1 | quiet | tee "$OUT/memory.log" ;;
    smoke) do_ timeout 120 python3 -m pytest -q -x -p no:cacheprovider "tests/test_cuda.py::test_hbm_kernel_bitwise_equal[TrainPipelineSparseDist-dlrm-table_wise]" 2>&1 | quiet | tee "$OUT/smoke.log" || exit 1 ;;
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
