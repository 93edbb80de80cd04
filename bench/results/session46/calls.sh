# Session 46's calls (builds at 9651096 in .device46/: strip, xz -9e; see session45/calls.sh for the carry).
#   3 (carry .device46/offload_bench.xz): HunyuanVideo 61x320x512, resident against the copy stream 1 to 6 slot
#      fills ahead: how far ahead the dual-stream blocks' copies (8.4 ms each at 53.5 GB/s, against about 6.5 ms
#      of compute) must start for streaming to cost nothing, and what each fill costs in device memory.
#   4 (carry .device46/offload_bench.xz, .device47/offload_bench.xz): HunyuanVideo's single-stream blocks without
#      the joined copy and with q/k/v gone before the heads merge, against the build before (9651096): resident,
#      default stream and leaf level at 61x320x512, resident at 720x1280x129 (one timed forward): peaks, speed and every mode's output against the resident one.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
xz -dc .device46/offload_bench.xz > /tmp/offload_bench && chmod +x /tmp/offload_bench
[ -f .device47/offload_bench.xz ] && xz -dc .device47/offload_bench.xz > /tmp/offload_bench_new && chmod +x /tmp/offload_bench_new
summary() { python3 bench/offload_summary.py "$1"; }
export VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench
case $1 in
  3) MODES=("none: --dit-layerwise-offload=false --dit-cpu-offload=false")
     for d in 1 2 3 4 5 6 8; do MODES+=("depth_$d: --num-blocks-per-group 1 --prefetch-depth $d"); done
     /tmp/offload_bench synthetic:hunyuanvideo 3 61x320x512 "${MODES[@]}" > $OUT/hunyuan-depths.jsonl 2> $OUT/hunyuan-depths.log
     echo "exit $?"; summary $OUT/hunyuan-depths.jsonl;;
  4) SMALL=("none: --dit-layerwise-offload=false --dit-cpu-offload=false" "default: " "leaf: --offload-type leaf-level")
     BIG=("none: --dit-layerwise-offload=false --dit-cpu-offload=false")
     for round in 1 2; do for b in offload_bench offload_bench_new; do
       echo "== $b 61x320x512 (round $round)"
       /tmp/$b synthetic:hunyuanvideo 3 61x320x512 "${SMALL[@]}" > $OUT/small-$b-$round.jsonl 2> $OUT/small-$b-$round.log
       echo "exit $?"; summary $OUT/small-$b-$round.jsonl
     done; done
     for b in offload_bench offload_bench_new; do
       echo "== $b 129x720x1280"
       timeout 150 /tmp/$b synthetic:hunyuanvideo 1 129x720x1280 "${BIG[@]}" > $OUT/big-$b.jsonl 2> $OUT/big-$b.log
       echo "exit $?"; summary $OUT/big-$b.jsonl
     done;;
  5) SMALL=("none: --dit-layerwise-offload=false --dit-cpu-offload=false" "default: " "leaf: --offload-type leaf-level")
     for b in offload_bench offload_bench_new; do
       echo "== $b 61x320x512"
       /tmp/$b synthetic:hunyuanvideo 3 61x320x512 "${SMALL[@]}" > $OUT/small-$b.jsonl 2> $OUT/small-$b.log
       echo "exit $?"; summary $OUT/small-$b.jsonl
     done
     for b in offload_bench_new offload_bench; do
       echo "== $b 129x720x1280"
       timeout 75 /tmp/$b synthetic:hunyuanvideo 1 129x720x1280 "none: --dit-layerwise-offload=false --dit-cpu-offload=false" > $OUT/big-$b.jsonl 2> $OUT/big-$b.log
       echo "exit $?"; summary $OUT/big-$b.jsonl; tail -2 $OUT/big-$b.log
     done;;
esac
