# Session 49's calls.
#   1 (carry .device54: the library's CUDA tests, attn_bench and vae_decode of the working tree after 4653353 +
#      the changes committed with this file; .device53/attn_bench.xz: attn_bench at 8333249): the 8-bit kernels
#      with the rows' sums on the tensor core against the host definition (which now sums P's codes), then the
#      Hopper 8-bit kernel timed against 8333249's, interleaved; Nsight Compute's summary of the new kernel; the
#      tiled decodes the walk now plans for OverlapTiles (FLUX.1 at 1536 and 2048 px; CogVideoX-5b 49x480x720).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
case $1 in
  1) for e in lib_tests attn_bench vae_decode; do xz -dc .device54/$e.xz > /tmp/$e && chmod +x /tmp/$e; done
     xz -dc .device53/attn_bench.xz > /tmp/attn_bench_base && chmod +x /tmp/attn_bench_base
     nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
     timeout 150 /tmp/lib_tests --test-threads=1 --nocapture sage_kernels attention::cuda_tests 2>&1 \
       | grep -E "^test |panicked|result:|to host"
     for c in "14B self" 1.3B "14B self"; do
       for v in _base ""; do
         echo "-- attn_bench$v $c"; timeout 60 /tmp/attn_bench$v sage "$c" 2>&1 | grep -E "sage sm90 vs|round" \
           | sed -E 's/, portable.*sage m1 [^,]*//; s/, sage gb10.*//; s/ vs f32//'
       done
     done
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
esac
