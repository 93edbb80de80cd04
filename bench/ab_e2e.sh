#!/usr/bin/env bash
# Two vidgen builds on one machine, alternating, on whole 4-step videos (bench/family_e2e.py --fewstep
# --skip-diffusers: the same random checkpoint, read from the page cache; stamped stderr of every run):
# what a change to loading, releasing or tearing down does, with the clocks and caches of one call.
# From the repository root on the GPU machine, carrying .device (vidgen.xz and vidgen-old.xz: the CUDA
# builds of the change and of its base) and .whl (the diffusers wheel, which writes the checkpoint):
#   bash bench/ab_e2e.sh                       # Wan2.1 1.3B twice, then 14B once (~5 min)
# Env: OUT (default /tmp/vidgen-ab), FAMILIES ("wan2.1-t2v-1.3b:2 wan2.1-t2v-14b:1": family:repetitions),
# MODES (fast-resident,fast). Prints one table row per run, prefixed "old N" / "new N".
set -u
OUT=${OUT:-/tmp/vidgen-ab}
for b in vidgen vidgen-old; do
  [ -f .device/$b.xz ] && xz -dc .device/$b.xz > .device/$b && chmod +x .device/$b
done
export PATH=/opt/torch/.venv/bin:$PATH
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site
fi
for spec in ${FAMILIES:-wan2.1-t2v-1.3b:2 wan2.1-t2v-14b:1}; do
  F=${spec%%:*}; reps=${spec##*:}
  ROOT=/dev/shm/vidgen-e2e; [ "$F" = wan2.1-t2v-14b ] && ROOT=/tmp/vidgen-e2e
  for rep in $(seq "$reps"); do for b in old new; do
    bin=.device/vidgen; [ $b = old ] && bin=.device/vidgen-old
    python3 bench/family_e2e.py --family "$F" --fewstep --skip-diffusers --vidgen $bin \
      --out "$OUT/$F-$b-$rep" --ckpt-root $ROOT --vidgen-modes "${MODES:-fast-resident,fast}" 2>&1 |
      grep "^| $F" | sed "s/^/$b $rep /"
  done; done
  rm -rf "${ROOT:?}/$F"
done
