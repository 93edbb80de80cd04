#!/usr/bin/env bash
# Run from the repository root on a GPU machine: bench/gpu_hostile.sh PATH/TO/vidgen
# Issue 17 on CUDA: the per-step finiteness check (stages::step_done) in f32 and bf16 on every
# family's loop: an overflowing guidance scale fails the prompt (exit 1, "NaN or infinite at
# denoising step"), the same run with a sane scale writes its video (exit 0).
B=$1; O=/tmp/hostile-gpu; rm -rf $O; mkdir -p $O
run() { # name model dtype guidance flags...
  local n=$1 m=$2 d=$3 g=$4; shift 4
  $B generate --model tests/fixtures/$m --prompt "a cat" --seed 1 --num-inference-steps 2 \
    --device cuda --dtype $d --guidance-scale $g --output-type safetensors --output-path $O \
    --output-video-name $n-$d-$g "$@" > /dev/null 2> $O/$n-$d-$g.log
  local rc=$?
  if [ "$g" = 1e308 ]; then
    [ $rc = 1 ] && grep -q "NaN or infinite at denoising step" $O/$n-$d-$g.log && echo "ok   $n $d refused NaN" || { echo "FAIL $n $d rc=$rc"; tail -3 $O/$n-$d-$g.log; }
  else
    [ $rc = 0 ] && echo "ok   $n $d written" || { echo "FAIL $n $d rc=$rc"; tail -3 $O/$n-$d-$g.log; }
  fi
}
for d in f32 bf16; do for g in 5 1e308; do
  run wan wan-tiny-a $d $g --height 32 --width 32 --num-frames 5 --max-sequence-length 16
  run ltx ltx-video-tiny-a $d $g --height 64 --width 64 --num-frames 9 --max-sequence-length 16
  run cog cogvideox-tiny-a $d $g --height 32 --width 48 --num-frames 17 --max-sequence-length 16
  run hun hunyuanvideo-tiny-a $d $g --height 32 --width 48 --num-frames 17 --max-sequence-length 16 --true-cfg-scale $g --negative-prompt x
done; done
