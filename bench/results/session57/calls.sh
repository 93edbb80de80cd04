#!/usr/bin/env bash
# Session 57's calls. DEV holds, stripped and xz'd, the builds each call names; .whl the diffusers 0.42.1 wheel.
#   run(carry: [".deviceNN", ".whl"], command: "DEV=.deviceNN bash bench/results/session57/calls.sh N")
#   1: (.device7: examples/minimax_blocks of 7ac7eaf's library as minimax_blocks_old, and with K and V written
#      straight into their buffers as minimax_blocks; the library's CUDA test binary; the fixtures' MiniMax H3
#      configs for the peer) MiniMax H3 per block (issue 34: denoise per step <= 0.85x diffusers'; 0.90x in
#      session 56): the fused block's CUDA tests; the per-block time at several (feed-forward rows, query rows)
#      chunkings, two interleaved rounds; diffusers' MiniMaxH3Transformer3DModel per block in the same call; the
#      old and new build in turn; then one 2-block forward at the default chunks under Nsight Compute, every
#      kernel's time and grid.
DEV=${DEV:-.device7} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
case $1 in
  1) for b in minimax_blocks minimax_blocks_old; do xz -dc $DEV/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
     mkdir -p tests/fixtures && cp $DEV/minimax-h3-configs.json tests/fixtures/
     el "CUDA tests: MiniMax H3's fused block, the cuBLASLt products"
     timeout 90 /tmp/vidgen-lib-tests --test-threads=1 minimax_h3::transformer linear:: 2>&1 \
       | grep -E "^test |relative|panicked|result:"
     el "MiniMax H3 per block by chunking (K and V written in place)"
     CHUNKS=2340:9362,9362:9362,7645:7645,all:all timeout 120 /tmp/minimax_blocks 2>&1 \
       | grep -v "^\s*$" | tail -8
     el "diffusers' block"
     timeout 100 python3 bench/peer_minimax_blocks.py --out $OUT/peer 2>&1 | grep -v "kept in float32" | tail -4
     el "old and new build in turn"
     for b in minimax_blocks_old minimax_blocks; do
       echo "$b"; CHUNKS=2340:9362 timeout 60 /tmp/$b 2>&1 | grep "per block"
     done
     el "MiniMax H3, one 2-block forward under Nsight Compute"
     NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
     PROFILE=1 timeout 90 $NCU --clock-control none --csv --page raw \
       --metrics gpu__time_duration.sum,launch__grid_size /tmp/minimax_blocks > $OUT/ncu-minimax.csv 2> $OUT/ncu.log
     echo "ncu exit $?"; python3 bench/ncu_kernels.py $OUT/ncu-minimax.csv minimax | head -30
     xz -T4 $OUT/ncu-minimax.csv ;;
esac
