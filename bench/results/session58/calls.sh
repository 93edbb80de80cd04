#!/usr/bin/env bash
# Session 58's calls. DEV holds, stripped and xz'd, the builds each call names; .whl the diffusers 0.42.1 wheel.
#   run(carry: [".deviceNN", ".whl"], command: "DEV=.deviceNN bash bench/results/session58/calls.sh N")
#   1: (.device8: examples/minimax_blocks and examples/vae_decode at 3bd5404's library; the library's CUDA test
#      binary; the fixtures' MiniMax H3 configs for the peer) issue 34's MiniMax H3 rows: the per-block time at
#      the committed chunking (three 12,741-row chunks, queries in the same chunks) beside diffusers'
#      MiniMaxH3Transformer3DModel in the same call; the video VAE's decode of the 5 s request (diffusers'
#      default: clips and 256 px tiles) and the audio VAE's (f32), each beside diffusers' in the same call;
#      the video decode with 4 and 28 (a whole clip's) tiles per decoder call; the decoder with its residual
#      stream, norms and scales in f32 as diffusers' bf16 load keeps them (vae_decode_mixed), 1 and 28 tiles
#      per call; one decoder call under Nsight Compute.
#   2: (.device9: the vidgen binary at 3bd5404's library; the library's CUDA test binary) every CUDA test of the
#      library; MiniMax H3's text stage (issue 34 item 4) beside
#      diffusers' in the same call: bench/minimax_text_stage.py (the published Qwen3-VL-32B encoder with random
#      weights in /dev/shm; diffusers' load straight to the device + the pipeline's text step against vidgen's
#      `encode_text` stage, everything resident), two interleaved rounds.
DEV=${DEV:-.device8} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
case $1 in
  1) for b in minimax_blocks vae_decode vae_decode_mixed; do xz -dc $DEV/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
     mkdir -p tests/fixtures && cp $DEV/minimax-h3-configs.json tests/fixtures/
     for f in minimax-h3 minimax-h3-audio; do
       el "decode $f: vidgen"
       timeout 120 /tmp/vae_decode --family $f 2>&1 | tail -3
       el "decode $f: diffusers"
       timeout 150 python3 bench/peer_vae_decode.py $f 2>&1 | grep -v "Warning\|warn" | tail -3
     done
     for n in 4 28; do
       el "decode minimax-h3, $n tiles per decoder call"
       TILES_PER_CALL=$n timeout 120 /tmp/vae_decode --family minimax-h3 2>&1 | tail -1
     done
     for n in 1 28; do
       el "decode minimax-h3, f32 residual stream as diffusers keeps it, $n tiles per decoder call"
       TILES_PER_CALL=$n timeout 120 /tmp/vae_decode_mixed --family minimax-h3 2>&1 | tail -1
     done
     el "MiniMax H3's video decoder, one 7-frame 256 px tile (one decoder call) under Nsight Compute"
     NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
     timeout 150 $NCU --clock-control none --csv --page raw --metrics gpu__time_duration.sum,launch__grid_size \
       /tmp/vae_decode_mixed --family minimax-h3 1,24,7,16,16 > $OUT/ncu-vae.csv 2> $OUT/ncu-vae.log
     echo "ncu exit $?"; python3 bench/ncu_kernels.py $OUT/ncu-vae.csv minimax-vae | head -30
     xz -T4 $OUT/ncu-vae.csv
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
esac
