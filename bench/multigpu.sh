#!/usr/bin/env bash
# Issue 12's targets on one machine with two H200s, in one device call (about 9 minutes):
#   1. sequence-parallel frames against one GPU's on the tiny fixture in f32 (target: max |diff| <= 1e-5);
#   2. synthetic Wan2.1 1.3B and 14B at 480x832x81 bf16, resident, CFG 5, 2 steps: s/forward on one GPU
#      and with --num-gpus 2 --sp-size 2 (targets: 14B >= 1.85x, 1.3B >= 1.6x), per-GPU peaks;
#   3. 4 prompts (1.3B, 480x832x81, 4 steps) on one GPU and on two with --sp-size 1 (target: wall <= 0.55x);
#   4. a killed rank: every process gone within 30 s, no output under its final name;
#   5. FSDP, 14B on 2 GPUs, 2 steps: per-GPU DiT weights and peak, s/forward against the same run without
#      FSDP (targets: weights <= 14.7 GiB + two blocks, step <= 1.03x; with --dit-cpu-offload: peak <= 4 GiB,
#      step <= 1.05x), frames bit-identical; and the dry run's plan of the same runs (the gathers run a block
#      ahead on a stream of their own: compare s/forward of "fsdp" and "fsdp-host" with "plain");
#   6. sequence-parallel groups: 4 ranks in 2 groups of 2 on the 2 GPUs (launched as two simulated nodes, so
#      ranks 0,1 and 2,3 each use GPUs 0,1), tiny fixture in f32, a 3-prompt file: every video within 1e-5 of
#      one GPU's, the group leaders (ranks 0 and 2) alone load the text encoder and the VAE and print paths.
# What issue 12's second round added is measured by PARTS="1 5 6" (about 5 minutes).
# Run from the repository root on the GPU machine with the nccl build at .device/vidgen
# (source ../shared/gpu/cuda-env.sh; LIBRARY_PATH=<nvidia-nccl-cu13 wheel>/nvidia/nccl/lib
#  cargo build --release --features nccl; copy target/cuda/release/vidgen to .device/).
# PARTS="1 2" (default: all five) runs some sections, to split the table over two calls if needed.
set -u
want() { [[ " ${PARTS:-1 2 3 4 5 6} " == *" $1 "* ]]; }
B=${B:-./.device/vidgen}
OUT=${OUT:-/tmp/vidgen-multigpu}
mkdir -p "$OUT"
# libnccl.so.2 of the image's PyTorch (the binary links it dynamically).
for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

if want 1; then
echo "== 1. tiny fixture, f32: one GPU vs two (sequence parallel)"
TINY="--model tests/fixtures/wan-tiny-a --prompt x --seed 1 --height 32 --width 32 --num-frames 9
  --num-inference-steps 3 --max-sequence-length 16 --device cuda --dtype f32 --output-type safetensors
  --output-path $OUT/tiny --overwrite"
$B generate $TINY --output-video-name one > /dev/null 2> "$OUT/tiny-one.log" || tail -3 "$OUT/tiny-one.log"
timeout 300 $B generate $TINY --num-gpus 2 --output-video-name two > /dev/null 2> "$OUT/tiny-two.log" \
  || tail -5 "$OUT/tiny-two.log"
python3 - "$OUT/tiny/one.safetensors" "$OUT/tiny/two.safetensors" <<'PY'
import sys, numpy as np
from safetensors.numpy import load_file
try:
    a, b = (load_file(p)["frames"] for p in sys.argv[1:3])
    d = float(np.abs(a - b).max())
    print(f"frames {a.shape}: max |one - two| = {d:.3g} ({'met' if d <= 1e-5 else 'NOT met'}: <= 1e-5)")
except Exception as e:
    print("no comparison:", e)
PY

fi

