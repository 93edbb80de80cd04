#!/usr/bin/env bash
# Session 62's calls. DEV holds, stripped and xz'd, at 7a79890 (d25c35c + the one-pass DupUp3D shortcut of branch
# wip/wan22-dup-up-cl): vidgen, examples/vae_decode, examples/minimax_blocks and the library's CUDA tests, and
# vae_decode_old at d25c35c; .whl the diffusers 0.42.1 wheel.
#   run(carry: [".device", ".whl"], command: "DEV=.device bash bench/results/session62/calls.sh N")
#   minimax: MiniMax H3's whole video, 4 steps at the published 124x768x1344, vidgen (default flags, then
#            resident) beside diffusers' modular pipeline, from one checkpoint in /dev/shm with the DiT cut to one
#            block (bench/minimax_e2e.py; on a card of 100 GB or less, diffusers drops its text encoder's weights
#            after encoding, `--free-encoder`, or it runs out of memory); then its block beside diffusers' (examples/minimax_blocks,
#            bench/peer_minimax_blocks.py), twice in turn.
#   wan:     the Wan VAE's CUDA tests, then Wan2.2 TI2V-5B's decode at 121x704x1280 with DupUp3D's shortcut added
#            channels last in one pass (vae_decode) against the build before it (vae_decode_old), in turn, untiled
#            and tiled, twice; the frames of both compared.
#   first:   the first run on a fresh machine of each family not yet measured: the same command twice, the driver's
#            compile cache empty before the first (CUDA_CACHE_PATH a new folder), `synthetic:` weights, 2 steps;
#            the cache's size after each run says what the driver compiled.
#   wanpeer: the same decode (vae_decode only) beside diffusers' (bench/peer_vae_decode.py, f32), in turn, twice.
#   rope:    MiniMax H3's one-block video, default flags, vidgen (its rotary tables made once per video, not per
#            forward) against vidgen_old (7a79890) in turn, twice; the outputs compared.
# N is a comma-separated list of those.
DEV=${DEV:-.device} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
for b in vae_decode vae_decode_old minimax_blocks; do
  [ -f $DEV/$b.xz ] && xz -dc $DEV/$b.xz > /tmp/$b && chmod +x /tmp/$b
done
stages() {  # stages STATS_JSON: wall time, each stage's seconds, the loads
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); j=d['jobs'][0]
print('    wall %.2f |' % d['wall_seconds'], ', '.join('%s %.2f' % (s['name'], s['seconds']) for s in j['stages']))" $1 2>&1 | tail -2
}
firstrun() {  # firstrun FAMILY [FLAGS...]
  local fam=$1 cache; shift; cache=$(mktemp -d); mkdir -p $OUT/first
  for run in first second; do
    el "$fam, $run run $*"
    CUDA_CACHE_PATH=$cache timeout 240 /tmp/vidgen generate --model synthetic:$fam \
      --prompt "a red fox runs through fresh snow at dawn, cinematic" --seed 1 --num-inference-steps 2 --dtype bf16 \
      --output-type safetensors --output-path /tmp/v --output-video-name $fam-$run --overwrite \
      --stats-json $OUT/first/$fam-$run.json "$@" > $OUT/first/$fam-$run.log 2>&1
    echo "    exit $?, compile cache $(du -sk $cache | cut -f1) KiB"; grep -E "^error" $OUT/first/$fam-$run.log
    stages $OUT/first/$fam-$run.json
  done
  rm -rf $cache /tmp/v
}
for what in ${1//,/ }; do case $what in
  minimax)
    el "MiniMax H3's whole video, 4 steps, 124x768x1344, the DiT cut to one block, beside diffusers"
    free=""; [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ] || free=--free-encoder
    timeout 450 python3 bench/minimax_e2e.py --vidgen /tmp/vidgen --out $OUT/minimax --layers 1 --modes default,resident $free 2>&1 \
      | grep -v "Warning\|warn\|it/s\]\|float32" | cut -c1-2500 | tail -14
    rm -rf /dev/shm/vidgen-minimax-e2e-1
    for round in 1 2; do
      el "round $round: MiniMax H3's block, vidgen then diffusers"
      timeout 90 /tmp/minimax_blocks 2>&1 | grep -v "^\s*$" | tail -4
      timeout 100 python3 bench/peer_minimax_blocks.py --out $OUT/peer-$round 2>&1 | grep -v "kept in float32" | tail -3
    done ;;
  wan)
    el "CUDA tests: the Wan VAE's kernels"
    timeout 120 /tmp/vidgen-lib-tests --test-threads=1 wan::vae::blocks::cuda_tests 2>&1 | grep -E "^test |panicked|result:"
    for round in 1 2; do
      for b in vae_decode_old vae_decode; do
        for tiled in "" --tiled; do
          save=""; [ "$round$tiled" = 1 ] && save="--save /tmp/$b.safetensors"
          el "round $round: $b $tiled"
          timeout 60 /tmp/$b --family wan2.2-ti2v-5b $tiled $save 2>&1 | grep "^{"
        done
      done
    done
    python3 -c "
