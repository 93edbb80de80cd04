# Session 49's calls.
#   1 (carry .device54: the library's CUDA tests, attn_bench and vae_decode of the working tree after 4653353 +
#      the changes committed with this file; .device53/attn_bench.xz: attn_bench at 8333249): the 8-bit kernels
#      with the rows' sums on the tensor core against the host definition (which now sums P's codes), then the
#      Hopper 8-bit kernel timed against 8333249's, interleaved; Nsight Compute's summary of the new kernel; the
#      tiled decodes the walk now plans for OverlapTiles (FLUX.1 at 1536 and 2048 px; CogVideoX-5b 49x480x720).
#   2 (carry .device55: vidgen at 767fd08 and attn_bench with each key block's scale read a tile ahead; .device54;
#      .whl: diffusers' wheel): session 42's call 2, never run: Mochi-1's full-size frames in f32 (diffusers' saved),
#      then in bf16: diffusers' own bf16 against its f32 (how far rounding alone moves them) beside vidgen's bf16
#      against diffusers' bf16 (mean 0.25 in session 41). Then the 8-bit Hopper kernel with and without the scale
#      read ahead, interleaved, and the per-instruction stall samples of the kernel as committed.
#   3 (carry .device55, .device54/attn_bench.xz, .whl): Mochi-1's spread again, with vidgen's f32 frames as the f32
#      reference (diffusers' f32 run does not fit an H100's 80 GB; session 42 found vidgen's f32 within max 0.0123,
#      mean 0.00023 of diffusers' f32): diffusers' bf16 and vidgen's bf16 each against vidgen's f32. Then the 8-bit
#      Hopper kernel with the last tile's P V waited for before the exponentials (c; ptxas hoists the wait to the
#      tile's start), and d: c with P's packing in the exponentials' basic block, against 767fd08's, interleaved.
#   4 (carry .device55/attn_bench_p4.xz, .device54/attn_bench.xz): one exponential in four of each tile on the FMA
#      pipe (a degree-3 fit; ptxas then interleaves the rest of the MUFUs with it), against 767fd08's, interleaved.
#   5 (carry .device55/offload_bench_trace.xz: offload_bench with a temporary trace of the pool's use inside
#      HunyuanVideo's joint attention, not committed): which tensors hold the dual-stream block's attention peak on
#      CUDA (the plan counts eight copies of the joint sequence there, the CPU's chunked path six), at 33x320x512.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
case $1 in
  1) for e in lib_tests attn_bench vae_decode; do xz -dc .device54/$e.xz > /tmp/$e && chmod +x /tmp/$e; done
     xz -dc .device53/attn_bench.xz > /tmp/attn_bench_base && chmod +x /tmp/attn_bench_base
     nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
     timeout 150 /tmp/lib_tests --test-threads=1 --nocapture sage_kernels attention::cuda_tests 2>&1 \
       | grep -E "^test |panicked|result:|to host"
     bash bench/sage_ab.sh attn_bench_base=/tmp/attn_bench_base attn_bench=/tmp/attn_bench
     echo "== tiled decodes (used_peak_gib above weights and latents)"
     for s in "flux.1-dev 1,16,1,192,192" "flux.1-dev 1,16,1,256,256" "cogvideox-5b 1,16,13,60,90"; do
       set -- $s
       timeout 200 /tmp/vae_decode --family $1 $2 --tiled 2>> $OUT/tiled-decode.err | tee -a $OUT/tiled-decode.jsonl
     done
     tail -3 $OUT/tiled-decode.err
     echo "== Nsight Compute: the 8-bit Hopper kernel, 1.3B self"
     timeout 150 ncu --set full --import-source no -k regex:sage_fwd_sm90 --launch-count 1 -o $OUT/sage /tmp/attn_bench sage 1.3B \
       > $OUT/ncu.log 2>&1
     echo "ncu exit $?"; tail -2 $OUT/ncu.log
     ncu --import $OUT/sage.ncu-rep --page details > $OUT/sage-details.txt 2>&1
     grep -E "sm90|Duration|Issue Slots Busy|Executed Ipc A|No Eligible|Warp Cycles Per Issued|Compute \(SM\) Th|Registers Per" \
       $OUT/sage-details.txt
     ncu --import $OUT/sage.ncu-rep --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
