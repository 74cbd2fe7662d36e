#!/bin/bash
# On the GPU machine, over what scripts/gpu/stage.sh staged: run the steps named, in order. Each step
# writes its raw outputs into $RESULTS, packed after every step into $OUT/results.tgz (the device
# hands back 8 files at most); $RESULTS/steps.txt gives each step's start, exit status and seconds.
# A step is killed at its budget (B_<step>, seconds, below) or at the call's limit, whichever is first.
#   receive   copy the parts carried in this call (.gpu/p*) to /tmp/gpu-parts
#   install   unpack every part received and the wheels of .gpu/whl into /tmp/site
#   probe     GPU, python, torch, fbgemm, torchrec; stops (exit 3) if the torch loaded is not
#             the one the staged fbgemm is built for
#   tests     tests/test_cuda.py, the regressions of the last GPU run first: every class bit for bit
#   csan      every class under PyTorch's CUDA sanitizer (scripts/gpu/csan.py)
#   memory    peak memory in flight per class (scripts/gpu/memory.py, gpu-large)
#   speed     python -m benchmarks run --device cuda on gpu-busy (a plain step of 20 ms or more on an
#             H100): plain, our and torchrec's SparseDist and Prefetch, 3 paired rounds
#   speed-uvm the same on gpu-uvm-big (26.6 GB of rows behind a UVM cache, 16 GiB of GPU memory), 2
#             rounds (each build initialises the 26.6 GB)
#   handoffs  memory.py --check on Base, Fused, SemiSync and SparseDist: keep-alive <= record_stream
#   demo      `make demo DEMO_NPROC=1` as a user types it, less `setup` (the stack staged, no network)
#   example   the DLRM example: 200 steps of --pipeline prefetch, then of the plain loop (--compare)
#   sequence        with DRY=1, here: the device calls of the checks (tests, csan, memory) on CPU:
#                   each call's carry and commands, every part and path checked, the budgets summed
#   speed-sequence  with DRY=1, here: the same for the speed sequence (tests, speed, handoffs, demo,
#                   then speed-uvm, the slowest, in what is left of the call)
# Off the sequences: example (its budget); smoke (one CUDA test), bench, uvm, large (benchmarks), each
# with its own limit.
# WORLD=N runs the benchmarks and the example on N ranks; BENCH is the benchmark command.
# DRY=1 prints the commands instead of running them. GPU_DIR=.gpu is where stage.sh's parts and
# wheels were carried.
set -o pipefail
export PYTHONUNBUFFERED=1
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
# The budgets, in seconds; scripts/gpu/README.md's table gives what each rests on, and
# tests/test_gpu_scripts.py fails when the two differ or a sequence's sum passes 13 minutes.
B_receive=20 B_install=60 B_probe=40 B_tests=120 B_csan=210 B_memory=75
B_speed=120 B_handoffs=45 B_demo=45 B_speed_uvm=240 B_example=45  # a step's dashes are _ here
START_S=${START_S:-60}  # the machine's start, paid by the first call (30-40 s seen on an H200)
CALL_S=${CALL_S:-30}    # each call: the upload of its carry, the files back, the wait for the next call
COMMAND_S=600           # one command's limit (the calls' timeout_s)
CALL_END=$((COMMAND_S - CALL_S))  # a call's steps end by then, counted from run.sh's start
MIN_LAST_S=30           # the least the last step of a sequence may be left of its call
DEVICE_S=${DEVICE_S:-780}  # 13 of the session's 15 minutes: 2 left to hand the machine back
MAX_DEVICE_S=780           # and never more, whatever DEVICE_S says
# The last call's steps of each sequence; each earlier call runs `receive`.
CHECKS="receive install probe tests csan memory"                    # `sequence`
SPEED="receive install probe tests speed handoffs demo speed-uvm"  # `speed-sequence`
# tests/test_cuda.py's cases for what the last GPU run found (the Staged prefetch stage behind the
# UVM cache; progress() dropping finished batches before the next copy, in Base, Fused, SemiSync).
REGRESSIONS=("[StagedTrainPipeline+prefetch-dlrm-table_wise]" "[TrainPipelineBase-dlrm-table_wise]"
  "[TrainPipelineFusedSparseDist-dlrm-table_wise]" "[TrainPipelineSemiSync-dlrm-table_wise]")
