#!/usr/bin/env bash
# Session 53's calls. .deviceNN holds, stripped and xz'd: vidgen and the library's CUDA tests
# (vidgen-lib-tests) and tests/fp8_matmul.rs (fp8-matmul-tests) built at the working tree (the norms
# that hand an fp8 Linear its codes), and examples/linear_bench built with experimental variants of the
# Hopper fp8 kernel (linear_bench_variants: exp/variants.patch on 747e0dc, with the variant columns in linear_bench; the kept kernel `fp8_linear_sm90_bf16`, `_s4_`: four stages with
# the epilogue staged two boxes at a time; `_p3_`, `_p4_`: session 52's pairs of blocks multicasting the
# weight tile, three or four stages).
#   run(carry: [".deviceNN"], command: "DEV=.deviceNN bash bench/results/session53/calls.sh N")
#   1: a fresh machine's first vidgen process against the next two (the 1.3B's 4-step fast recipe, as in
#      session 29 call 4); the CUDA tests of the fused norm and of fp8; linear_bench with both kernels;
#      Nsight Compute's full set on one launch of each kernel at the 14B q/k/v/o shape (why the paired
#      kernel is slower).
#   2: (.device72: the working tree's vidgen and CUDA tests, with the four-stage kernel kept, and
#      linear_bench_variants rebuilt with the pairs' remote arrivals plain, `mbarrier.arrive.shared::cluster`:
#      call 1's profile of `_p3_` stalled 39% of its cycles on the memory barrier that `.release.cluster`
#      adds) the first-run comparison again (call 1's runs stopped at a flag error); the CUDA tests;
#      linear_bench; one 14B forward's kernels, exact and fp8 (session 52's `calls.sh 3`), for the Linear
#      time with the fused norms and the four-stage kernel.
#   3: (.device73: the working tree, row_ops built from compute_89 PTX for sm_89 and up) the CUDA tests of
#      the row kernels and fp8, and the fp8 forward's kernels against call 2's exact ones.
DEV=${DEV:-.device71} source bench/device_setup.sh
CAP=VIDGEN_MAX_SHARED_MEMORY_PER_BLOCK=180000
fast13() {  # fast13 NAME: the 1.3B's 4-step fast recipe, timed from the shell
  local t0=$(date +%s.%N)
  /tmp/vidgen generate --model synthetic:wan2.1-t2v-1.3b --prompt "a red fox runs through fresh snow" --seed 1 \
    --num-frames 81 --height 480 --width 832 --num-inference-steps 4 --guidance-scale 1 --scheduler euler --sigmas 1,0.75,0.5,0.25 \
    --fp8-matmul --attention sage --dtype bf16 --output-type safetensors --output-path /tmp/fr \
    --output-video-name $1 --overwrite --stats-json $OUT/first/$1.json > $OUT/first/$1.log 2>&1
  echo "$1: exit $? in $(python3 -c "print(round($(date +%s.%N) - $t0, 2))") s"
}
forward() {  # forward NAME STEPS [ENV...]: one 14B run under ncu (kernel durations), FLAGS for vidgen
  local name=$1 steps=$2; shift 2
  el "14B $name, $steps step(s), under ncu"
  env "$@" timeout 170 ncu --clock-control none --cache-control none --csv --page raw \
    --metrics gpu__time_duration.sum /tmp/vidgen generate --model synthetic:wan2.1-t2v-14b \
    --prompt "a red fox runs through fresh snow" --seed 1 --num-frames 81 --height 480 --width 832 \
    --num-inference-steps $steps --guidance-scale 1 --dtype bf16 ${FLAGS:-} \
    --dit-layerwise-offload=false --dit-cpu-offload=false --output-type safetensors \
    --output-path /tmp/v --overwrite > $OUT/ncu-$name-$steps.csv 2> $OUT/ncu-$name-$steps.log
  echo "exit $?"; tail -1 $OUT/ncu-$name-$steps.log
}
case $1 in
  1) mkdir -p $OUT/first
     el "first vidgen process on this machine"; fast13 1.3b-fresh; fast13 1.3b-again; fast13 1.3b-third
     for f in $OUT/first/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); j=d['jobs'][0]
