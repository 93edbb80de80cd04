#!/usr/bin/env bash
# One whole video per family, vidgen beside diffusers 0.42.1 in the same call on the GPU machine
# (bench/family_e2e.py: each family's full-size random checkpoint written once in the diffusers layout,
# diffusers resident on the GPU, vidgen with its default flags and everything resident; 4 steps, bf16, the
# pipeline's default size). From the repository root, carrying .device (vidgen or vidgen.xz: the CUDA build)
# and .whl (the diffusers 0.42.1 wheel, ../shared/peer/README.md):
#   bash bench/family_e2e.sh wan2.1-t2v-1.3b ltx-video latte-1      # one call
# Rough device time per family on an H200 (not yet measured; write + diffusers + vidgen default + resident,
# plus about 20 s of start-up per call):
#   wan2.1-t2v-1.3b  (81x480x832, 14.7 GB checkpoint)    ~1.5 min
#   wan2.1-t2v-14b   (81x480x832, 40 GB, on disk)        ~2.5 min (write 47-51 s; with --fewstep, session 29)
#   ltx-video        (161x512x704, 15.2 GB)              ~1.5 min
#   latte-1          (16x512x512, 11.8 GB)               ~1.5 min
#   cogvideox-5b     (49x480x720, 21.1 GB)               ~2.5 min
#   mochi-1          (19x480x848, 30.5 GB)               ~3 min
#   flux.1-dev       (1024x1024 image, 33.7 GB, on disk) ~3 min
#   allegro          (88x720x1280, 15.4 GB)              ~4-5 min (79k tokens, CFG batch 2; diffusers' tiled decode)
#   hunyuanvideo     (129x720x1280, 41.4 GB, on disk)    ~7-8 min (~23 s a step in each of 3 runs); alone,
#                                                         MODES=default if the call's 10 minutes run short
# So four calls: "wan2.1-t2v-1.3b ltx-video latte-1", "cogvideox-5b mochi-1", "flux.1-dev allegro",
# "hunyuanvideo". The device has 128 GiB of RAM and a 64 GiB disk: checkpoints up to SHM_MAX_GB (32) go to
# /dev/shm, where they sit beside both programs' host memory (vidgen's default flags pin about the DiT and
# text encoder: the checkpoint's size again); bigger ones (FLUX.1, HunyuanVideo) to /tmp on disk, read back
# from the page cache that writing them filled (caches cannot be dropped there, so nothing is read cold).
# Issue 36's fast videos run bench/family_e2e.py itself with --fewstep (and --lora, --skip-diffusers), e.g.
#   python3 bench/family_e2e.py --family wan2.1-t2v-14b --fewstep --vidgen V --out O --ckpt-root /tmp/vidgen-e2e \
#     --vidgen-modes fast,fast-resident,default
# Env: OUT (results, default /tmp/vidgen-e2e-out), STEPS, MODES (vidgen modes: default,resident), REPS
# (diffusers calls after its one load), KEEP=1 keeps each checkpoint, CKPT_ROOT forces one root, QUICK=1 runs
# the CPU smoke test (tiny fixture configs) instead.
# Writes $OUT/<family>.json, $OUT/<family>.log, vidgen's logs and stats; prints the table.
set -u
OUT=${OUT:-/tmp/vidgen-e2e-out}
mkdir -p "$OUT"
B=./.device/vidgen
[ -f $B.xz ] && xz -dc $B.xz > $B && chmod +x $B
export PATH=/opt/torch/.venv/bin:$PATH
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /dev/shm /tmp | tail -n +2
# Checkpoint sizes in GB (bf16; Wan's VAE f32), from the published configs.
declare -A SIZE=([wan2.1-t2v-1.3b]=15 [wan2.1-t2v-14b]=41 [ltx-video]=16 [latte-1]=12 [cogvideox-5b]=22 [mochi-1]=31
  [flux.1-dev]=34 [allegro]=16 [hunyuanvideo]=42)
for F in "$@"; do
  [ -n "${SIZE[$F]:-}" ] || { echo "unknown family $F (one of ${!SIZE[*]})"; continue; }
  if [ "${SIZE[$F]}" -le "${SHM_MAX_GB:-32}" ]; then ROOT=/dev/shm/vidgen-e2e; else ROOT=/tmp/vidgen-e2e; fi
  ROOT=${CKPT_ROOT:-$ROOT}
  echo "== $F: checkpoint in $ROOT/$F"
  python3 bench/family_e2e.py --family "$F" --vidgen "$B" --out "$OUT" --ckpt-root "$ROOT" \
    ${STEPS:+--steps $STEPS} ${MODES:+--vidgen-modes $MODES} ${REPS:+--reps $REPS} ${QUICK:+--quick} \
    > "$OUT/$F.log" 2>&1
  echo "== $F: exit $?"
  grep -E "checkpoint|differ|failed|frames vs diffusers:|Error" "$OUT/$F.log" | cut -c1-400
  [ -n "${KEEP:-}" ] || rm -rf "${ROOT:?}/$F" "${ROOT:?}/$F"-*
done
python3 bench/family_e2e.py --table "$OUT" | tee "$OUT/family-e2e.md"