RESIDENT="--no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
forward() { # stats.json -> mean s/forward (the first forward of a run is left out: warm-up)
  python3 -c "import json,sys; f=json.load(open(sys.argv[1]))['jobs'][0]['metrics']['forward_seconds']; f=f[1:] or f; print(f'{sum(f)/len(f):.3f}')" "$1" 2>/dev/null || echo nan
}
want 2 && for m in 1.3b 14b; do
  for g in 1 2; do
    echo "== 2. $m on $g GPU(s)"
    /usr/bin/time -f "wall %e s" timeout 420 $B generate --model synthetic:wan2.1-t2v-$m --prompt "a red fox runs through fresh snow" \
      --seed 1 --num-inference-steps 2 --guidance-scale 5 --device cuda --dtype bf16 $RESIDENT --num-gpus $g \
      --output-type safetensors --output-path "$OUT/$m-$g" --overwrite --stats-json "$OUT/$m-$g.json" \
      > /dev/null 2> "$OUT/$m-$g.log"
    echo "exit $?; s/forward $(forward "$OUT/$m-$g.json")"; grep -E "wall|error" "$OUT/$m-$g.log" | tail -3
    python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['jobs'][0]['metrics']['stages']; print({k: round(v['device_used_peak']/2**30,2) for k,v in s.items() if 'device_used_peak' in v}, 'GiB (rank 0)')" "$OUT/$m-$g.json" 2>/dev/null
  done
  python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); t=1.85 if sys.argv[3]=='14b' else 1.6; print(f'$m speed-up {a/b:.2f}x (target >= {t}x: {\"met\" if a/b>=t else \"NOT met\"})')" \
    "$(forward "$OUT/$m-1.json")" "$(forward "$OUT/$m-2.json")" $m 2>/dev/null
done

if want 3; then
echo "== 3. 4 prompts, 1.3B, one GPU vs two with --sp-size 1"
printf 'a red fox in the snow\na cat on a roof\na boat at sea\na city at night\n' > "$OUT/prompts.txt"
for g in 1 2; do
  S=$(date +%s.%N)
  timeout 500 $B generate --model synthetic:wan2.1-t2v-1.3b --prompt-file "$OUT/prompts.txt" --seed 1 \
    --num-inference-steps 4 --device cuda --dtype bf16 $RESIDENT --num-gpus $g --sp-size 1 --output-type safetensors \
    --output-path "$OUT/pp-$g" --overwrite > "$OUT/pp-$g.stdout" 2> "$OUT/pp-$g.log"
  echo "$g GPU(s): exit $?, $(wc -l < "$OUT/pp-$g.stdout") paths, wall $(python3 -c "import time; print(round(time.time()-$S,1))") s"
  grep -E "done:|error" "$OUT/pp-$g.log" | tail -3
done

fi

if want 4; then
echo "== 4. a killed rank (1.3B, 2 GPUs, 20 steps): rank 1 is killed once the denoise runs"
rm -rf "$OUT/kill"
$B generate --model synthetic:wan2.1-t2v-1.3b --prompt "a red fox" --seed 1 --num-inference-steps 20 --device cuda \
  --dtype bf16 $RESIDENT --num-gpus 2 --output-path "$OUT/kill" --output-video-name killed > /dev/null 2> "$OUT/kill.log" &
SUP=$!
for _ in $(seq 240); do grep -q "rank 1: .*denoise" "$OUT/kill.log" 2>/dev/null && break; sleep 0.5; done
W1=$(for p in $(pgrep -P $SUP); do tr '\0' '\n' < /proc/$p/environ | grep -qx RANK=1 && echo $p; done)
T0=$(date +%s.%N); kill -9 $W1 2>/dev/null; wait $SUP; CODE=$?; T1=$(date +%s.%N)
LEFT=$(pgrep -f "output-video-name killed" | wc -l)
echo "killed rank 1 (pid ${W1:-?}); supervisor exit $CODE after $(python3 -c "print(round($T1-$T0,1))") s; vidgen processes left: $LEFT"
ls "$OUT/kill" 2>/dev/null | sed 's/^/  in the output folder: /'; [ -e "$OUT/kill/killed.mp4" ] && echo "  NOT met: a final output exists"
tail -3 "$OUT/kill.log"

fi

