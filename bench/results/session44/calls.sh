# Session 44's device calls: run(carry: [".device45/…", ".whl"], command: "bash bench/results/session44/calls.sh N")
# .device45/: vidgen, vae_decode, offload_bench and the library's CUDA tests at this session's src (GroupNorm's
# apply pass in 16-byte vectors).
#   1 (carry .device45/{vidgen-lib-tests,vae_decode}.xz, .whl): the GroupNorm and every CUDA test of the library;
#      Allegro's full-size decode (88x720x1280, tiled) beside diffusers'; Latte-1's decode beside diffusers';
#      diffusers' FLUX.1-dev stream rows of the seed table (never measured: vidgen's are in session 25).
#   2 (carry .device45/offload_bench.xz, .whl): Allegro's seed-table rows, vidgen beside diffusers (never measured).
#   3 (carry .device45/offload_bench.xz, .whl): leaf level's look-ahead on Latte-1 and Mochi-1 (whose leaf-level peaks
#      were above diffusers'), vidgen's depths 1 and 2 beside its default and diffusers' leaf-level row.
#   4, 5 (as 2): every seed-table row of Latte-1 and Mochi-1 (4), FLUX.1-dev (5), both programs in one call.
#   6 (carry .device45/{vae_decode,vae_decode_before,offload_bench}.xz): Latte-1's and Allegro's decodes with the image
#      convolutions' shorter runs against the build before; FLUX.1-dev's stream rows at a look-ahead of one group.
#   7 (carry .device45/{vae_decode,vidgen}.xz, .whl): Allegro's decode with its tiles summed in the VAE's dtype, and
#      its whole run beside diffusers.
set -u
export PATH=/opt/torch/.venv/bin:$PATH
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
for b in vidgen vae_decode vidgen-lib-tests offload_bench; do
  [ -f .device45/$b.xz ] && xz -dc .device45/$b.xz > /tmp/$b && chmod +x /tmp/$b
