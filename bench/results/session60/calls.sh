#!/usr/bin/env bash
# Session 60's calls. DEV holds, stripped and xz'd, the builds each call names; .whl the diffusers 0.42.1 wheel.
#   run(carry: [".device13", ".whl"], needs_h200: true, command: "DEV=.device13 bash bench/results/session60/calls.sh 1")
#   1: (.device13: the vidgen binary at 057dd9e and the library's CUDA tests at 0688750: the decoded pieces downloaded through
#      pinned buffers kept across pieces, and the plan of the fused bf16 DiT block; vidgen_old: session 59's e468995)
#      the download's CUDA tests; MiniMax H3's
#      whole video (issue 34 item 5), 4 steps at the published 124x768x1344, vidgen (default flags, then resident)
#      beside diffusers' modular pipeline in the same call, both from one checkpoint in /dev/shm: the published
#      configs with the DiT cut to one block (bench/minimax_e2e.py); then the old and the new binary in turn with
#      default flags on the same checkpoint (the frame handoff, before and after); MiniMax H3's DiT per block
#      (examples/minimax_blocks at 0688750: the committed chunking) beside diffusers' in the same call.
#   2: (.device13, a GPU of more than 100 GB) MiniMax H3's whole video beside diffusers' alone, as in 1.
DEV=${DEV:-.device13} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
case $1 in
  1) for b in vidgen_old minimax_blocks; do xz -dc $DEV/$b.xz > /tmp/$b && chmod +x /tmp/$b; done
     el "CUDA tests: the download to host memory"
     timeout 60 /tmp/vidgen-lib-tests --test-threads=1 offload::transfer::cuda_tests 2>&1 | grep -E "^test |panicked|result:"
     mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
     if [ "$mib" -gt 100000 ]; then extra="--modes default,resident"; else extra="--skip-diffusers --modes default"; fi
     el "MiniMax H3's whole video, 4 steps, 124x768x1344, the DiT cut to one block ($extra)"
     timeout 400 python3 bench/minimax_e2e.py --vidgen /tmp/vidgen --out $OUT/e2e --layers 1 --keep $extra 2>&1 \
       | grep -v "Warning\|warn\|it/s\]\|float32" | cut -c1-2500 | tail -14
     for round in 1 2; do
       for b in vidgen_old vidgen; do
         el "round $round: $b, default flags"
         timeout 100 python3 bench/minimax_e2e.py --vidgen /tmp/$b --out $OUT/$b-$round --layers 1 --keep \
           --skip-diffusers --modes default 2>&1 | grep -E "vidgen|decode" | cut -c1-600 | tail -4
         python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); j=d['jobs'][0]
print('  ', ', '.join('%s %.2f' % (s['name'], s['seconds']) for s in j['stages']), '| wall %.2f' % d['wall_seconds'])
for s, v in j['metrics']['stages'].items():
    if s in ('denoise', 'decode_video'):
        print('   %s: used %.3f GiB, planned %.3f' % (s, v['device_used_peak'] / 2**30, (v.get('device_planned_bytes') or 0) / 2**30))" \
           $OUT/$b-$round/minimax-h3-default.stats.json
       done
     done
     rm -rf /dev/shm/vidgen-minimax-e2e-1
     for round in 1 2; do
       el "round $round: MiniMax H3's DiT per block, vidgen"
       timeout 120 /tmp/minimax_blocks 2>&1 | grep -v "^\s*$" | tail -4
       el "round $round: MiniMax H3's DiT per block, diffusers"
       timeout 100 python3 bench/peer_minimax_blocks.py --out $OUT/peer-$round 2>&1 | grep -v "kept in float32" | tail -3
     done
     el "done" ;;
  2) el "MiniMax H3's whole video, 4 steps, 124x768x1344, the DiT cut to one block, beside diffusers"
     timeout 560 python3 bench/minimax_e2e.py --vidgen /tmp/vidgen --out $OUT/e2e --layers 1 --modes default,resident 2>&1 \
       | grep -v "Warning\|warn\|it/s\]\|float32" | cut -c1-2500 | tail -14
     el "done" ;;
esac
