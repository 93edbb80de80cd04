#!/usr/bin/env bash
# Where a DiT forward's GPU time goes: one resident forward per family under Nsight Compute
# (kernel durations only), summed per kernel name, largest first.
#   bash bench/profile_dit.sh ltx cogvideox hunyuan wan mochi allegro latte flux     (needs .device/offload_bench[.xz])
set -u
OUT=${OUT:-/tmp/vidgen-bench}
mkdir -p "$OUT"
B=${BENCH:-./.device/offload_bench}
[ -f $B.xz ] && [ ! -x $B ] && xz -dc $B.xz > $B && chmod +x $B
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
OFF="--dit-layerwise-offload=false --dit-cpu-offload=false"
for F in "$@"; do
  case $F in
    ltx) M=synthetic:ltx-video; S=161x512x768 ;;
    cogvideox) M=synthetic:cogvideox-5b; S=49x480x720 ;;
    hunyuan) M=synthetic:hunyuanvideo; S=61x320x512 ;;
    wan) M=synthetic:wan2.1-t2v-1.3b; S=81x480x832 ;;
    mochi) M=synthetic:mochi-1; S=85x480x848 ;;
    allegro) M=synthetic:allegro; S=88x720x1280 ;;
    latte) M=synthetic:latte-1; S=16x512x512 ;;
    flux) M=synthetic:flux.1-dev; S=1x768x768 ;;
    *) echo "unknown family $F"; continue ;;
  esac
  # Without the profiler first: the forward's time with and without cuDNN.
  $B $M 1 $S "none: $OFF" 2>/dev/null | grep -o '"s_per_forward":[0-9.]*' | sed "s/^/$F cudnn /"
  VIDGEN_CUDNN=off $B $M 1 $S "none: $OFF" 2>/dev/null | grep -o '"s_per_forward":[0-9.]*' | sed "s/^/$F no-cudnn /"
  $NCU --csv --page raw --metrics gpu__time_duration.sum $B $M 1 $S "none: $OFF" > "$OUT/ncu-$F.csv" 2> "$OUT/ncu-$F.log"
  python3 bench/ncu_kernels.py "$OUT/ncu-$F.csv" "$F"
done