head, vals = rows[0], rows[-1]
for h, v in zip(head, vals):
    if any(k in h for k in ("pipe_tensor", "smsp__pcsamp_warps_issue_stalled", "inst_executed_pipe_xu", "pipe_fma_cycles", "pipe_alu_cycles")):
        if "pct" in h or "stalled" in h or "xu" in h:
            print(h, v)' | sort -t' ' -k2 -g -r | head -30;;
  2) export PATH=/opt/torch/.venv/bin:$PATH
     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
     xz -dc .device55/vidgen.xz > /tmp/vidgen && chmod +x /tmp/vidgen
     e2e() { PYTHONPATH=/tmp/site timeout "$1" python3 bench/family_e2e.py --vidgen /tmp/vidgen --ckpt-root /dev/shm/vidgen-e2e \
       --vidgen-modes default "${@:2}" 2>&1 | grep -E "frames vs|Error|^\| mochi" | cut -c1-300; }
     echo "== mochi-1 f32: diffusers' frames saved"; date
     e2e 250 --family mochi-1 --dtype f32 --out $OUT/f32 --diffusers-frames /dev/shm/mochi-f32.npy --vidgen-modes ""
     rm -rf /dev/shm/vidgen-e2e/mochi-1*
     echo "== mochi-1 bf16: diffusers against its f32 frames, vidgen against diffusers"; date
     e2e 280 --family mochi-1 --out $OUT/bf16 --diffusers-frames /dev/shm/mochi-f32.npy; date
     xz -dc .device54/attn_bench.xz > /tmp/ab_now && xz -dc .device55/attn_bench_prefetch.xz > /tmp/ab_prefetch
     chmod +x /tmp/ab_now /tmp/ab_prefetch
     bash bench/sage_ab.sh now=/tmp/ab_now prefetch=/tmp/ab_prefetch
     echo "== stall samples by instruction, 8-bit Hopper kernel (767fd08), 1.3B self"
     timeout 120 ncu --set full --import-source no -k regex:sage_fwd_sm90 --launch-count 1 -o $OUT/sage /tmp/ab_now sage 1.3B \
       > $OUT/ncu.log 2>&1; echo "ncu exit $?"
     ncu --import $OUT/sage.ncu-rep --page source --csv --print-source sass > $OUT/sage-source.csv 2> $OUT/sage-source.err
     python3 bench/results/session49/stalls.py $OUT/sage-source.csv;;
  3) export PATH=/opt/torch/.venv/bin:$PATH
     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
     xz -dc .device55/vidgen.xz > /tmp/vidgen && chmod +x /tmp/vidgen
     echo "== mochi-1 bf16: diffusers' frames saved, vidgen against them"; date
     PYTHONPATH=/tmp/site timeout 280 python3 bench/family_e2e.py --vidgen /tmp/vidgen --ckpt-root /dev/shm/vidgen-e2e \
       --vidgen-modes default --family mochi-1 --out $OUT/bf16 --diffusers-frames /dev/shm/mochi-diffusers-bf16.npy 2>&1 \
       | grep -E "frames vs|Error|^\| mochi" | cut -c1-300
     ck=$(ls -d /dev/shm/vidgen-e2e/*/ | grep -i mochi | head -1); echo "checkpoint $ck"
     for d in f32 bf16; do
       /tmp/vidgen generate --model $ck --prompt "a red fox runs through fresh snow at dawn, cinematic" --seed 1 \
         --num-inference-steps 4 --height 480 --width 848 --num-frames 19 --guidance-scale 4.5 --max-sequence-length 256 \
         --device cuda --dtype $d --output-path /dev/shm/v --output-video-name mochi-$d --output-type safetensors \
         --overwrite > /dev/shm/v-$d.log 2>&1; echo "vidgen $d exit $?"; tail -1 /dev/shm/v-$d.log
     done; date
     python3 - <<'PY'
import numpy as np
from safetensors.numpy import load_file
f32 = load_file("/dev/shm/v/mochi-f32.safetensors")["frames"].astype(np.float32)
bf16 = load_file("/dev/shm/v/mochi-bf16.safetensors")["frames"].astype(np.float32)
dif = np.load("/dev/shm/mochi-diffusers-bf16.npy").astype(np.float32)
for name, x, ref in [("vidgen bf16 vs vidgen f32", bf16, f32), ("diffusers bf16 vs vidgen f32", dif, f32),
                     ("vidgen bf16 vs diffusers bf16", bf16, dif)]:
    d = np.abs(x - ref)
    print(f"{name}: max {d.max():.4f}, mean {d.mean():.4f}; frames mean {x.mean():.4f} (reference {ref.mean():.4f})")
PY
     xz -dc .device54/attn_bench.xz > /tmp/ab_now; for v in c d; do xz -dc .device55/attn_bench_$v.xz > /tmp/ab_$v; done
     chmod +x /tmp/ab_*
     bash bench/sage_ab.sh now=/tmp/ab_now c=/tmp/ab_c d=/tmp/ab_d;;
  5) xz -dc .device55/offload_bench_trace.xz > /tmp/ob && chmod +x /tmp/ob
     VIDGEN_TRACE_MEM=1 timeout 300 /tmp/ob synthetic:hunyuanvideo 1 33x320x512 \
       "none: --dit-layerwise-offload=false --dit-cpu-offload=false" 2>&1 | grep -E "trace|rror|peak" | head -40;;
  4) xz -dc .device54/attn_bench.xz > /tmp/ab_now && xz -dc .device55/attn_bench_p4.xz > /tmp/ab_p4; chmod +x /tmp/ab_*
     bash bench/sage_ab.sh now=/tmp/ab_now p4=/tmp/ab_p4;;
esac
