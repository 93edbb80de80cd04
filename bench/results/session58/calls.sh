#!/usr/bin/env bash
# Session 58's calls. DEV holds, stripped and xz'd, the builds each call names; .whl the diffusers 0.42.1 wheel.
#   run(carry: [".deviceNN", ".whl"], command: "DEV=.deviceNN bash bench/results/session58/calls.sh N")
#   1: (.device8: examples/minimax_blocks and examples/vae_decode, the library's CUDA test binary, all of the
#      session's library; the fixtures' MiniMax H3 configs for the peer) issue 34's MiniMax H3 rows: the per-block time at
#      the committed chunking (three 12,741-row chunks, queries in the same chunks) beside diffusers'
#      MiniMaxH3Transformer3DModel in the same call; the video VAE's decode of the 5 s request (diffusers'
#      default: clips and 256 px tiles) and the audio VAE's (f32), each beside diffusers' in the same call;
#      the decoder's residual stream, norms and scales in f32 as diffusers' bf16 load keeps them, its attention
#      fused; the video decode with 28 tiles (a whole clip's) per decoder call; the GPU's decode checked
#      against the host's composition on a small clip; the CUDA tests of MiniMax H3's modules and the cuBLASLt
#      products (the library's test binary); the per-block time of MiniMax H3's DiT with K and V left unfilled before their chunks write them.
#   2: (.device9: the vidgen binary at 3bd5404's library; the library's CUDA test binary) every CUDA test of the
#      library; MiniMax H3's text stage (issue 34 item 4) beside
#      diffusers' in the same call: bench/minimax_text_stage.py (the published Qwen3-VL-32B encoder with random
#      weights in /dev/shm; diffusers' load straight to the device + the pipeline's text step against vidgen's
#      `encode_text` stage, everything resident), two interleaved rounds.
#   4: (.device10: examples/vae_decode and the library's CUDA tests with the VAE's f32 stream fused: its norms
#      with their casts and its scaled residual updates one kernel each, its Linears' biases in their epilogues)
#      the VAE's CUDA tests; MiniMax H3's video and audio decodes beside diffusers' again.
DEV=${DEV:-.device8} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
case $1 in
  1) for b in minimax_blocks vae_decode; do xz -dc $DEV/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
     mkdir -p tests/fixtures && cp $DEV/minimax-h3-configs.json tests/fixtures/
     for f in minimax-h3 minimax-h3-audio; do
       el "decode $f: vidgen"
       timeout 120 /tmp/vae_decode --family $f 2>&1 | tail -3
       el "decode $f: diffusers"
       timeout 150 python3 bench/peer_vae_decode.py $f 2>&1 | grep -v "Warning\|warn" | tail -3
     done
     for n in 28; do
       el "decode minimax-h3, $n tiles per decoder call"
       TILES_PER_CALL=$n timeout 120 /tmp/vae_decode --family minimax-h3 2>&1 | tail -1
     done
     el "the fused decoder on the GPU against the host's composition, bf16, one small clip"
     /tmp/vae_decode --family minimax-h3 1,24,7,4,4 --save $OUT/gpu.safetensors | tail -1
     timeout 100 /tmp/vae_decode --family minimax-h3 1,24,7,4,4 --cpu --save $OUT/cpu.safetensors | tail -1
     python3 -c "
from safetensors.torch import load_file; import sys
a, b = (load_file(sys.argv[i])['video'] for i in (1, 2)); d = (a - b).abs()
print('gpu vs cpu: max', d.max().item(), 'mean', d.mean().item(), 'mean |x|', b.abs().mean().item())" \
       $OUT/gpu.safetensors $OUT/cpu.safetensors
     el "CUDA tests: MiniMax H3's blocks and VAE attention, the cuBLASLt products"
     timeout 150 /tmp/vidgen-lib-tests --test-threads=1 minimax_h3:: linear:: 2>&1 \
       | grep -E "^test |relative|panicked|result:"
     el "MiniMax H3 per block, committed chunking, two rounds"
     timeout 120 /tmp/minimax_blocks 2>&1 | grep -v "^\s*$" | tail -6
     el "diffusers' block"
     timeout 100 python3 bench/peer_minimax_blocks.py --out $OUT/peer 2>&1 | grep -v "kept in float32" | tail -4
     el "done" ;;
  2) el "CUDA tests of the library"
     mkdir -p .device && cp /tmp/vidgen-lib-tests .device/
     timeout 200 bash bench/cuda_tests.sh 2>&1 | grep -E "^test .*(FAILED|ok)$|panicked|result:|relative" | grep -v " ok$" | tail -30
     el "MiniMax H3's text stage"
     timeout 560 python3 bench/minimax_text_stage.py --vidgen /tmp/vidgen --out $OUT/text 2>&1 \
       | grep -v "Warning\|warn\|it/s\]\|float32" | cut -c1-900 | tail -12
     el "done" ;;
  4) xz -dc $DEV/vae_decode.xz > /tmp/vae_decode && chmod +x /tmp/vae_decode
     el "CUDA tests: MiniMax H3's VAE kernels and blocks"
     timeout 60 /tmp/vidgen-lib-tests --test-threads=1 minimax_h3::vae 2>&1 | grep -E "^test |relative|panicked|result:"
     for f in minimax-h3 minimax-h3-audio; do
       el "decode $f: vidgen"; timeout 60 /tmp/vae_decode --family $f 2>&1 | tail -1
       el "decode $f: diffusers"
       timeout 60 python3 bench/peer_vae_decode.py $f 2>&1 | grep -v "Warning\|warn\|kept in float32" | tail -1
     done
     el "done" ;;
esac