from safetensors.numpy import load_file; import numpy as np
a = load_file('/tmp/vae_decode_old.safetensors')['video']; b = load_file('/tmp/vae_decode.safetensors')['video']
print('frames old vs new: shape', a.shape, 'max |diff|', float(np.abs(a - b).max()))" ;;
  wanpeer)  # DEV holds vae_decode (and vae_decode_old): the new decode beside diffusers', in turn, twice
    for round in 1 2; do
      for tiled in "" --tiled; do
        el "round $round: Wan2.2 TI2V-5B's VAE decode at 121x704x1280 $tiled, vidgen"
        timeout 60 /tmp/vae_decode --family wan2.2-ti2v-5b $tiled 2>&1 | grep "^{"
      done
      el "round $round: diffusers, untiled then tiled"
      timeout 150 python3 bench/peer_vae_decode.py wan2.2-ti2v-5b 2>&1 | grep "^{"
    done ;;
  rope)  # DEV holds vidgen (this tree: MiniMax H3's rotary tables made once per video) and vidgen_old (7a79890)
    el "MiniMax H3's one-block checkpoint"
    timeout 200 python3 bench/minimax_e2e.py --vidgen /tmp/vidgen --out $OUT/ckpt --layers 1 --modes "" --skip-diffusers \
      --keep 2>&1 | grep checkpoint
    xz -dc $DEV/vidgen_old.xz > /tmp/vidgen_old && chmod +x /tmp/vidgen_old
    for round in 1 2; do
      for b in vidgen_old vidgen; do
        el "round $round: $b, 4 steps at 124x768x1344, default flags"
        timeout 60 /tmp/$b generate --model /dev/shm/vidgen-minimax-e2e-1 --prompt "a red fox runs through fresh snow at dawn, cinematic" \
          --seed 1 --num-inference-steps 4 --height 768 --width 1344 --num-frames 124 --dtype bf16 --output-type safetensors \
          --output-path /tmp/rope --output-video-name $b-$round --overwrite --stats-json $OUT/rope-$b-$round.json > $OUT/rope-$b-$round.log 2>&1
        echo "    exit $?"; stages $OUT/rope-$b-$round.json
        python3 -c "import json,sys; print('    forwards', json.load(open(sys.argv[1]))['jobs'][0]['metrics']['forward_seconds'])" $OUT/rope-$b-$round.json
      done
    done
    python3 -c "
from safetensors.numpy import load_file; import numpy as np
a = load_file('/tmp/rope/vidgen_old-1.safetensors'); b = load_file('/tmp/rope/vidgen-1.safetensors')
for k in a: print('old vs new', k, a[k].shape, 'max |diff|', float(np.abs(a[k].astype(np.float64) - b[k]).max()))"
    rm -rf /dev/shm/vidgen-minimax-e2e-1 /tmp/rope ;;
  first)
    firstrun cogvideox-5b
    firstrun ltx-video
    firstrun mochi-1
    firstrun latte-1
    firstrun flux.1-dev
    firstrun allegro --num-frames 24 --height 320 --width 320
    firstrun hunyuanvideo --num-frames 33 --height 320 --width 512 ;;
esac; done
el "done"
# The files that come back are few: one archive of OUT.
tar czf /tmp/out.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/out.tgz $OUT/