if want 5; then
echo "== 5. FSDP, 14B, 2 GPUs (sequence parallel), 2 steps"
NOLW="--no-dit-layerwise-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
for v in "plain --no-dit-cpu-offload" "fsdp --no-dit-cpu-offload --use-fsdp-inference" "fsdp-host --dit-cpu-offload --use-fsdp-inference"; do
  set -- $v; n=$1; shift
  $B generate --model synthetic:wan2.1-t2v-14b --prompt x --device cuda --num-gpus 2 $NOLW "$@" --dry-run | grep -E "^gpu" | sed "s/^/  plan $n: /"
  timeout 420 $B generate --model synthetic:wan2.1-t2v-14b --prompt "a red fox runs through fresh snow" --seed 1 \
    --num-inference-steps 2 --guidance-scale 5 --device cuda --dtype bf16 --num-gpus 2 $NOLW "$@" \
    --output-type safetensors --output-path "$OUT/fsdp" --output-video-name $n --overwrite --stats-json "$OUT/fsdp-$n.json" \
    > /dev/null 2> "$OUT/fsdp-$n.log"
  echo "$n: exit $?; s/forward $(forward "$OUT/fsdp-$n.json")"; grep -E "FSDP|error" "$OUT/fsdp-$n.log" | head -3
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['jobs'][0]['metrics']['stages']; print({k: round(v['device_used_peak']/2**30,2) for k,v in s.items() if 'device_used_peak' in v}, 'GiB (rank 0)')" "$OUT/fsdp-$n.json" 2>/dev/null
done
python3 - "$OUT/fsdp" <<'PY'
import sys, numpy as np
from safetensors.numpy import load_file
d = sys.argv[1]
try:
    a = load_file(f"{d}/plain.safetensors")["frames"]
    for n in ["fsdp", "fsdp-host"]:
        b = load_file(f"{d}/{n}.safetensors")["frames"]
        print(f"{n}: bit-identical to plain: {bool((a == b).all())} (max |diff| {float(np.abs(a - b).max()):.3g})")
except Exception as e:
    print("no comparison:", e)
PY

fi

want 6 || exit 0
echo "== 6. groups: 4 ranks, --sp-size 2, on 2 GPUs (two simulated nodes), tiny fixture f32, 3 prompts"
printf 'a red fox\na cat on a roof\na boat at sea\n' > "$OUT/groups.txt"
G="--model tests/fixtures/wan-tiny-a --prompt-file $OUT/groups.txt --seed 1 --height 32 --width 32 --num-frames 9
  --num-inference-steps 3 --max-sequence-length 16 --device cuda --dtype f32 --output-type safetensors --overwrite"
rm -rf "$OUT/groups-one" "$OUT/groups-four"; mkdir -p "$OUT/groups-four"
$B generate $G --output-path "$OUT/groups-one" > /dev/null 2> "$OUT/groups-one.log" || tail -3 "$OUT/groups-one.log"
PORT=$((29700 + RANDOM % 200))
PIDS=()
for r in 0 1 2 3; do
  RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
    timeout 300 $B generate $G --num-gpus 4 --sp-size 2 --output-path "$OUT/groups-four" \
    --stats-json "$OUT/groups-four/stats.json" > "$OUT/groups-$r.stdout" 2> "$OUT/groups-$r.log" &
  PIDS+=($!)
done
for r in 0 1 2 3; do
  wait "${PIDS[$r]}"; CODE=$?
  echo "rank $r: exit $CODE, $(wc -l < "$OUT/groups-$r.stdout") path(s), loaded: $(grep -o 'loading [a-z_0-9]*' "$OUT/groups-$r.log" | cut -d' ' -f2 | tr '\n' ' ')"
  [ $CODE = 0 ] || grep -E "error" "$OUT/groups-$r.log" | tail -3
done
python3 - "$OUT/groups-one" "$OUT/groups-four" <<'PY'
import sys, os, json, numpy as np
from safetensors.numpy import load_file
one, four = sys.argv[1:3]
try:
    for n in sorted(f for f in os.listdir(one) if f.endswith(".safetensors")):
        a, b = load_file(f"{one}/{n}")["frames"], load_file(f"{four}/{n}")["frames"]
        d = float(np.abs(a - b).max())
        print(f"{n}: max |one - groups| = {d:.3g} ({'met' if d <= 1e-5 else 'NOT met'}: <= 1e-5)")
    for s in ["stats.json", "stats.rank2.json"]:
        print(s, [j["status"] for j in json.load(open(f"{four}/{s}"))["jobs"]])
except Exception as e:
    print("no comparison:", e)
PY
