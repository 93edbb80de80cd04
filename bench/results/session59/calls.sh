#!/usr/bin/env bash
# Session 59's calls. DEV holds, stripped and xz'd, the builds each call names; .whl the diffusers 0.42.1 wheel.
#   run(carry: [".deviceNN", ".whl"], command: "DEV=.deviceNN bash bench/results/session59/calls.sh N")
#   1: (.device11: examples/vae_decode and the library's CUDA tests at de2de19: session 58's f32 stream
#      of the video VAE fused (af117da, never run before), the audio VAE's SnakeBeta one kernel and its
#      upsampling through the GEMM path) the VAEs' CUDA tests; MiniMax H3's video and audio decodes of the
#      5 s request beside diffusers' in the same call; the audio decode on the GPU against the host's.
#   2: (.device12: the vidgen binary at this call's commit) MiniMax H3's whole video (issue 34 item 5), 4 steps at
#      the published 124x768x1344, vidgen (default flags, then resident) beside diffusers' modular pipeline in
#      the same call, both from one checkpoint in /dev/shm: the published configs with the DiT cut to one block
#      (bench/minimax_e2e.py: the published 133 GB fit neither the host's memory nor its disk).
#   3: (.device12: the vidgen binary at e468995: the decoded frames converted on the device) call 2 again;
#      diffusers only where the GPU holds more than 100 GB (on an H100 it ran out of memory in call 2), vidgen's
#      resident mode only there too (refused on an H100: the 62 GiB encoder beside the rest).
DEV=${DEV:-.device11} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
case $1 in
  1) xz -dc $DEV/vae_decode.xz > /tmp/vae_decode && chmod +x /tmp/vae_decode
     el "CUDA tests: MiniMax H3's VAE and audio VAE kernels"
     timeout 90 /tmp/vidgen-lib-tests --test-threads=1 minimax_h3::vae minimax_h3::audio_vae 2>&1 \
       | grep -E "^test |relative|panicked|off the|result:"
     for round in 1 2; do
       for f in minimax-h3 minimax-h3-audio; do
         el "round $round, decode $f: vidgen"; timeout 60 /tmp/vae_decode --family $f 2>&1 | tail -1
         el "round $round, decode $f: diffusers"
         timeout 60 python3 bench/peer_vae_decode.py $f 2>&1 | grep -v "Warning\|warn\|kept in float32" | tail -1
       done
     done
     el "the audio decode on the GPU against the host's"
     /tmp/vae_decode --family minimax-h3-audio --save $OUT/gpu.safetensors | tail -1
     timeout 120 /tmp/vae_decode --family minimax-h3-audio --cpu --save $OUT/cpu.safetensors | tail -1
     python3 -c "
from safetensors.torch import load_file; import sys
a, b = (load_file(sys.argv[i])['video'] for i in (1, 2)); d = (a - b).abs()
print('gpu vs cpu: max', d.max().item(), 'mean', d.mean().item(), 'mean |x|', b.abs().mean().item())" \
       $OUT/gpu.safetensors $OUT/cpu.safetensors
     el "done" ;;
  2) el "MiniMax H3's whole video, 4 steps, 124x768x1344, the DiT cut to one block"
     timeout 570 python3 bench/minimax_e2e.py --vidgen /tmp/vidgen --out $OUT/e2e --layers 1 2>&1 \
       | grep -v "Warning\|warn\|it/s\]\|float32" | cut -c1-2500 | tail -14
     el "done" ;;
  3) mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
     if [ "$mib" -gt 100000 ]; then extra="--modes default,resident"; else extra="--skip-diffusers --modes default"; fi
     el "MiniMax H3's whole video, 4 steps, 124x768x1344, the DiT cut to one block ($extra)"
     timeout 570 python3 bench/minimax_e2e.py --vidgen /tmp/vidgen --out $OUT/e2e --layers 1 $extra 2>&1 \
       | grep -v "Warning\|warn\|it/s\]\|float32" | cut -c1-2500 | tail -14
     el "done" ;;
esac
