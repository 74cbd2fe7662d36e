#!/bin/bash
# Stage, for the GPU machine, the fbgemm-gpu and torchrec built for the image's own torch: the machine
# has torch (2.11.0+cu130 when last seen) but neither of them, no package index, and takes 64 MiB per
# call with the working tree. Run here, from the repository root:
#   bash scripts/gpu/stage.sh [--image-torch X.Y.Z] [--dry-run]
# The pinned torch does not travel: pruned and packed it would be several hundred MB, many calls more
# than 15 minutes of device time allow, so the stack there is the release built for the image's torch
# (fbgemm's compat table, read from the fbgemm installed here; off the Makefile's pins). Writes,
# git-ignored:
#   .gpu/p1 .. .gpu/pN  fbgemm-gpu with only sm_90 machine code (scripts/gpu/prune_fatbin.py), as one
#                       tar.xz cut in the fewest equal parts that fit a call (the last with .gpu/whl)
#   .gpu/whl            torchrec and its pure-Python needs, and stack.env (what was staged)
# and prints the device calls (scripts/gpu/run.sh's sequence).
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
DRY=0 IMAGE_TORCH=${IMAGE_TORCH:-2.11.0}
while [ $# -gt 0 ]; do
  case $1 in
    --image-torch) IMAGE_TORCH=${2:?--image-torch needs a version}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "stage.sh: unknown argument $1" >&2; usage 2 >&2 ;;
  esac
done
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-python3}
here=scripts/gpu
eval "$($PY $here/pins.py --makefile "${MAKEFILE:-Makefile}" --format shell)"
table=$($PY -c "import importlib.util as u; print(u.find_spec('fbgemm_gpu').origin)" 2>/dev/null) ||
  { echo "stage.sh: $PY has no fbgemm_gpu, whose table names the fbgemm of a torch: PY=.venv/bin/python" >&2; exit 1; }
minor=$($PY $here/pins.py --fbgemm-init "$table" --torch "$IMAGE_TORCH")
echo "pins: torch=$TORCH fbgemm=$FBGEMM torchrec=$TORCHREC; image torch $IMAGE_TORCH: fbgemm-gpu~=$minor.0, torchrec~=$minor.0"
[ "$DRY" = 1 ] && exit 0
work=${WORK:-/tmp/gpu-stage}
pip_get() {  # destination, requirement: a CPython 3.12 x86-64 wheel, as the image's python is
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$1" "$2"
}
mkdir -p "$work/dl" .gpu
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && { grep -qxF "/.gpu/" "$exclude" 2>/dev/null || echo "/.gpu/" >> "$exclude"; }
pip_get "$work/dl" "fbgemm-gpu~=$minor.0"
wheel=$(find "$work/dl" -name "fbgemm_gpu-$minor.*-*.whl" | sort -V | tail -1)
FBGEMM=$(basename "$wheel" | cut -d- -f2)
NEEDS=$($PY $here/pins.py --fbgemm-init "$table" --fbgemm "$FBGEMM")  # a wheel's own table lacks itself
rm -rf "$work/site" && mkdir -p "$work/site" && unzip -q -o "$wheel" -d "$work/site"
find "$work/site" -name "*.so*" -type f -exec $PY $here/prune_fatbin.py prune 90 {} + | grep -v "zeroed 0 MB" || true
(cd "$work/site" && tar -cf - .) | xz -T0 -6 > "$work/stack.tar.xz"  # -T0: blocks xz -d unpacks in parallel
rm -rf .gpu/p[0-9]* .gpu/whl && mkdir -p .gpu/whl "$work/parts" && rm -f "$work"/parts/part.*
for req in "torchrec~=$minor.0" "torchmetrics==1.0.3" "tensordict==0.15.3" "iopath==0.1.9" "pyvers>=0.2,<0.3"; do
  pip_get .gpu/whl "$req"
done
# The fewest equal parts, each inside what a call carries with the working tree (64 MiB less 1 MiB of
# margin for files added before the calls); the last one carries the wheels too.
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
whl=$(du -cb .gpu/whl | tail -1 | cut -f1)
room=$((64 * 1048576 - tree - 1048576))
total=$(stat -c %s "$work/stack.tar.xz")
n=$(((total + room - 1) / room))
[ $(((total + n - 1) / n + whl)) -le "$room" ] || n=$((n + 1))
split -a 3 -b $(((total + n - 1) / n)) "$work/stack.tar.xz" "$work/parts/part."
n=0
for part in "$work"/parts/part.*; do n=$((n + 1)); mkdir -p ".gpu/p$n"; cp "$part" ".gpu/p$n/"; done
TORCHREC=$(find .gpu/whl -name "torchrec-*.whl" | head -1 | xargs basename | cut -d- -f2)
cat > .gpu/whl/stack.env <<EOF
TORCH=$IMAGE_TORCH FBGEMM=$FBGEMM TORCHREC=$TORCHREC
NEEDS=$NEEDS PARTS=$n
EOF
du -b .gpu/p*/part.* .gpu/whl
echo "staged: $(head -1 .gpu/whl/stack.env); $n part(s) of $total bytes in all"
DRY=1 bash $here/run.sh sequence
