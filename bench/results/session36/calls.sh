set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
for x in vidgen vidgen-lib-tests linear_bench vae_decode; do xz -dc .device/$x.xz > $B/$x; chmod +x $B/$x; done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
el "fp8 lib tests"
$B/vidgen-lib-tests --test-threads=1 fp8 2>&1 | grep -E "^test |panicked|result:|assert" | tee $OUT/tests.txt
el "linear bench"
$B/linear_bench 2>&1 | tee $OUT/linear.md
el "cogvideox decodes"
for s in 1,16,13,60,90 1,16,3,60,90; do for t in "" --tiled; do $B/vae_decode --family cogvideox-5b $s $t 2>&1 | tail -1 | tee -a $OUT/cog.jsonl; done; done
for t in untiled tiled; do
  el "ncu cogvideox $t"
  f=""; [ $t = tiled ] && f=--tiled
  timeout 240 ncu --clock-control none --csv --metrics gpu__time_duration.sum $B/vae_decode --family cogvideox-5b 1,16,3,60,90 $f > $OUT/ncu-$t.csv 2> $OUT/ncu-$t.err
  python3 - $OUT/ncu-$t.csv <<'PY' | tee $OUT/ncu-$t.txt
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, rows = rows[0], rows[1:]
k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}
total, count = collections.Counter(), collections.Counter()
for r in rows:
    t = float(r[v].replace(",", "")) * scale.get(r[u], 1.0)
    total[r[k][:100]] += t; count[r[k][:100]] += 1
all_us = sum(total.values())
print(f"all kernels: {all_us/1e3:.1f} ms, {sum(count.values())} launches")
for name, t in total.most_common(30):
    print(f"{t/1e3:9.2f} ms {100*t/all_us:5.1f}% {count[name]:6d}x  {name}")
PY
  rm -f $OUT/ncu-$t.csv
done
el "14B forwards bf16 vs fp8mm resident"
OUT=$OUT/w14 ROWS="bf16-resident fp8mm-resident" timeout 400 bash bench/weights_14b.sh $B/vidgen 2>&1 | tail -5
el done
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
for x in vidgen-lib-tests linear_bench; do xz -dc .device/$x.xz > $B/$x; chmod +x $B/$x; done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
el "lib tests"
$B/vidgen-lib-tests --test-threads=1 fp8 conv3d::cuda_tests channel_ops 2>&1 | grep -E "^test |panicked|result:|assert" | tee $OUT/tests.txt
el "linear bench"
$B/linear_bench 2>&1 | tee $OUT/linear.md
el "vae family"
FAMILIES="cogvideox-5b ltx-video" UNFUSED=0 PEERS="cogvideox-5b" OUT=$OUT/vae bash bench/vae_family.sh 2>&1 | tail -30
el done
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
for x in vidgen-lib-tests linear_bench; do xz -dc .device/$x.xz > $B/$x; chmod +x $B/$x; done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
el "lib tests"
$B/vidgen-lib-tests --test-threads=1 conv3d::cuda_tests::padded fp8_kernels 2>&1 | grep -E "^test |panicked|result:|assert" | tee $OUT/tests.txt
el "linear bench"
$B/linear_bench 2>&1 | tee $OUT/linear.md
el "vae family"
FAMILIES="cogvideox-5b ltx-video" UNFUSED=0 PEERS="" OUT=$OUT/vae bash bench/vae_family.sh 2>&1 | tail -30
el done
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
for x in vae_decode vae_decode_r28; do xz -dc .device/$x.xz > $B/$x; chmod +x $B/$x; done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
for r in 1 2; do for v in vae_decode vae_decode_r28; do for f in cogvideox-5b ltx-video; do for t in "" --tiled; do
  echo -n "$v $r: "; $B/$v --family $f $t 2>&1 | grep '^{' | tail -1
done; done; done; done | tee $OUT/runs.txt
el "ncu"
timeout 200 ncu --clock-control none --csv --metrics gpu__time_duration.sum $B/vae_decode --family cogvideox-5b 1,16,3,60,90 > $OUT/ncu.csv 2> $OUT/ncu.err
python3 - $OUT/ncu.csv <<'PY' | tee $OUT/ncu.txt
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, rows = rows[0], rows[1:]
k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
print("units:", set(r[u] for r in rows))
total, count = collections.Counter(), collections.Counter()
for r in rows:
    t = float(r[v].replace(",", "")) * scale.get(r[u], 1.0)
    total[r[k][:100]] += t; count[r[k][:100]] += 1
all_us = sum(total.values())
print(f"all kernels: {all_us/1e3:.1f} ms, {sum(count.values())} launches")
for name, t in total.most_common(30):
    print(f"{t/1e3:9.2f} ms {100*t/all_us:5.1f}% {count[name]:6d}x  {name}")
PY
rm -f $OUT/ncu.csv
el done
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B; xz -dc .device/vidgen.xz > $B/vidgen; chmod +x $B/vidgen
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
el "14B rows"
OUT=$OUT/w14 ROWS="bf16-resident fp8mm-resident fp8mm-stream" timeout 300 bash bench/weights_14b.sh $B/vidgen 2>&1 | grep "^|"
el "cogvideox e2e"
MODES=default OUT=$OUT/e2e timeout 330 bash bench/family_e2e.sh cogvideox-5b 2>&1 | tail -8
el done
set -u
B=/tmp/b; mkdir -p $B
for x in vae_decode vae_decode_old vidgen-lib-tests; do xz -dc .device/$x.xz > $B/$x; chmod +x $B/$x; done
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
timeout 60 $B/vidgen-lib-tests --test-threads=1 channel_ops conv3d::cuda_tests::padded 2>&1 | grep -E "^test |panicked|result:" | tee $OUT/lane.txt
el "A/B: upsampler gathers from x (new) vs upsampled copy (old)"
for r in 1 2; do for v in vae_decode_old vae_decode; do for a in "cogvideox-5b" "cogvideox-5b --tiled"; do
  echo -n "$v $r $a: "; timeout 40 $B/$v --family $a 2>&1 | grep '^{' | tail -1 | grep -o '"decode_s":[0-9.]*,.*"used_peak_gib":[0-9.]*'
done; done; done | tee $OUT/ab.txt
el "small decode frames: new vs old"
$B/vae_decode --family cogvideox-5b 1,16,3,30,45 --save /tmp/new.st | grep -o '"decode_s":[0-9.]*'
$B/vae_decode_old --family cogvideox-5b 1,16,3,30,45 --save /tmp/old.st | grep -o '"decode_s":[0-9.]*'
/opt/torch/.venv/bin/python3 -c "
from safetensors.torch import load_file
a=load_file('/tmp/new.st')['video'];b=load_file('/tmp/old.st')['video']
print('new vs old max abs', float((a-b).abs().max()), 'of', float(b.abs().max()))" | tee -a $OUT/ab.txt
el done
