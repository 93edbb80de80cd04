# Session 48's calls.
#   1 (carry .device50/vidgen.xz, the binary at 873ef13; behaviour as at 6ced4c2): session 47's call 3 (whole FLUX.1-dev
#      images at 768x768, 4 steps, through the command line: resident, streamed, 16 GiB kept), then the same image with
#      default flags while another process (PyTorch) holds all but 18 GiB of the device: the automatic kept budget
#      under memory pressure, its plan (dry run under the same pressure) against each stage's measured peak, and the
#      image against the resident one.
#   2 (carry .device51: attn_bench and vae_decode at 6ced4c2) HunyuanVideo's decode peaks at five sizes (its
#      plan is 13% over at 33x320x512, within 5% at 720p), and Nsight Compute on the exact and the 8-bit Hopper
#      attention kernels at the 1.3B self-attention shape (issue 36: 8-bit at 1.11-1.13x against 1.6x), and both
#      kernels with keys and values loaded by two producer threads (split), and with deeper stages (deep).
#   Run as: call 1 = `calls.sh 2` (its HunyuanVideo decode lines were lost: only 8 files come back from $OUT), call 2 =
#   `calls.sh 1`. Calls 3 and 4 ran inline on the same builds:
#   3 (H100, warm after call 2): `vae_decode --family hunyuanvideo` at the five latent shapes of `calls.sh 2`, to
#      stdout; `attn_bench_split sage "1.3B"` and `"14B self"`; session 47's `calls.sh 3`.
#   4 (H200; .device52/lib_tests.xz: the library's CUDA tests with the polynomial build): `lib_tests sage_attn::cuda_tests
#      attention::cuda_tests`, then `attn_bench{,_ilp,_poly} sage "14B self"` and `"1.3B"`, interleaved, twice for 14B.
#      (The first filter matched nothing: the 8-bit kernel's test is `models::sage_kernels::cuda_tests`.)
#   3 (not run: no device time left; carry .device53: the library's CUDA tests and attn_bench at 8333249, and
#      .device51/attn_bench.xz at 6ced4c2): the committed 8-bit kernel (four stages from two producer threads, the
#      shorter row reductions) against the host definition, then timed against the base build.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
case $1 in
  1) OUT=$OUT bash bench/results/session47/calls.sh 3
     python3 - > $OUT/holder.log 2>&1 <<'PY' &
import time, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(free - 18 * 2**30, dtype=torch.uint8, device="cuda")
print(f"held {held.numel() / 2**30:.2f} GiB of {total / 2**30:.2f}", flush=True)
open("/tmp/holding", "w").close()
time.sleep(400)
PY
     holder=$!
     for i in $(seq 60); do [ -f /tmp/holding ] && break; sleep 1; done
     cat $OUT/holder.log; nvidia-smi --query-gpu=memory.used,memory.free --format=csv,noheader
     common="--model synthetic:flux.1-dev --prompt a-fox --height 768 --width 768 --num-inference-steps 4 --seed 1"
     /tmp/vidgen generate $common --dry-run > $OUT/pressure-plan.txt 2>&1
     /tmp/vidgen generate $common --dry-run --json > $OUT/pressure-plan.json 2> /dev/null
     cat $OUT/pressure-plan.txt
     timeout 200 /tmp/vidgen generate $common --output-type safetensors --output-path $OUT/pressure \
       --stats-json $OUT/pressure-stats.json > $OUT/pressure.log 2>&1
     echo "== pressure exit $?"; grep -E "transformer:|kept|forwards" $OUT/pressure.log | head -4
     python3 bench/cli_stage_summary.py $OUT/pressure-stats.json $OUT/pressure-plan.json
     python3 - $OUT <<'PY'
import glob, sys
from safetensors.numpy import load_file
frames = lambda label: load_file(glob.glob(f"{sys.argv[1]}/{label}/*.safetensors")[0])["frames"]
print("pressure max abs diff vs resident", float(abs(frames("pressure") - frames("resident")).max()))
PY
     kill $holder; wait;;
  2) for e in attn_bench vae_decode; do xz -dc .device51/$e.xz > /tmp/$e && chmod +x /tmp/$e; done
     echo "== HunyuanVideo decode peaks (bf16)"
     for s in 1,16,5,40,64 1,16,9,40,64 1,16,17,40,64 1,16,9,60,106 1,16,33,90,160; do
       timeout 100 /tmp/vae_decode --family hunyuanvideo $s 2>> $OUT/hunyuan-decode.err | tee -a $OUT/hunyuan-decode.jsonl
     done
     for v in split deep; do xz -dc .device51/attn_bench_$v.xz > /tmp/attn_bench_$v && chmod +x /tmp/attn_bench_$v; done
     echo "== Hopper attention kernels: base (6ced4c2), split (keys and values loaded by two producer threads), deep"
     echo "   (split, and 4 stages of 8-bit tiles, 3 of bf16 tiles); interleaved, base twice"
     for v in "" _split _deep "" _split _deep; do
       for c in 1.3B "14B self"; do
         echo "-- attn_bench$v $c"; timeout 60 /tmp/attn_bench$v sage "$c" 2>&1 | grep -E "exact|sage sm90" | tee -a $OUT/attn$v.txt
       done
     done
     for v in "" _deep; do
       echo "== Nsight Compute: attn_bench$v exact and 8-bit Hopper kernels, 1.3B self"
       timeout 150 ncu --set full --import-source no -k regex:sm90 --launch-count 2 -o $OUT/attn$v /tmp/attn_bench$v sage 1.3B \
         > $OUT/ncu-attn$v.log 2>&1
       echo "ncu exit $?"; tail -2 $OUT/ncu-attn$v.log
       ncu --import $OUT/attn$v.ncu-rep --page details > $OUT/attn$v-details.txt 2>&1
       ncu --import $OUT/attn$v.ncu-rep --page source --csv --print-source sass > $OUT/attn$v-source.csv 2> $OUT/attn$v-source.err
       grep -E "sm90|Duration|Issue Slots Busy|Executed Ipc A|No Eligible|Warp Cycles Per Issued|Compute \(SM\) Th" $OUT/attn$v-details.txt
     done
     ls -la $OUT/attn*;;
  3) xz -dc .device53/lib_tests.xz > /tmp/lt && chmod +x /tmp/lt
     timeout 150 /tmp/lt --test-threads=1 sage_kernels attention::cuda_tests 2>&1 | grep -E "^test |panicked|result:"
     xz -dc .device51/attn_bench.xz > /tmp/ab_base && xz -dc .device53/attn_bench.xz > /tmp/ab_now
     chmod +x /tmp/ab_base /tmp/ab_now
     bash bench/sage_ab.sh base=/tmp/ab_base now=/tmp/ab_now;;
esac
