#!/bin/bash
# Stage the pinned CUDA stack for the GPU machine, which has its own torch (2.11.0+cu130 when last
# seen), no fbgemm-gpu or torchrec, no package index, and takes at most 64 MiB per call (docs/gpu.md).
# Run here, from the repository root:
#   bash scripts/gpu/stage.sh [--stack V] [--for-image] [--image-torch X.Y.Z] [--dry-run]
# The stack is the Makefile's (scripts/gpu/pins.py; --stack picks one of its STACK_<V> lines;
# MAKEFILE=path reads another Makefile).
# fbgemm-gpu is built for one torch (its compat table): when that is not the image's torch, the
# pinned torch is staged too. --for-image stages instead the fbgemm and torchrec built for the
# image's torch (nothing of torch travels; a fallback, off the pins). Writes, git-ignored:
#   .gpu/p1 .. .gpu/pN  the CUDA packages (fbgemm-gpu, torch when staged) with only sm_90 machine
#                       code (scripts/gpu/prune_fatbin.py), as one tar.xz cut in equal parts of at
#                       most 60 MB (PART_BYTES; one a call, which carries 64 MiB with the working
#                       tree; the last one carries the wheels too)
#   .gpu/whl            torchrec and its pure-Python needs, and stack.env (what was staged)
# and prints the device calls to make.
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
STACK_ARG="" FOR_IMAGE=0 DRY=0 IMAGE_TORCH=${IMAGE_TORCH:-2.11.0} PART_BYTES=${PART_BYTES:-60000000}
while [ $# -gt 0 ]; do
  case $1 in
    --stack) STACK_ARG=${2:?--stack needs a version}; shift 2 ;;
    --for-image) FOR_IMAGE=1; shift ;;
    --image-torch) IMAGE_TORCH=${2:?--image-torch needs a version}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "stage.sh: unknown argument $1" >&2; usage 2 >&2 ;;
  esac
done
root=$(git rev-parse --show-toplevel)
cd "$root"
PY=${PY:-python3}
here=$(dirname "$0")
eval "$($PY "$here/pins.py" --makefile "${MAKEFILE:-Makefile}" --format shell ${STACK_ARG:+--stack "$STACK_ARG"})"
work=${WORK:-/tmp/gpu-stage}
pip_get() {  # destination, requirement: a CPython 3.12 x86-64 wheel, as the image's python is
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$1" "$2"
}
if [ "$DRY" = 1 ]; then
  echo "pins: torch=$TORCH fbgemm=$FBGEMM torchrec=$TORCHREC (stack $STACK); image torch $IMAGE_TORCH"
  echo "would download fbgemm-gpu==$FBGEMM, read the torch it needs, stage torch==$TORCH unless the image has it"
  [ "$FOR_IMAGE" = 1 ] && echo "--for-image: fbgemm and torchrec built for torch $IMAGE_TORCH instead, no torch"
  exit 0
fi
mkdir -p "$work/dl" .gpu
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && { grep -qxF "/.gpu/" "$exclude" 2>/dev/null || echo "/.gpu/" >> "$exclude"; }
fbgemm_init() {  # the compat table of the fbgemm wheel of version $1: its __init__.py
  unzip -p "$work"/dl/fbgemm_gpu-"$1"-*.whl fbgemm_gpu/__init__.py > "$work/fbgemm_init_$1.py"
  echo "$work/fbgemm_init_$1.py"
}
if [ "$FOR_IMAGE" = 1 ]; then  # the table of the fbgemm installed here knows the older releases
  table=$($PY -c "import importlib.util as u; print(u.find_spec('fbgemm_gpu').origin)")
  minor=$($PY "$here/pins.py" --fbgemm-init "$table" --torch "$IMAGE_TORCH")
  pip_get "$work/dl" "fbgemm-gpu~=$minor.0"
  FBGEMM=$(find "$work/dl" -name "fbgemm_gpu-$minor.*-*.whl" | sort -V | tail -1 | xargs basename | cut -d- -f2)
  TORCHREC_REQ="torchrec~=$minor.0" STACK="image" TORCH=$IMAGE_TORCH
