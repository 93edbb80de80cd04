#!/usr/bin/env bash
# Session 55's calls. DEV holds, stripped and xz'd, vidgen, examples/attn_bench and examples/linear_bench built
# with `--features cuda` at the working tree (the plan's guidance batch and outer moments, `device_planned_bytes`
# in --stats-json); .whl the diffusers 0.42.1 wheel (family_e2e.py writes its random checkpoints with it).
#   run(carry: [".deviceNN", ".whl"], command: "DEV=.deviceNN bash bench/results/session55/calls.sh N")
#   1: issue 36 on the card its targets name: the 8-bit attention against the exact kernel (attn_bench sage, 14B
#      and 1.3B self-attention), the fp8 Linear against bf16 (linear_bench), and the whole 4-step videos of the
#      fast recipe (--fp8-matmul --attention sage, CFG off; bench/family_e2e.py --fewstep, vidgen only): the 1.3B
#      (target <= 5 s) and the 14B (<= 15 s), default flags and resident.
#   2: issue 34's plan against the measured peak, through the command line (--stats-json's device_planned_bytes
#      beside device_used_peak, every stage): LTX-Video, CogVideoX-5b and Mochi-1 at their default sizes, 2 steps,
#      guided with the default flags, and unguided (--guidance-scale 1) at leaf level; Wan2.1 1.3B unguided at
#      leaf level (the plan was 11.6% over offload_bench's forward, which holds no scheduler latents). Then
#      MiniMax H3's --fp8-matmul on CUDA (new): synthetic, 120x384x672, 2 steps, exact and fp8, the outputs'
#      relative L2 (the decoded frames and audio: the family writes no latents). Call 2's first runs stopped at a
#      usage error (one step; latents asked); call 3 runs them again, and MiniMax H3's control: `--attention
#      sage` against exact, whose audio shows how much the random audio VAE amplifies a small change. Last, the
#      1.3B's 4-step fast recipe with the default flags again: its text encoder now loads whole where the plan
#      fits what is free (call 1: streamed, 5.21 s). Last, GB10's limits on this card: the 1.3B's 4-step fast recipe with the kernels' shared
#      memory capped at GB10's 101,376 bytes a block (VIDGEN_MAX_SHARED_MEMORY_PER_BLOCK: the Hopper kernels
#      decline, the portable ones run) against the same run uncapped.
DEV=${DEV:-.device3} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
for b in attn_bench linear_bench; do xz -dc $DEV/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
fewstep() {  # fewstep FAMILY MODES: the 4-step recipe's whole video, vidgen only
  el "$1 fewstep: $2"
  timeout 400 python3 bench/family_e2e.py --family $1 --vidgen /tmp/vidgen --out $OUT/e2e --steps 4 --fewstep \
    --skip-diffusers --ckpt-root /dev/shm/vidgen-e2e --vidgen-modes $2 > $OUT/$1.log 2>&1
  echo "exit $?"; tail -12 $OUT/$1.log
  python3 bench/family_e2e.py --table $OUT/e2e
  rm -rf /dev/shm/vidgen-e2e
}
case $1 in
  1) el "attn_bench sage: 14B and 1.3B self-attention, twice"
     for c in "14B self" 1.3B "14B self"; do timeout 90 /tmp/attn_bench sage "$c" 2>&1 | grep -vE "^$" | tail -8; done
     el "linear_bench"
     timeout 150 /tmp/linear_bench 2>&1 | grep -E "^\||bf16|fp8" | head -30
     fewstep wan2.1-t2v-1.3b fast,fast-resident,fast
     fewstep wan2.1-t2v-14b fast,fast-resident ;;
  2) mkdir -p $OUT/plan
     for m in ltx-video cogvideox-5b mochi-1; do
       planned $m-default $m
       planned $m-leaf-unguided $m --guidance-scale 1 --dit-layerwise-offload --offload-type leaf-level
     done
     planned wan13-leaf-unguided wan2.1-t2v-1.3b --guidance-scale 1 --dit-layerwise-offload --offload-type leaf-level
     for mode in exact fp8; do
       flags=""; [ $mode = fp8 ] && flags=--fp8-matmul
       el "minimax-h3 $mode"
       timeout 240 /tmp/vidgen generate --model synthetic:minimax-h3 --prompt "a red fox runs through fresh snow" \
         --seed 1 --num-frames 120 --height 384 --width 672 --num-inference-steps 2 --dtype bf16 $flags \
         --output-type safetensors --output-path /tmp/v --output-video-name minimax-$mode --overwrite \
         --stats-json $OUT/minimax-$mode.json > $OUT/minimax-$mode.log 2>&1
       echo "exit $?: $(grep -E 'fp8 matmuls|transformer forwards|error' $OUT/minimax-$mode.log | tr '\n' ' ')"
     done
     python3 -c "
