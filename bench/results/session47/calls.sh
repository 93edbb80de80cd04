# Session 47's calls (build at f231d0a in .device49/: offload_bench and the library's CUDA test binary, stripped, xz -9e).
#   1 (carry .device49/offload_bench.xz, .device49/vidgen-lib-tests.xz): the offload engine's CUDA tests (kept groups
#      among them), then kept groups (--dit-resident-memory) against resident and plain streaming: HunyuanVideo at
#      61x320x512 (copy-bound in its dual-stream blocks) and FLUX.1-dev at 768x768 (copies five times its compute).
#   2 (carry .device46/offload_bench.xz, .device49/offload_bench.xz): session 46's call 5, HunyuanVideo's single-stream
#      blocks without the joined copy (0d9cb53, in the f231d0a build) against 9651096: resident, default stream and leaf
#      level at 61x320x512, resident at 720x1280x129.
#   3 (carry .device50/vidgen.xz, the binary at 873ef13): whole FLUX.1-dev images at 768x768 (4 steps) through the
#      command line, the DiT resident, streamed, and streamed with 16 GiB kept: the stats' kept groups and copies,
#      each stage's device peak against the dry run's plan, and the images against the resident one.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for d in .device46 .device49; do
  [ -f $d/offload_bench.xz ] && xz -dc $d/offload_bench.xz > /tmp/offload_bench_${d#.device} && chmod +x /tmp/offload_bench_${d#.device}
done
[ -f .device49/vidgen-lib-tests.xz ] && xz -dc .device49/vidgen-lib-tests.xz > /tmp/lib_tests && chmod +x /tmp/lib_tests
summary() { python3 bench/offload_summary.py "$1"; }
export VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench
NONE="none: --dit-layerwise-offload=false --dit-cpu-offload=false"
case $1 in
  1) timeout 90 /tmp/lib_tests --test-threads=1 offload:: 2>&1 | grep -E "^test |panicked|result:" | tee $OUT/tests.txt
     echo "== HunyuanVideo 61x320x512"
     timeout 170 /tmp/offload_bench_49 synthetic:hunyuanvideo 3 61x320x512 "$NONE" "stream: " \
       "kept2: --dit-resident-memory 2GiB" "kept4: --dit-resident-memory 4GiB" "kept8: --dit-resident-memory 8GiB" \
       > $OUT/hunyuan-kept.jsonl 2> $OUT/hunyuan-kept.log
     echo "exit $?"; summary $OUT/hunyuan-kept.jsonl
     echo "== FLUX.1-dev 768x768"
     timeout 170 /tmp/offload_bench_49 synthetic:flux.1-dev 3 1x768x768 "$NONE" "stream: " \
       "kept4: --dit-resident-memory 4GiB" "kept8: --dit-resident-memory 8GiB" "kept16: --dit-resident-memory 16GiB" \
       > $OUT/flux-kept.jsonl 2> $OUT/flux-kept.log
     echo "exit $?"; summary $OUT/flux-kept.jsonl;;
  2) SMALL=("$NONE" "default: " "leaf: --offload-type leaf-level")
     for b in 46 49; do
       echo "== build $b 61x320x512"
       /tmp/offload_bench_$b synthetic:hunyuanvideo 3 61x320x512 "${SMALL[@]}" > $OUT/small-$b.jsonl 2> $OUT/small-$b.log
       echo "exit $?"; summary $OUT/small-$b.jsonl
     done
     for b in 49 46; do
       echo "== build $b 129x720x1280"
       timeout 75 /tmp/offload_bench_$b synthetic:hunyuanvideo 1 129x720x1280 "$NONE" > $OUT/big-$b.jsonl 2> $OUT/big-$b.log
       echo "exit $?"; summary $OUT/big-$b.jsonl; tail -2 $OUT/big-$b.log
     done;;
  3) xz -dc .device50/vidgen.xz > /tmp/vidgen && chmod +x /tmp/vidgen
     for mode in "resident:--no-dit-layerwise-offload --no-dit-cpu-offload" "stream:--dit-layerwise-offload" \
                 "kept16:--dit-layerwise-offload --dit-resident-memory 16GiB"; do
       label=${mode%%:*}; flags=${mode#*:}
       common="--model synthetic:flux.1-dev --prompt a-fox --height 768 --width 768 --num-inference-steps 4 --seed 1"
       /tmp/vidgen generate $common $flags --dry-run --json > $OUT/$label-plan.json 2> $OUT/$label-plan.log
       timeout 150 /tmp/vidgen generate $common $flags --output-type safetensors --output-path $OUT/$label \
         --stats-json $OUT/$label-stats.json > $OUT/$label.log 2>&1
       echo "== $label exit $?"; grep -E "transformer:|kept|forwards" $OUT/$label.log | head -4
       python3 bench/cli_stage_summary.py $OUT/$label-stats.json $OUT/$label-plan.json
     done
     python3 - $OUT <<'PY'
import sys
from safetensors.numpy import load_file
import glob
out = sys.argv[1]
def frames(label):
    return load_file(glob.glob(f"{out}/{label}/*.safetensors")[0])["frames"]
ref = frames("resident")
for label in ("stream", "kept16"):
    print(label, "max abs diff vs resident", float(abs(frames(label) - ref).max()))
PY
     ;;
esac