else
  pip_get "$work/dl" "fbgemm-gpu==$FBGEMM"
  TORCHREC_REQ="torchrec==$TORCHREC"
fi
NEEDS=$($PY "$here/pins.py" --fbgemm-init "$(fbgemm_init "$FBGEMM")" --fbgemm "$FBGEMM")
case $TORCH in
  "$NEEDS"*) ;;
  *) echo "stage.sh: the Makefile pins torch $TORCH, but fbgemm-gpu $FBGEMM is built for torch $NEEDS" >&2
     exit 1 ;;
esac
STAGE_TORCH=0
case $IMAGE_TORCH in "$NEEDS"*) ;; *) STAGE_TORCH=1 ;; esac
rm -rf "$work/site" && mkdir -p "$work/site"
unzip -q -o "$work"/dl/fbgemm_gpu-"$FBGEMM"-*.whl -d "$work/site"
if [ "$STAGE_TORCH" = 1 ]; then
  pip_get "$work/dl" "torch==$TORCH"
  unzip -q -o "$work"/dl/torch-"$TORCH"-*.whl -d "$work/site"
fi
find "$work/site" -name "*.so*" -type f -exec $PY "$here/prune_fatbin.py" prune 90 {} + | grep -v "zeroed 0 MB" || true
(cd "$work/site" && tar -cf - .) | xz -T0 -6 > "$work/stack.tar.xz"
rm -rf .gpu/p[0-9]* .gpu/whl && mkdir -p .gpu/whl "$work/parts" && rm -f "$work"/parts/part.*
for req in "$TORCHREC_REQ" "torchmetrics==1.0.3" "tensordict==0.15.3" "iopath==0.1.9" "pyvers>=0.2,<0.3"; do
  pip_get .gpu/whl "$req"
done
# Parts of equal size, none over PART_BYTES, the last one with the wheels inside what a call carries
# (64 MiB with the working tree measured here, less 1 MiB of margin).
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
whl=$(du -cb .gpu/whl | tail -1 | cut -f1)
budget=$((64 * 1048576 - tree - 1048576))
total=$(stat -c %s "$work/stack.tar.xz")
n=$(((total + PART_BYTES - 1) / PART_BYTES))
[ $(((total + n - 1) / n + whl)) -le "$budget" ] || n=$((n + 1))
size=$(((total + n - 1) / n))
[ "$size" -le "$budget" ] || { echo "stage.sh: a part of $size bytes with a working tree of $tree does not fit in 64 MiB" >&2; exit 1; }
split -a 3 -b "$size" "$work/stack.tar.xz" "$work/parts/part."
n=0
for part in "$work"/parts/part.*; do n=$((n + 1)); mkdir -p ".gpu/p$n"; cp "$part" ".gpu/p$n/"; done
TORCHREC=$(find .gpu/whl -name "torchrec-*.whl" | head -1 | xargs basename | cut -d- -f2)
cat > .gpu/whl/stack.env <<EOF
TORCH=$TORCH FBGEMM=$FBGEMM TORCHREC=$TORCHREC STACK=$STACK
NEEDS=$NEEDS STAGE_TORCH=$STAGE_TORCH PARTS=$n
EOF
du -sh .gpu/p* .gpu/whl
echo
echo "staged: $(head -1 .gpu/whl/stack.env); torch needed $NEEDS, staged: $STAGE_TORCH; $n part(s)"
echo "device calls, timeout_s 600, one right after the other (the machine goes back 30 s after a call"
echo "and /tmp with it; scripts/gpu/README.md):"
for i in $(seq 1 $((n - 1))); do
  echo "  call $i, carry [\".gpu/p$i\"]:  bash scripts/gpu/run.sh receive"
done
echo "  call $n, carry [\".gpu/p$n\", \".gpu/whl\"]:  bash scripts/gpu/run.sh install probe tests"
echo "  call $((n + 1)):  bash scripts/gpu/run.sh csan"
echo "  call $((n + 2)):  bash scripts/gpu/run.sh memory"
