#!/bin/bash
# Stage the CUDA stack for a GPU machine that has torch 2.11 (cu130) but no fbgemm-gpu or torchrec,
# and takes uploads of at most 64 MiB per call (docs/gpu.md). Run here, from the repository root:
#   bash scripts/gpu/stage.sh
# Writes (all git-ignored through .git/info/exclude):
#   .whl/  torchrec 1.6.1 and the pure-Python packages it needs (~2.6 MB)
#   .fb1/  part.aa of fbgemm-gpu 1.6.0 with only sm_90 code, tar.xz (56 MB)
#   .fb2/  part.ab (27 MB) and run.sh, the device-side script
# Then: device run with carry [".fb1"]: `mkdir -p /tmp/fb && cp .fb1/part.* /tmp/fb/`, and at once
# (while the machine is warm) carry [".fb2", ".whl"]: `bash .fb2/run.sh smoke tests bench uvm large csan`.
set -euo pipefail
root=$(pwd)
work=${WORK:-/tmp/gpu-stage}
pip_get() {
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "$2"
}
mkdir -p "$work" .git/info .whl .fb1 .fb2
for p in /.whl/ /.fb1/ /.fb2/; do grep -qxF "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
for p in torchrec==1.6.1 tensordict==0.15.3 iopath==0.1.9 torchmetrics==1.0.3 "pyvers>=0.2,<0.3"; do
  pip_get .whl "$p"
done
[ -f "$work"/fbgemm_gpu-1.6.0-*.whl ] 2>/dev/null || pip_get "$work" fbgemm-gpu==1.6.0
rm -rf "$work/unpacked" && mkdir -p "$work/unpacked" && cd "$work/unpacked"
unzip -q "$work"/fbgemm_gpu-1.6.0-*.whl
find fbgemm_gpu -name "*.so" -exec python3 "$root/scripts/gpu/prune_fatbin.py" prune 90 {} +
tar -cf - fbgemm_gpu fbgemm_gpu-1.6.0.dist-info | xz -T0 -6 > "$work/fbgemm90.tar.xz"
cd "$root"
rm -f .fb1/part.* .fb2/part.*
split -b 56000000 "$work/fbgemm90.tar.xz" .fb1/part.
mv .fb1/part.a[b-z] .fb2/
cp scripts/gpu/run.sh .fb2/run.sh
ls -la .whl .fb1 .fb2