from safetensors.numpy import load_file
a = load_file('/tmp/v/minimax-exact.safetensors'); b = load_file('/tmp/v/minimax-fp8.safetensors')
for k in a:
    x, y = a[k].astype('float64'), b[k].astype('float64')
    print('minimax', k, x.shape, 'fp8 vs exact: relative L2', (((x - y) ** 2).sum() / (x ** 2).sum()) ** 0.5)" 2>&1 | tail -3
     for cap in none 101376; do
       el "1.3B fast recipe, shared memory cap $cap"
       env $([ $cap = none ] || echo VIDGEN_MAX_SHARED_MEMORY_PER_BLOCK=$cap) timeout 120 /tmp/vidgen generate \
         --model synthetic:wan2.1-t2v-1.3b --prompt "a red fox runs through fresh snow" --seed 1 --num-frames 81 \
         --height 480 --width 832 --num-inference-steps 4 --guidance-scale 1 --scheduler euler \
         --sigmas 1,0.75,0.5,0.25 --fp8-matmul --attention sage --dtype bf16 --output-type safetensors \
         --output-path /tmp/v --output-video-name cap-$cap --overwrite --stats-json $OUT/cap-$cap.json \
         > $OUT/cap-$cap.log 2>&1
       echo "exit $?: $(grep -E 'fp8 matmuls|transformer forwards|error' $OUT/cap-$cap.log | tr '\n' ' ')"
     done
     python3 -c "
from safetensors.numpy import load_file
a = load_file('/tmp/v/cap-none.safetensors')['frames'].astype('float64')
b = load_file('/tmp/v/cap-101376.safetensors')['frames'].astype('float64')
print('capped vs uncapped frames: relative L2', (((a - b) ** 2).sum() / (a ** 2).sum()) ** 0.5)" 2>&1 | tail -1 ;;
  3) mkdir -p $OUT/plan
     for m in ltx-video cogvideox-5b mochi-1; do
       planned $m-default $m
       planned $m-leaf-unguided $m --guidance-scale 1 --dit-layerwise-offload --offload-type leaf-level
     done
     planned wan13-leaf-unguided wan2.1-t2v-1.3b --guidance-scale 1 --dit-layerwise-offload --offload-type leaf-level
     planned wan13-default wan2.1-t2v-1.3b
     bash $0 minimax
     (cd $OUT && tar cf plan.tar plan && rm -r plan)
     fewstep wan2.1-t2v-1.3b fast
     (cd $OUT && tar cf e2e.tar e2e && rm -r e2e) ;;
  minimax)
     for mode in exact fp8 sage; do
       flags=""; [ $mode = fp8 ] && flags=--fp8-matmul; [ $mode = sage ] && flags="--attention sage"
       el "minimax-h3 $mode"
       timeout 240 /tmp/vidgen generate --model synthetic:minimax-h3 --prompt "a red fox runs through fresh snow" \
         --seed 1 --num-frames 120 --height 384 --width 672 --num-inference-steps 2 --dtype bf16 $flags \
         --output-type safetensors --output-path /tmp/v --output-video-name minimax-$mode --overwrite \
         > $OUT/minimax-$mode.log 2>&1
       echo "exit $?: $(grep -E 'fp8 matmuls|sage|transformer forwards|error' $OUT/minimax-$mode.log | tr '\n' ' ')"
     done
     python3 -c "
from safetensors.numpy import load_file
a = load_file('/tmp/v/minimax-exact.safetensors')
for mode in ['fp8', 'sage']:
    b = load_file(f'/tmp/v/minimax-{mode}.safetensors')
    for k in a:
        x, y = a[k].astype('float64'), b[k].astype('float64')
        print('minimax', k, x.shape, mode, 'vs exact: relative L2', (((x - y) ** 2).sum() / (x ** 2).sum()) ** 0.5)" 2>&1 | tail -4 ;;
esac
el done
