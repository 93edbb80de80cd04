# Session 50's calls. Build vidgen, offload_bench and the library's CUDA tests at HEAD into .device56/ (strip,
# xz -9e; the carry with .whl stays under 64 MiB), copy ../shared/peer/seed_table_bench.py there, then
#   run(carry: [".device56", ".whl"], command: "bash bench/results/session50/calls.sh 1")
#   1: the offload engine's CUDA tests (exact fills among them); HunyuanVideo's 720p forward with the fused output
#      head (expected peak ~28.08 GiB, was 29.43); FLUX.1-dev's seed-table rows with leaf level in exact fills, its
#      outer part per use and finer block steps (planned 0.39 GiB), beside diffusers' resident and leaf rows.
#   2: the other seed-table families' leaf-level rows with exact fills (and the outer part per use where blocks
#      have steps), each beside its resident run: Latte-1, Mochi-1, Allegro, HunyuanVideo at the table's sizes.
#   3 (carry .device57, where 6505bbf's library CUDA tests are, and tests/fixtures/{wan-tiny-a,ecosystem-a,weights-a}
#      out of the index): every CUDA test of the library, the packed and LoRA streaming ones in exact fills too.
#      Call 8 is the same with DEV=.device60 (the library's CUDA tests after the exact fills' copies across passes).
#   4: Wan2.1 14B and 1.3B at 81x480x832, leaf level (its outer part now per use) beside the default stream.
#   5: LTX-Video and CogVideoX-5b at the seed table's sizes, resident and leaf level (their steps in exact fills,
#      the outer part per use): the rows must stay below diffusers' (0.562 and 1.377 GiB).
#   6 (DEV=.device58: offload_bench and the library's CUDA tests with exact fills prefetching across passes where
#      that holds no more): the offload CUDA tests; LTX-Video, Wan2.1 1.3B and FLUX.1-dev, resident, default stream
#      and leaf level.
#   9 (carry .device61 with the vae_decode example, and .whl): FLUX.1-dev's 1024x1024 decode, untiled and tiled,
#      beside diffusers' (bench/peer_vae_decode.py), and where its kernels' time goes (ncu).
#   7 (DEV=.device59, carrying .device58 too): LTX-Video's head through the fused LayerNorm and modulation, against
#      the build before (.device58), resident and leaf level, twice each, at 161x512x768.
DEV=${DEV:-.device56} source bench/device_setup.sh
case $1 in
  1) el "the offload engine's CUDA tests"
     timeout 150 /tmp/vidgen-lib-tests --test-threads=1 offload:: 2>&1 | grep -E "^test |panicked|result:|left|right" | tail -30
     el "HunyuanVideo 129x720x1280, resident, one forward"
     timeout 170 /tmp/offload_bench synthetic:hunyuanvideo 1 129x720x1280 \
       "none: --dit-layerwise-offload=false --dit-cpu-offload=false" > $OUT/hunyuan-720p.jsonl 2> $OUT/hunyuan-720p.log
     echo "exit $?"; python3 bench/offload_summary.py $OUT/hunyuan-720p.jsonl; tail -2 $OUT/hunyuan-720p.log
     rm -rf /dev/shm/vidgen-bench
     el "FLUX.1-dev's leaf-level plan (dry run on the GPU)"
     /tmp/vidgen generate --model synthetic:flux.1-dev --prompt x --dtype bf16 --height 768 --width 768 \
       --dit-layerwise-offload --offload-type leaf-level --dry-run 2>&1 | grep -E "^denoise|transformer" | head -4
     el "FLUX.1-dev's seed-table rows, vidgen then diffusers"
     PEER_MODES=none,leaf_level_stream PEER_BUDGET_S=200 OUT=$OUT/seed \
       timeout 420 bash bench/seed_table.sh flux 2>&1 | tail -24;;
  3) el "every CUDA test of the library"
     timeout 500 /tmp/vidgen-lib-tests --test-threads=1 2>&1 | grep -E "^test .*(FAILED|ok)$|panicked|result:" \
       | grep -E "cuda|gpu|FAILED|panicked|result:" | tail -60;;
  4) for m in wan2.1-t2v-1.3b wan2.1-t2v-14b; do
       el "$m 81x480x832: default stream and leaf level"
       timeout 200 /tmp/offload_bench synthetic:$m 2 81x480x832 "default: " \
         "leaf_level_stream: --offload-type leaf-level" > $OUT/$m.jsonl 2> $OUT/$m.log
       echo "exit $?"; python3 bench/offload_summary.py $OUT/$m.jsonl; tail -1 $OUT/$m.log
       rm -rf /dev/shm/vidgen-bench
     done;;
  6) el "the offload engine's CUDA tests"
     timeout 150 /tmp/vidgen-lib-tests --test-threads=1 offload:: 2>&1 | grep -E "^test .*FAILED|panicked|result:" | tail -8
     for f in "ltx-video 161x512x768" "wan2.1-t2v-1.3b 81x480x832" "flux.1-dev 1x768x768"; do
       set -- $f
       el "$1 $2: resident, default stream, leaf level"
       timeout 170 /tmp/offload_bench synthetic:$1 3 $2 "none: --dit-layerwise-offload=false --dit-cpu-offload=false" \
         "default: --num-blocks-per-group 1" "leaf_level_stream: --offload-type leaf-level" > $OUT/$1.jsonl 2> $OUT/$1.log
       echo "exit $?"; python3 bench/offload_summary.py $OUT/$1.jsonl
       rm -rf /dev/shm/vidgen-bench
     done;;
  7) xz -dc .device58/offload_bench.xz > /tmp/offload_bench_before && chmod +x /tmp/offload_bench_before
     for round in 1 2; do for b in offload_bench_before offload_bench; do
       el "$b, round $round: LTX-Video 161x512x768, resident and leaf level"
       timeout 100 /tmp/$b synthetic:ltx-video 3 161x512x768 "none: --dit-layerwise-offload=false --dit-cpu-offload=false" \
         "leaf_level_stream: --offload-type leaf-level" > $OUT/ltx-$b-$round.jsonl 2> $OUT/ltx-$b-$round.log
       echo "exit $?"; python3 bench/offload_summary.py $OUT/ltx-$b-$round.jsonl
     done; done;;
  9) xz -dc .device61/vae_decode.xz > /tmp/vae_decode && chmod +x /tmp/vae_decode
     VAE_DECODE=/tmp/vae_decode FAMILIES=flux.1-dev SMALL=0 UNFUSED=0 NCU=1 NCU_SHAPE=1,16,1,128,128 OUT=$OUT/vae \
       timeout 500 bash bench/vae_family.sh 2>&1 | grep -v "^==PROF" | tail -45;;
  2|5) FAMILIES=("latte-1 16x512x512" "hunyuanvideo 61x320x512" "allegro 88x720x1280" "mochi-1 85x480x848")
     [ $1 = 5 ] && FAMILIES=("ltx-video 161x512x768" "cogvideox-5b 49x480x720")
     for f in "${FAMILIES[@]}"; do
       set -- $f
       el "$1 $2: resident and leaf level"
       timeout 170 /tmp/offload_bench synthetic:$1 2 $2 "none: --dit-layerwise-offload=false --dit-cpu-offload=false" \
         "leaf_level_stream: --offload-type leaf-level" > $OUT/$1.jsonl 2> $OUT/$1.log
       echo "exit $?"; python3 bench/offload_summary.py $OUT/$1.jsonl; tail -1 $OUT/$1.log
       /tmp/vidgen generate --model synthetic:$1 --prompt x --dtype bf16 --num-frames ${2%%x*} \
         --height $(echo $2 | cut -dx -f2) --width $(echo $2 | cut -dx -f3) --dit-layerwise-offload \
         --offload-type leaf-level --lazy-module-load --dry-run 2>&1 | grep -E "^denoise" | head -1
       rm -rf /dev/shm/vidgen-bench
     done;;
esac
