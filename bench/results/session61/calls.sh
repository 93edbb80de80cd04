#!/usr/bin/env bash
# Session 61's call. DEV holds, stripped and xz'd, the vidgen binary and the library's CUDA tests at b032979; .whl
# the diffusers 0.42.1 wheel.
#   run(carry: [".device15", ".whl"], needs_h200: true, command: "DEV=.device15 bash bench/results/session61/calls.sh")
# The download's CUDA tests (b032979 tidied `Download`); then, on a card of more than 100 GB, MiniMax H3's whole
# video (issue 34 item 5), 4 steps at the published 124x768x1344, vidgen (default flags, then resident) beside
# diffusers' modular pipeline in the same call, both from one checkpoint in /dev/shm: the published configs with
# the DiT cut to one block (bench/minimax_e2e.py).
DEV=${DEV:-.device15} source bench/device_setup.sh
export PYTHONPATH=/tmp/site
el "CUDA tests: the download to host memory"
timeout 60 /tmp/vidgen-lib-tests --test-threads=1 offload::transfer::cuda_tests 2>&1 | grep -E "^test |panicked|result:"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -gt 100000 ]; then
  el "MiniMax H3's whole video, 4 steps, 124x768x1344, the DiT cut to one block, beside diffusers"
  timeout 540 python3 bench/minimax_e2e.py --vidgen /tmp/vidgen --out $OUT/e2e --layers 1 --modes default,resident 2>&1 \
    | grep -v "Warning\|warn\|it/s\]\|float32" | cut -c1-2500 | tail -14
fi
el "done"