done
case $1 in
  1) el "every CUDA test of the library (GroupNorm's apply in vectors among them)"
     timeout 200 /tmp/vidgen-lib-tests --test-threads=1 cuda_tests candle_strided 2>&1 \
       | grep -E "^test .*(FAILED|runs::)|panicked|result:" | tail -24
     el "latte-1 decode beside diffusers"
     FAMILIES=latte-1 PEERS=latte-1 SMALL=0 UNFUSED=0 VAE_DECODE=/tmp/vae_decode OUT=$OUT/vae-latte \
       timeout 120 bash bench/vae_family.sh 2>&1 | grep -E "^\{|t\+" | cut -c1-400
     el "allegro full-size decode (tiled) beside diffusers' tiled"
     FAMILIES=allegro PEERS=allegro SMALL=0 UNFUSED=0 VAE_DECODE=/tmp/vae_decode OUT=$OUT/vae-allegro \
       timeout 200 bash bench/vae_family.sh 2>&1 | grep -E "^\{|t\+" | cut -c1-400
     el "diffusers' FLUX.1-dev stream rows"
     mkdir -p .device && cp .device45/seed_table_bench.py .device/
     NO_VIDGEN=1 PEER_TAG=stream PEER_BUDGET_S=150 PEER_MODES=block_level_N1_stream,block_level_N8_stream,leaf_level_stream \
       OUT=$OUT/seed timeout 200 bash bench/seed_table.sh flux 2>&1 | tail -20;;
  2) el "allegro's seed-table rows, vidgen then diffusers"
     mkdir -p .device && cp /tmp/offload_bench .device/offload_bench && cp .device45/seed_table_bench.py .device/
     FORWARDS=1 PEER_BUDGET_S=300 OUT=$OUT/seed timeout 560 bash bench/seed_table.sh allegro 2>&1 | tail -30;;
  3) B=/tmp/offload_bench
     leaf=("none: --dit-layerwise-offload=false --dit-cpu-offload=false" "leaf_level_stream: --offload-type leaf-level"
       "leaf_depth1: --offload-type leaf-level --prefetch-depth 1" "leaf_depth2: --offload-type leaf-level --prefetch-depth 2")
     export VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench
     for f in "latte-1 16x512x512" "mochi-1 85x480x848"; do
       set -- $f; el "$1 leaf level, vidgen"
       timeout 200 $B synthetic:$1 2 $2 "${leaf[@]}" > $OUT/$1-leaf.jsonl 2> $OUT/$1-leaf.log
       grep -E "^\{" $OUT/$1-leaf.jsonl | cut -c1-400; rm -rf /dev/shm/vidgen-bench
     done
     el "latte-1 leaf level, diffusers"
     PYTHONPATH=/tmp/site timeout 150 python3 bench/peer_seed_table_rest.py --base .device45/seed_table_bench.py \
       --models latte --out $OUT/peer-latte --budget-s 140 --modes none,leaf_level_stream > $OUT/peer-latte.log 2>&1
     tail -4 $OUT/peer-latte.log; cat $OUT/peer-latte/results.json 2>/dev/null | cut -c1-1500;;
  4|5) el "seed-table rows, vidgen then diffusers, every mode"
     mkdir -p .device && cp /tmp/offload_bench .device/offload_bench && cp .device45/seed_table_bench.py .device/
     fams="latte mochi"; [ $1 = 5 ] && fams=flux
     PEER_BUDGET_S=${PEER_BUDGET_S:-250} OUT=$OUT/seed timeout 580 bash bench/seed_table.sh $fams 2>&1 | tail -30;;
  6) el "image decodes before and after runs of 2^26 input elements (IMAGE_RUN_ELEMENTS), alternating"
     xz -dc .device45/vae_decode_before.xz > /tmp/vae_decode_before && chmod +x /tmp/vae_decode_before
     for i in 1 2; do for v in before new; do
       bin=/tmp/vae_decode; [ $v = before ] && bin=/tmp/vae_decode_before
       for a in "latte-1" "latte-1 --tiled"; do timeout 60 $bin --family $a | sed "s/^/$v /" | cut -c1-330; done
       [ $i = 1 ] && timeout 100 $bin --family allegro | sed "s/^/$v /" | cut -c1-330
     done; done
     el "FLUX.1-dev's stream rows with diffusers' look-ahead of one group (--prefetch-depth 1)"
     export VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench
     timeout 200 /tmp/offload_bench synthetic:flux.1-dev 2 1x768x768 "none: --dit-layerwise-offload=false --dit-cpu-offload=false" \
       "block_level_N1_stream_depth1: --num-blocks-per-group 1 --prefetch-depth 1" \
       "block_level_N8_stream_depth1: --num-blocks-per-group 8 --prefetch-depth 1" \
       "leaf_level_stream_depth1: --offload-type leaf-level --prefetch-depth 1" > $OUT/flux-depth1.jsonl 2> $OUT/flux-depth1.log
     python3 -c "
import json
for l in open('$OUT/flux-depth1.jsonl'):
    if l.startswith('{') and 's_per_forward' in l:
        r = json.loads(l); print(r['label'], round(r['s_per_forward'], 4), 'alloc', round(r['peak_alloc_gib'], 3), 'reserved', round(r['peak_reserved_gib'], 3))
    elif l.startswith('{'): print(l.strip())";;
  7) el "allegro's decode with the tiles summed in the VAE's dtype (diffusers' tiled: call 1)"
     timeout 100 /tmp/vae_decode --family allegro | cut -c1-330
     el "allegro whole at 24x320x320 beside diffusers (frames against diffusers')"
     PYTHONPATH=/tmp/site timeout 150 python3 bench/family_e2e.py --vidgen /tmp/vidgen --ckpt-root /dev/shm/vidgen-e2e \
       --vidgen-modes default --family allegro --size 24,320,320 --out $OUT/e2e 2>&1 | grep -E "frames vs|Error|^\| " | cut -c1-300;;
esac
el done