SPEED_VARIANTS="plain ours-sparse-dist ours-prefetch torchrec-sparse-dist torchrec-prefetch"
# Each config's steps and rounds (README.md's budget table says what their time rests on).
SPEED_BUSY="--configs gpu-busy --steps 30 --warmup 10 --auto-warmup 10 --rounds 3 --profile-steps 0"
SPEED_UVM="--configs gpu-uvm-big --steps 30 --warmup 10 --auto-warmup 10 --rounds 2 --profile-steps 0"
HANDOFFS="TrainPipelineBase TrainPipelineFusedSparseDist TrainPipelineSemiSync TrainPipelineSparseDist"
STEPS="receive install probe tests csan memory speed speed-uvm handoffs demo example sequence speed-sequence smoke bench uvm large"
[ $# -gt 0 ] || usage 2 >&2
for step in "$@"; do
  case " $STEPS -h --help " in *" $step "*) ;; *) echo "run.sh: unknown step '$step'; steps: $STEPS" >&2; exit 2 ;; esac
  case $step in -h|--help) usage 0 ;; esac
done
self=$(realpath "$0")
cd "$(dirname "$self")/../.." || exit 1
T0=$SECONDS
OUT=${OUT:-/tmp/out}
if [ "${DRY:-0}" = 1 ]; then R=${RESULTS:-$OUT/results}; else R=${RESULTS:-/tmp/gpu-results}; fi
BENCH=${BENCH:-python3 -m benchmarks run}
mkdir -p "$OUT" "$R"
export PYTHONPATH=/tmp/site:$PWD
do_() { if [ "${DRY:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
quiet() { grep -v -E "WARNING:root|_fbgemm_torch_compat|cannot determine|^\s*$|\[0m|\[33m" || true; }
G=${GPU_DIR:-.gpu}
# A step's budget holds its kill: SIGTERM at the budget less 5 s, SIGKILL 5 s later, to the step's
# process group (a rank stuck in NCCL may ignore SIGTERM and would hold the GPU for the next step).
bound() { local b=$1; shift; do_ timeout -k 5 $((b - 5)) "$@"; }
# What a step gets: its budget, or what is left of the call if less. SPENT: with DRY=1 the budgets
# of the steps before (the worst case), else the seconds since run.sh started.
SPENT=0
granted() {
  local v=B_${1//-/_} spent=$SPENT
  [ "${DRY:-0}" = 1 ] || spent=$((SECONDS - T0))
  local left=$((CALL_END - spent))
  echo $((${!v} < left ? ${!v} : left))
}
pack() {  # everything so far, for the files back ($OUT is emptied before each call; $R stays while warm)
  [ "${DRY:-0}" = 1 ] && return 0
  tar -czf "$OUT/results.tgz.part" -C "$R" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
}
stack() { [ -f "$G/whl/stack.env" ] && cat "$G/whl/stack.env" || cat /tmp/site/.stack.env 2>/dev/null; }
receive() {
  do_ mkdir -p /tmp/gpu-parts
  for d in ${CARRIED:-"$G"/p*}; do [ -d "$d" ] && { bound "$1" cp "$d"/part.* /tmp/gpu-parts/ || return 1; }; done; true
}
install() {
  [ -f "$G/whl/stack.env" ] || { echo "install: carry $G/whl in this call (stage.sh wrote it)" >&2; return 1; }
  eval "$(tr '\n' ' ' < "$G/whl/stack.env")"
  # /tmp lives only while the machine is warm (30 s after a call): a late call finds no earlier part.
  have=$(ls /tmp/gpu-parts/part.* 2>/dev/null | wc -l)
  [ "${DRY:-0}" = 1 ] || [ "$have" = "$PARTS" ] || {
    echo "install: $have of $PARTS parts in /tmp/gpu-parts: the machine went cold between the calls" >&2; return 1; }
  bound "$1" bash -c "mkdir -p /tmp/site && cat /tmp/gpu-parts/part.* | xz -d -T0 | tar -x -C /tmp/site &&
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/whl/*.whl &&
    cp $G/whl/stack.env /tmp/site/.stack.env"
}
probe() {
  [ "${DRY:-0}" = 1 ] && { echo "+ timeout 5 nvidia-smi; timeout -k 5 $(($1 - 10)) python3 (torch, fbgemm_gpu, torchrec, one fbgemm CUDA op)"; return 0; }
  timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$R/gpu.txt"
  eval "$(stack | tr '\n' ' ')"
  NEEDS=$NEEDS timeout -k 5 $(($1 - 10)) python3 - <<'EOF' 2>&1 | quiet | tee -a "$R/gpu.txt"
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
plan() {  # the seconds of one call's steps: each its budget, the last one at most what is left
  local used=0 i=0 step v b
  for step in "$@"; do
    i=$((i + 1)) v=B_${step//-/_} b=${!v}
    if [ $((used + b)) -gt "$CALL_END" ]; then
      [ "$i" = $# ] || fail "$step would be cut to $((CALL_END - used)) of its $b s by the call's $CALL_END s: only the last step may take what is left"
      b=$((CALL_END - used))
      [ "$b" -ge "$MIN_LAST_S" ] || fail "$step, the last step, would be left $b s of the call's $CALL_END s (at least $MIN_LAST_S)"
    fi
    used=$((used + b))
  done
  echo $used
}
sequence() {  # DRY=1 only: the calls span machines' warm windows, no one command can run them
  local last=$1 paths=$2
  [ "${DRY:-0}" = 1 ] || fail "it spans several device calls: run it with DRY=1 here, then make the calls it prints"
  [ -f "$G/whl/stack.env" ] || fail "no $G/whl/stack.env: run scripts/gpu/stage.sh first"
  eval "$(tr '\n' ' ' < "$G/whl/stack.env")"
  for path in $paths; do [ -f "$path" ] || fail "$path is missing"; done
  ls "$G"/whl/torchrec-*.whl > /dev/null 2>&1 || fail "no torchrec wheel in $G/whl"
  local tree i steps carry bytes s total=$START_S
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
  for i in $(seq 1 "$PARTS"); do
    ls "$G/p$i"/part.* > /dev/null 2>&1 || fail "$G/p$i has no part: stage again"
    steps=receive carry="\"$G/p$i\"" bytes=$((tree + $(du -cb "$G/p$i" | tail -1 | cut -f1)))
    if [ "$i" = "$PARTS" ]; then
      steps=$last carry="$carry, \"$G/whl\"" bytes=$((bytes + $(du -cb "$G/whl" | tail -1 | cut -f1)))
    fi
    [ "$bytes" -le $((64 * 1048576)) ] || fail "call $i carries $bytes bytes, over 64 MiB"
    s=$(plan $steps) || exit 1
    total=$((total + s + CALL_S))
    echo "call $i of $PARTS, timeout_s $COMMAND_S, carry [$carry] ($bytes bytes): bash scripts/gpu/run.sh $steps  (steps $s s)"
    CARRIED=$G/p$i GPU_DIR=$G bash "$self" $steps | sed 's/^/    /' || fail "call $i's dry run failed"
  done
  echo "device time: start $START_S s + steps + $CALL_S s a call = $total s of $DEVICE_S"
  [ "$total" -le "$DEVICE_S" ] || fail "$total s is over the $DEVICE_S s of device time"
  [ "$total" -le "$MAX_DEVICE_S" ] || fail "$total s is over 13 minutes ($MAX_DEVICE_S s) of device time"
}
speed() {  # seconds, then --configs C and the rest: one launch, C's JSON and Markdown
  local b=$1 config=$3; shift
  bound "$b" $BENCH --device cuda --world-size "${WORLD:-1}" --variants $SPEED_VARIANTS "$@" \
    --json "$R/speed_$config.json" --md "$R/speed_$config.md" 2>&1 | quiet | tee -a "$R/speed.log"
}
bench() {  # name, seconds, configs...
  local name=$1 limit=$2; shift 2
  do_ timeout "$limit" $BENCH --device cuda --world-size "${WORLD:-1}" --configs "$@" \
    --variants plain ours-base ours-sparse-dist ours-prefetch torchrec-base torchrec-sparse-dist torchrec-prefetch \
    --steps 100 --warmup 30 --auto-warmup 80 --rounds 3 --profile-steps 0 \
    --json "$R/$name.json" --md "$R/$name.md" 2>&1 | quiet | tee "$R/$name.log"
}
demo() {  # `make demo DEMO_NPROC=1`, as a user on one GPU types it, but for -o setup (no network here: not
  # `make setup`, the stack staged in /tmp/site) and BIN (python3 and torchrun of that stack); the summary
  # into the results. An image without make runs the recipe's commands (the tests check they are its own).
  local bin=/tmp/demo-bin make=${MAKE:-make}
  if [ "${DRY:-0}" != 1 ]; then
    mkdir -p "$bin" && printf '#!/bin/sh\nexec python3 "$@"\n' > "$bin/python" &&
      printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' > "$bin/torchrun" &&
      chmod +x "$bin/python" "$bin/torchrun" || return 1
  fi
  if command -v "$make" > /dev/null; then
    bound "$1" "$make" -o setup demo DEMO_NPROC=1 BIN="$bin" DEMO_OUT="$R/demo" 2>&1 | quiet | tee "$R/demo.log"
  else
    echo "demo: no $make here: the demo target's commands" | tee "$R/demo.log"
    bound "$1" bash -c "layout=\$($bin/python -m examples.dlrm.devices --nproc 1 --device auto) && set -- \$layout &&
      OMP_NUM_THREADS=1 $bin/torchrun --standalone --nproc_per_node=\$1 examples/dlrm/train.py --device \$2 \
      --pipeline prefetch --steps 300 --log-every 50 --eval-every 100 --compare plain \
      --summary-json $R/demo/summary.json" 2>&1 | quiet | tee -a "$R/demo.log"
  fi
}
example() {  # examples/dlrm/README.md's one-GPU command, then the plain loop on the same plan
  local launch=python3  # one rank: train.py makes a world of one itself
  [ "${WORLD:-1}" -gt 1 ] && launch="python3 -m torch.distributed.run --standalone --nproc_per_node=$WORLD"
  bound "$1" $launch examples/dlrm/train.py --device cuda --pipeline prefetch --compare plain \
    --batch-size 8192 --num-embeddings 1000000 --embedding-dim 64 --steps 200 --warmup-steps 10 \
    --no-progress --summary-json "$R/example.json" 2>&1 | quiet | tee "$R/example.log"
}
[ "${DRY:-0}" = 1 ] || echo "call at $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname): run.sh $*" >> "$R/steps.txt"
for step in "$@"; do
  b= v=B_${step//-/_}
  if [ -n "${!v}" ]; then  # a step with a budget
    b=$(granted "$step")
    if [ "$b" -lt 10 ]; then
      echo "== $step: skipped, $b s left of the call" | tee -a "$R/steps.txt"; pack; continue
    fi
  fi
  echo "== $step${b:+ ($b s)}"
  started=$SECONDS
  [ "${DRY:-0}" = 1 ] || echo "$step: started $(date -u +%H:%M:%S), budget ${b:--} s" >> "$R/steps.txt"
  case $step in
    receive) receive "$b" ;;
    install) install "$b" ;;
    probe) probe "$b" ;;
    sequence) sequence "$CHECKS" "tests/test_cuda.py tests/cuda_cases.py scripts/gpu/csan.py scripts/gpu/memory.py" ;;
    speed-sequence) sequence "$SPEED" "tests/test_cuda.py tests/cuda_cases.py scripts/gpu/memory.py
      benchmarks/__main__.py Makefile examples/dlrm/devices.py examples/dlrm/train.py" ;;
    # Tests first: the rest comes after, so a step cut at its budget loses only its own later cases
    # (each prints its line as it ends); the step that takes what is left comes last (the sanitizer in
    # `sequence`; in `speed-sequence` speed-uvm, the slowest: a late call cuts it first).
    tests) first=(); for part in "${REGRESSIONS[@]}"; do first+=(--run-first "$part"); done
           bound "$b" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py "${first[@]}" \
             --junitxml "$R/test_cuda.xml" 2>&1 | quiet | tee "$R/test_cuda.log" ;;
    csan) bound "$b" python3 scripts/gpu/csan.py --timeout "$((b - 10))" 2>&1 | quiet | tee "$R/csan_full.log" | { grep -E "^CSAN|^\+ |fbgemm::|aten::|argument" || true; } | tee "$R/csan.log" ;;
    memory) bound "$b" python3 scripts/gpu/memory.py --config gpu-large --steps 10 --json "$R/memory.json" 2>&1 | quiet | tee "$R/memory.log" ;;
    speed) speed "$b" $SPEED_BUSY ;;
    speed-uvm) speed "$b" $SPEED_UVM ;;
    handoffs) bound "$b" python3 scripts/gpu/memory.py --config gpu-large --steps 10 --classes $HANDOFFS --check \
                --json "$R/handoffs.json" 2>&1 | quiet | tee "$R/handoffs.log" ;;
    demo) demo "$b" ;;
    example) example "$b" ;;
    smoke) do_ timeout 120 python3 -m pytest -q -x -p no:cacheprovider "tests/test_cuda.py::test_hbm_kernel_bitwise_equal[TrainPipelineSparseDist-dlrm-table_wise]" 2>&1 | quiet | tee "$R/smoke.log" ;;
    bench) bench bench_cuda 540 demo input-dist-heavy compute-heavy ;;
    uvm) bench bench_uvm 420 tiered tiered-skewed ;;
    large) bench bench_large 480 gpu-large gpu-uvm ;;
  esac
  rc=$?
  SPENT=$((SPENT + ${b:-0}))
  [ "${DRY:-0}" = 1 ] || echo "$step: exit $rc after $((SECONDS - started)) s" | tee -a "$R/steps.txt"
  pack
  case $step:$rc in receive:[1-9]*|install:[1-9]*|smoke:[1-9]*) exit 1 ;; probe:[1-9]*) exit 3 ;; esac
done
