#!/usr/bin/env bash
# Issue 13's targets on one GPU, vidgen beside diffusers 0.42.1 in the same call, on the same published configs
# (vidgen's synthetic: models; bench/peer_wan_family.py builds diffusers' pipelines from assets/ with random
# weights on the device). Default flags everywhere on vidgen's side; CFG 5; few steps.
#   a14b  synthetic:wan2.2-t2v-a14b 480x832x81, 4 steps (two per expert): the DiT's first expert resident vs
#         default streaming in one process (offload_bench, 1 warm-up + 2 forwards each), then the CLI with
#         default flags (denoise peaks per expert, expert switch, s/step); diffusers: both experts resident.
#   ti2v  synthetic:wan2.2-ti2v-5b at its default 704x1280x121, 3 steps, CLI default flags; diffusers: the
#         transformer under enable_group_offload(block_level, num_blocks_per_group=1, use_stream=True).
#   i2v   synthetic:wan2.1-i2v-14b-480p 480x832x81 from one image, 2 steps, the whole video, CLI default flags
#         (twice: the second process finds the driver's kernel cache warm);
#         diffusers: WanImageToVideoPipeline resident.
# a14b and ti2v stop at the latents on both sides (vidgen --output-type latent, diffusers output_type="latent");
# i2v makes the whole video (vidgen writes safetensors frames to /dev/shm, deleted after).
#
#   OUT=... bash bench/wan_family.sh [a14b] [ti2v] [i2v]      # all three: one call, ~8 min on an H200
#   A14B_RESIDENT=1 adds the A14B pipeline with every component resident (vidgen's resident s/step, ~100 s)
#   QUICK=1 OUT=/tmp/wf bash bench/wan_family.sh              # CPU smoke test: tiny fixtures, target/debug binaries
# Needs .device/vidgen and .device/offload_bench (CUDA builds, or .xz of them) and the diffusers wheel in .whl
# (../shared/peer/README.md). Writes $OUT/<part>-vidgen.{json,log}, $OUT/a14b-dit.jsonl, $OUT/peer-<part>/
# results.json and $OUT/wan-family.md (bench/wan_family.py).
set -u
OUT=${OUT:-/tmp/vidgen-bench}
PARTS=${*:-a14b ti2v i2v}
mkdir -p "$OUT"
VIDEOS=/dev/shm/wan-family-videos
mkdir -p $VIDEOS
PROMPT="a red fox runs through fresh snow at dawn, cinematic"
if [ -n "${QUICK:-}" ]; then
  V=${VIDGEN:-target/debug/vidgen}; B=${OFFLOAD_BENCH:-target/debug/examples/offload_bench}
  FIX=${FIXTURES:-../shared/fixtures}
  DEVICE=cpu; PEER_FLAGS=--quick; PYTHON=${PYTHON:-python3}
else
  V=./.device/vidgen; B=./.device/offload_bench
  for f in $V $B; do [ -f $f.xz ] && xz -dc $f.xz > $f && chmod +x $f; done
  DEVICE=cuda; PEER_FLAGS=; PYTHON=python3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  free -g | head -2
  export PATH=/opt/torch/.venv/bin:$PATH
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
    export PYTHONPATH=/tmp/site
  fi
fi
$PYTHON bench/peer_wan_family.py --write-image "$OUT/input.png"

# Steps that would start after BUDGET seconds are skipped, so the table is still made inside the call's limit.
BUDGET=${BUDGET:-480}
late() { if [ $SECONDS -gt $BUDGET ]; then echo "== skipped $1: ${SECONDS}s > BUDGET ${BUDGET}s"; return 0; fi; return 1; }
# vidgen's CLI, default flags: NAME, the output type, then the model's arguments.
gen() {
  local name=$1 type=$2; shift 2
  late "vidgen $name" && return
  /usr/bin/time -v $V generate "$@" --prompt "$PROMPT" --negative-prompt "" --guidance-scale 5 --seed 1 \
    --device $DEVICE --output-type $type --output-path $VIDEOS --output-video-name "$name" --overwrite \
    --stats-json "$OUT/$name-vidgen.json" > "$OUT/$name-vidgen.log" 2>&1
  echo "== vidgen $name: exit $? at ${SECONDS}s"
  grep -E "loaded |freed |offload:|transformer forwards|Maximum resident|Elapsed|rror" "$OUT/$name-vidgen.log" | tail -20
  rm -rf "$VIDEOS/$name".*safetensors
}
peer() {
  late "diffusers $1" && return
  $PYTHON bench/peer_wan_family.py $PEER_FLAGS --models "$1" --out "$OUT/peer-$1" > "$OUT/peer-$1.log" 2>&1
  echo "== diffusers $1: exit $? at ${SECONDS}s"; grep -E "Error|error" "$OUT/peer-$1.log" | tail -3
}
model() { # part -> vidgen --model and its size arguments
  if [ -n "${QUICK:-}" ]; then
    case $1 in
      a14b) echo "--model $FIX/wan22-a14b-tiny-a --height 32 --width 32 --num-frames 9 --max-sequence-length 20" ;;
      ti2v) echo "--model $FIX/wan22-ti2v-tiny-a --height 64 --width 64 --num-frames 5 --max-sequence-length 20" ;;
      i2v) echo "--model $FIX/wan21-i2v-tiny-a --height 32 --width 48 --num-frames 9" ;;
    esac
  else
    case $1 in
      a14b) echo "--model synthetic:wan2.2-t2v-a14b" ;;
      ti2v) echo "--model synthetic:wan2.2-ti2v-5b" ;;
      i2v) echo "--model synthetic:wan2.1-i2v-14b-480p" ;;
    esac
  fi
}

for P in $PARTS; do
  case $P in
    a14b)
      # The first expert's forward, resident and streamed, in one process; the weights written once to /dev/shm.
      if [ -n "${QUICK:-}" ]; then M=$FIX/wan22-a14b-tiny-a; S=9x32x32; else M=synthetic:wan2.2-t2v-a14b; S=81x480x832; fi
      late "offload_bench a14b" || VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench /usr/bin/time -v $B $M 2 $S \
        "resident: --dit-layerwise-offload=false --dit-cpu-offload=false" "default: " \
        > "$OUT/a14b-dit.jsonl" 2> "$OUT/a14b-dit.log"
      echo "== offload_bench a14b: exit $? at ${SECONDS}s"; grep -E "Maximum resident|Elapsed|rror" "$OUT/a14b-dit.log"
      rm -rf /dev/shm/vidgen-bench
      gen a14b latent $(model a14b) --num-inference-steps 4
      # Optional (~100 s more): the whole pipeline resident, for vidgen's resident s/step.
      [ -n "${A14B_RESIDENT:-}" ] && gen a14b-resident latent $(model a14b) --num-inference-steps 4 \
        --no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload
      peer a14b ;;
    ti2v)
      gen ti2v latent $(model ti2v) --num-inference-steps 3
      peer ti2v ;;
    i2v)
      gen i2v safetensors $(model i2v) --image "$OUT/input.png" --num-inference-steps 2
      # Again in a second process: what the first run paid once per machine (the driver compiling
      # the PTX kernels into its cache, cuDNN's runtime-compiled engines) is then already paid.
      gen i2v-again safetensors $(model i2v) --image "$OUT/input.png" --num-inference-steps 2
      peer i2v ;;
    *) echo "unknown part $P (a14b, ti2v, i2v)" ;;
  esac
done
rm -rf $VIDEOS
$PYTHON bench/wan_family.py "$OUT" | tee "$OUT/wan-family.md"
