#!/usr/bin/env bash
# Every video family's VAE decode (issue 34 item 1: the causal-conv ones and Latte-1's image VAE) in ONE device call, vidgen and diffusers:
#   here:   CUDA build of vidgen's example: strip + xz into .device/vae_decode.xz
#   device: run(carry: [".device"], command: "bash bench/vae_family.sh", timeout_s: 600)
# (a) the fused norms against the candle compositions (VIDGEN_FUSED_NORMS=off) on a small decode
#     of each family: max |difference| of the frames;
# (b) each family's decode at its pipeline's default size, fused norms on and off, and diffusers'
#     untiled and tiled decode of the same config and shape (bench/peer_vae_decode.py), and
#     each family tiled as its `--vae-tiling` tiles;
# (c) FAMILIES=, SMALL=0 (skip a), UNFUSED=0 (skip the candle norms at default size) narrow it
#     (FAMILIES=allegro runs only with SMALL=0 and without HOST_CHECK: its VAE decodes whole tiles only)
#     down; PEERS= names the families whose diffusers decode runs (default: all); NCU=1 adds a
#     per-kernel time summary (ncu) of a small decode (NCU_FAMILIES=; NCU_SHAPE=b,c,f,h,w another latent shape); VAE_DECODE= runs another
#     build of the example (a patch's, beside HEAD's in one call).
# (d) HOST_CHECK=1 runs only this: each family's decode at the published widths on a small latent, on the GPU
#     in bf16 and in f32 against the host's f32 decode of the same weights and latents (the device kernels'
#     error at full width, where the fixtures' tiny widths miss whole channel tiles).
# diffusers comes from the wheel carried in .whl (python3 -m pip download --no-deps diffusers==0.42.1 -d .whl).
set -u
export PATH=/opt/torch/.venv/bin:$PATH
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site
fi
OUT=${OUT:-/tmp/vae_family}; mkdir -p "$OUT"
B=/tmp/vae-bin; mkdir -p "$B"
if [ -n "${VAE_DECODE:-}" ]; then
  V=$VAE_DECODE
else
  xz -dc .device/vae_decode.xz > "$B/vae_decode" && chmod +x "$B/vae_decode"
  V="$B/vae_decode"
fi
FAMILIES=${FAMILIES:-"ltx-video cogvideox-5b mochi-1 hunyuanvideo latte-1"}
small() { case $1 in ltx-video) echo 1,128,3,8,11;; cogvideox-5b) echo 1,16,3,30,45;;
  mochi-1) echo 1,12,3,30,53;; hunyuanvideo) echo 1,16,5,30,40;; latte-1) echo 1,4,4,32,32;; esac; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
if [ "${HOST_CHECK:-0}" = 1 ]; then
  for f in $FAMILIES; do
    el "$f: GPU bf16 and f32 against the host's f32"
    case $f in ltx-video) c=128;; mochi-1) c=12;; latte-1) c=4;; *) c=16;; esac; z=1,$c,3,6,7
    timeout 240 "$V" --family "$f" $z --f32 --cpu --save "$OUT/$f-host.st" | tee -a "$OUT/log.jsonl"
    "$V" --family "$f" $z --f32 --save "$OUT/$f-f32.st" | tee -a "$OUT/log.jsonl"
    "$V" --family "$f" $z --save "$OUT/$f-bf16.st" | tee -a "$OUT/log.jsonl"
    python3 - "$OUT/$f-host.st" "$OUT/$f-f32.st" "$OUT/$f-bf16.st" <<'PY' 2>&1 | tee -a "$OUT/log.jsonl"
import sys, json
from safetensors.torch import load_file
host, f32, bf16 = (load_file(p)["video"] for p in sys.argv[1:4])
d = lambda a: {"max_abs": float((a - host).abs().max()), "mean_abs": float((a - host).abs().mean())}
print(json.dumps({"host_mean_abs": float(host.abs().mean()), "gpu_f32_vs_host": d(f32), "gpu_bf16_vs_host": d(bf16)}))
PY
    rm -f "$OUT"/$f-*.st
  done
  el done; exit 0
fi
[ "${SMALL:-1}" = 1 ] && for f in $FAMILIES; do
  el "$f small: fused vs candle norms"
  "$V" --family "$f" "$(small "$f")" --save "$OUT/$f-fused.st" 2>&1 | tee -a "$OUT/log.jsonl"
  VIDGEN_FUSED_NORMS=off "$V" --family "$f" "$(small "$f")" --save "$OUT/$f-candle.st" 2>&1 | tee -a "$OUT/log.jsonl"
  python3 - "$OUT/$f-fused.st" "$OUT/$f-candle.st" <<'PY' 2>&1 | tee -a "$OUT/log.jsonl"
import sys, json
from safetensors.torch import load_file
a, b = (load_file(p)["video"] for p in sys.argv[1:3])
print(json.dumps({"fused_vs_candle_max_abs": float((a - b).abs().max()), "max_abs": float(b.abs().max())}))
PY
  rm -f "$OUT"/*.st
done
for f in $FAMILIES; do
  el "$f default size"
  timeout 300 "$V" --family "$f" 2>&1 | tee -a "$OUT/log.jsonl"
  [ "${UNFUSED:-1}" = 1 ] && VIDGEN_FUSED_NORMS=off timeout 300 "$V" --family "$f" 2>&1 | tee -a "$OUT/log.jsonl"
  timeout 200 "$V" --family "$f" --tiled 2>&1 | tee -a "$OUT/log.jsonl"
  case " ${PEERS-$FAMILIES} " in *" $f "*) ;; *) continue;; esac
  el "$f diffusers"
  timeout "${PEER_TIMEOUT:-300}" python3 bench/peer_vae_decode.py "$f" > "$OUT/peer-$f.log" 2>&1
  grep '^{' "$OUT/peer-$f.log" | tee -a "$OUT/log.jsonl"; grep -E "Error|error" "$OUT/peer-$f.log" | tail -3
done
if [ "${NCU:-0}" = 1 ]; then
  for f in ${NCU_FAMILIES:-$FAMILIES}; do
    el "$f ncu"
    timeout 200 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
      "$V" --family "$f" "${NCU_SHAPE:-$(small "$f")}" > "$OUT/ncu-$f.csv" 2> "$OUT/ncu-$f.err"
    python3 - "$OUT/ncu-$f.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, rows = rows[0], rows[1:]
k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
total, count = collections.Counter(), collections.Counter()
for r in rows:
    t = float(r[v].replace(",", "")) * scale.get(r[u], 1.0)
    total[r[k][:90]] += t; count[r[k][:90]] += 1
all_us = sum(total.values())
print(f"all kernels: {all_us/1e3:.1f} ms, {sum(count.values())} launches")
for name, t in total.most_common(25):
    print(f"{t/1e3:9.2f} ms {100*t/all_us:5.1f}% {count[name]:6d}x  {name}")
PY
  done
fi
el done
