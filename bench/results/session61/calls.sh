#!/usr/bin/env bash
# Session 61's calls. DEV holds, stripped and xz'd, the vidgen binary, examples/vae_decode and the library's CUDA
# tests at 73d2590 (b032979 + Latte's and Allegro's shared output head); .whl the diffusers 0.42.1 wheel.
#   run(carry: [".device15", ".whl"], kind: nvidia-h200, command: "DEV=.device15 bash bench/results/session61/calls.sh N")
# Every call first runs the CUDA tests of the download to host memory (b032979 tidied `Download`) and of Latte's
# and Allegro's fused blocks. Then, on a card of more than 100 GB, MiniMax H3's whole video (issue 34 item 5),
# 4 steps at the published 124x768x1344, vidgen (default flags, then resident) beside diffusers' modular pipeline,
# both from one checkpoint in /dev/shm: the published configs with the DiT cut to one block (bench/minimax_e2e.py).
# On a smaller card, N picks what issue 34's table lacks (bench/family_e2e.py: vidgen as a first run with the
# driver's compile cache empty, then default flags, then resident, beside diffusers in the same call):
#   1: Mochi-1's decode at its pipeline's 19 frames (latents 1,12,4,60,106), vidgen and diffusers in turn, twice;
#      Wan2.2 TI2V-5B's whole video at 121x704x1280; Wan2.1 1.3B's with both programs decoding in tiles;
#   2: Wan2.2 T2V-A14B's whole video at 81x480x832;
#   3: (.device15 rebuilt at 4c89266: vidgen and examples/vae_decode) A14B's text stage without its wait for the
#      loads beside it (vidgen alone); Wan2.2 TI2V-5B's VAE decode beside diffusers' (f32, untiled and tiled) and
#      its kernels under ncu.
DEV=${DEV:-.device15} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
xz -dc $DEV/vae_decode.xz > /tmp/vae_decode && chmod +x /tmp/vae_decode
if [ -f $DEV/vidgen-lib-tests.xz ]; then
  el "CUDA tests: the download to host memory, Latte's and Allegro's blocks"
  timeout 120 /tmp/vidgen-lib-tests --test-threads=1 offload::transfer::cuda_tests pixart::cuda_tests \
    latte::transformer::cuda_tests allegro::transformer::cuda_tests 2>&1 | grep -E "^test |panicked|result:"
fi
family() {  # family NAME: the whole video beside diffusers, then the table and vidgen's peak per stage
  el "$1's whole video, 4 steps, beside diffusers"
  timeout ${2:-400} python3 bench/family_e2e.py --family $1 --vidgen /tmp/vidgen --out $OUT/e2e \
    --vidgen-modes first,default,resident 2>&1 | grep -E "^\[.*(diffusers|vidgen (first|default|resident) \{|checkpoint)" \
    | cut -c1-1500
  python3 bench/family_e2e.py --table $OUT/e2e | grep -E "^\| ($1|family)"
  for m in first default resident; do
    python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); j=d['jobs'][0]
print('  $m:', ', '.join('%s %.2f' % (s['name'], s['seconds']) for s in j['stages']), '| wall %.2f' % d['wall_seconds'])
for s, v in j['metrics']['stages'].items():
    print('    %-14s used %7.3f GiB, planned %7.3f' % (s, v['device_used_peak'] / 2**30, (v.get('device_planned_bytes') or 0) / 2**30))" \
      $OUT/e2e/$1-$m.stats.json 2>&1 | tail -8
  done
}
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -gt 100000 ]; then
  el "MiniMax H3's whole video, 4 steps, 124x768x1344, the DiT cut to one block, beside diffusers"
  timeout 520 python3 bench/minimax_e2e.py --vidgen /tmp/vidgen --out $OUT/minimax --layers 1 --modes default,resident 2>&1 \
    | grep -v "Warning\|warn\|it/s\]\|float32" | cut -c1-2500 | tail -14
else
  case ${1:-1} in
    1) for round in 1 2; do
         el "round $round: Mochi-1's decode at 19 frames, vidgen then diffusers"
         timeout 60 /tmp/vae_decode --family mochi-1 1,12,4,60,106 2>&1 | grep "^{"
         timeout 60 python3 bench/peer_vae_decode.py mochi-1 1,12,4,60,106 2>&1 | grep "^{"
       done
       family wan2.2-ti2v-5b 380
       el "Wan2.1 1.3B's whole video, both programs decoding in spatial tiles (--vae-tiling)"
       timeout 130 python3 bench/family_e2e.py --family wan2.1-t2v-1.3b --vidgen /tmp/vidgen --out $OUT/e2e-tiled \
         --vae-tiling --vidgen-modes default 2>&1 | grep -E "^\[.*(diffusers|vidgen default \{)" | cut -c1-1200
       python3 bench/family_e2e.py --table $OUT/e2e-tiled | grep -E "^\| (wan|family)" ;;
    2) family wan2.2-t2v-a14b 540 ;;
    3) el "Wan2.2 T2V-A14B, vidgen alone: its text stage without the wait for the experts loading beside it"
       timeout 200 python3 bench/family_e2e.py --family wan2.2-t2v-a14b --vidgen /tmp/vidgen --out $OUT/e2e \
         --skip-diffusers --vidgen-modes default 2>&1 | grep -E "^\[.*vidgen default \{" | cut -c1-1500
       python3 -c "
import json; v=json.load(open('$OUT/e2e/wan2.2-t2v-a14b.json'))['vidgen']['default']
print('  stages', v['stages'], 'waited for loads beside', v['waited_for_loads_beside'])"
       rm -rf /dev/shm/vidgen-e2e
       for round in 1 2; do
         for tiled in "" --tiled; do
           el "round $round: Wan2.2 TI2V-5B's VAE decode at 121x704x1280 $tiled, vidgen"
           timeout 90 /tmp/vae_decode --family wan2.2-ti2v-5b $tiled 2>&1 | grep "^{"
         done
         [ $round = 1 ] || continue
         el "diffusers, untiled then tiled"
         timeout 150 python3 bench/peer_vae_decode.py wan2.2-ti2v-5b 2>&1 | grep "^{"
       done
       el "Wan2.2 TI2V-5B's decode of 2 latent frames at 352x640 under ncu"
       timeout 150 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
         /tmp/vae_decode --family wan2.2-ti2v-5b 1,48,2,22,40 > $OUT/ncu-wan22.csv 2> $OUT/ncu-wan22.err
       python3 bench/ncu_kernels.py $OUT/ncu-wan22.csv wan2.2-vae 2>&1 | head -30 ;;
  esac
fi
el "done"