print(sys.argv[1].split('/')[-1], 'wall', round(d['wall_seconds'],2), [(s['name'], round(s['seconds'],2)) for s in j['stages']], [round(t,3) for t in j['metrics']['forward_seconds']])" $f; done
     el "CUDA tests: the fused norm's codes, the fp8 kernels, the fp8 Wan forward"
     timeout 120 /tmp/vidgen-lib-tests --test-threads=1 layer_norm_codes fp8 norms_agree grouped_norms 2>&1 \
       | grep -E "^test |panicked|result:" | tail -30
     xz -dc $DEV/fp8-matmul-tests.xz > /tmp/fp8-matmul-tests && chmod +x /tmp/fp8-matmul-tests
     timeout 120 /tmp/fp8-matmul-tests --test-threads=1 --nocapture fp8_forward_on_cuda 2>&1 \
       | grep -E "^test |relative|panicked|result:"
     xz -dc $DEV/linear_bench_variants.xz > /tmp/linear_bench_variants && chmod +x /tmp/linear_bench_variants
     el "linear_bench: the kept kernel and the variants"
     timeout 150 /tmp/linear_bench_variants | head -12
     for k in fp8_linear_sm90_p3_bf16 fp8_linear_sm90_bf16; do
       el "ncu --set full, $k, 14B q/k/v/o"
       timeout 150 ncu --set full --import-source no -k regex:"^$k\$" --launch-skip 3 --launch-count 1 --kill yes \
         --export $OUT/$k --force-overwrite /tmp/linear_bench_variants > $OUT/ncu-$k.log 2>&1
       echo "exit $?"; ncu --import $OUT/$k.ncu-rep --page details > $OUT/details-$k.txt 2>&1
       ncu --import $OUT/$k.ncu-rep --page raw --csv > $OUT/raw-$k.csv 2>&1
       grep -E "Duration|Throughput|Registers|Grid Size|Cluster|Warp Cycles|Issued Warp|Eligible|Active Warps" \
         $OUT/details-$k.txt | head -30
     done;;
  2) mkdir -p $OUT/first
     el "the machine's first vidgen process"; fast13 1.3b-fresh; fast13 1.3b-again; fast13 1.3b-third
     for f in $OUT/first/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); j=d['jobs'][0]
print(sys.argv[1].split('/')[-1], 'wall', round(d['wall_seconds'],2), [(s['name'], round(s['seconds'],2)) for s in j['stages']], [round(t,3) for t in j['metrics']['forward_seconds']])" $f; done
     el "CUDA tests: the fused norm's codes, the fp8 kernels (the four-stage Hopper kernel), the fp8 Wan forward"
     timeout 120 /tmp/vidgen-lib-tests --test-threads=1 layer_norm_codes fp8 grouped_norms 2>&1 \
       | grep -E "^test |panicked|Error|result:" | tail -30
     xz -dc $DEV/linear_bench_variants.xz > /tmp/linear_bench_variants && chmod +x /tmp/linear_bench_variants
     el "linear_bench: HEAD's kernel (the Hopper kernel column), s4 (kept now), p3/p4 with the plain remote arrive"
     timeout 150 /tmp/linear_bench_variants 2>&1 | grep -E "^\|"
     for steps in 1 2; do FLAGS=--fp8-matmul forward fp8 $steps; done
     for steps in 1 2; do forward bf16 $steps; done
     python3 bench/linear_time.py exact=$OUT/ncu-bf16-1.csv,$OUT/ncu-bf16-2.csv \
       fp8=$OUT/ncu-fp8-1.csv,$OUT/ncu-fp8-2.csv
     xz -9 $OUT/ncu-*.csv;;
  3) el "CUDA tests: the row kernels (row_ops, from compute_89 PTX on sm_89+ now), fp8"
     timeout 150 /tmp/vidgen-lib-tests --test-threads=1 row_ops fp8 2>&1 | grep -E "^test |panicked|Error|result:" \
       | tail -40
     for steps in 1 2; do FLAGS=--fp8-matmul forward fp8 $steps; done
     for n in 1 2; do xz -dc bench/results/session53/call2/ncu-bf16-$n.csv.xz > $OUT/ncu-bf16-$n.csv; done
     python3 bench/linear_time.py exact-call2=$OUT/ncu-bf16-1.csv,$OUT/ncu-bf16-2.csv \
       fp8=$OUT/ncu-fp8-1.csv,$OUT/ncu-fp8-2.csv
     rm $OUT/ncu-bf16-*.csv; xz -9 $OUT/ncu-*.csv;;
esac
