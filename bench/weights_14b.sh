#!/usr/bin/env bash
# Issue 35's targets on the synthetic Wan2.1 14B (81x480x832, 3 steps with CFG: 6 forwards), every row in one
# call, on a GPU machine with Python and numpy:
#   bash bench/weights_14b.sh PATH/TO/vidgen [GGUF_WHL]
# Writes a full-size Q8_0 GGUF of the 14B transformer (bench/make_gguf.py) and a rank-32 LoRA on every
# projection of every block (bench/make_lora.py), then runs: bf16 streamed (the default flags) and resident,
# bf16 + the LoRA (streamed by its flag, resident, and with the defaults, which hold it on the device where it fits), Q8_0 streamed and resident, `--storage-dtype float8_e4m3fn` streamed and resident,
# `--fp8-matmul` (issue 36) streamed and resident, `--attention sage` streamed and resident, and both fast
# options together resident; each
# with its dry run. Prints one table row per run (load, forwards, pinned and host bytes, peaks against the
# plan); stats and logs under $OUT. ROWS="bf16-stream fp8-stream" runs only those rows; REPEAT and WARM below.
set -u
B=$1 WHL=${2:-}
O=${OUT:-/tmp/weights-14b}; W=${WEIGHTS:-/tmp/weights-14b-files}
mkdir -p "$O" "$W"
if [ -n "$WHL" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site "$WHL" 2>/dev/null
  export PYTHONPATH=/tmp/gguf-site${PYTHONPATH:+:$PYTHONPATH}
fi
T=${TABLE:-tests/fixtures/wan2.1-configs.json} K=transformer_Wan2.1-T2V-14B
[[ -n "${ROWS:-}" && "$ROWS" != *q8* ]] || [ -f "$W/q8.gguf" ] || python3 bench/make_gguf.py $T $K "$W/q8.gguf" Q8_0 | tee "$O/q8.json"
[[ -n "${ROWS:-}" && "$ROWS" != *lora* ]] || [ -f "$W/lora.safetensors" ] || python3 bench/make_lora.py $T $K "$W/lora.safetensors" 32 | tee "$O/lora.json"
RESIDENT=(--dit-layerwise-offload=false --dit-cpu-offload=false)
gen() { # name extra...
  local n=$1; shift
  [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $n "* ]] && return
  n=$n${SUFFIX:-}
  local a=(generate --model synthetic:wan2.1-t2v-14b --prompt "a red fox runs through fresh snow" --seed 1
    --num-frames 81 --height 480 --width 832 --num-inference-steps 3 --dtype bf16 "$@")
  "$B" "${a[@]}" --dry-run --json > "$O/$n.plan.json" 2> "$O/$n.plan.log"
  /usr/bin/time -v "$B" "${a[@]}" --output-type safetensors --output-path "$O/v" --output-video-name "$n" \
    --overwrite --stats-json "$O/$n.json" 2> "$O/$n.log"
  rm -f "$O/v/$n.safetensors"
  python3 - "$O" "$n" <<'PY'
import json, re, sys
o, n = sys.argv[1:]
try:
    s = json.load(open(f"{o}/{n}.json")); p = json.load(open(f"{o}/{n}.plan.json"))
except Exception as e:
    print(f"| {n} | no stats: {e} |"); sys.exit()
log = open(f"{o}/{n}.log").read()
load = re.search(r"loaded transformer in ([0-9.]+)s", log)
rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
j = s["jobs"][0]; m = j["metrics"]; f = m.get("forward_seconds", [])
st = {x["name"]: x["seconds"] for x in j["stages"]}
off = m.get("offload", {})
den = m["stages"]["denoise"]
plan = {x["name"]: x.get("memory", {}) for x in p.get("stages", [])}
G = 2 ** 30
pd = plan.get("denoise", {}).get("peak_bytes")
print(f"| {n} | {s['status']} | {load.group(1) if load else '?'} | {st.get('encode_text', 0):.2f} | "
      f"{min(f[1:]):.3f}-{max(f[1:]):.3f} (median {sorted(f[1:])[len(f[1:]) // 2]:.3f}) | "
      f"{off.get('pinned_bytes', 0) / 1e9:.3f} | {off.get('host_bytes', 0) / 1e9:.3f} | "
      f"{den['device_used_peak'] / G:.2f} / {pd / G if pd else float('nan'):.2f} | "
      f"{int(rss.group(1)) * 1024 / G if rss else float('nan'):.2f} / "
      f"{(p.get('memory_plan') or {}).get('host_peak_bytes', 0) / G:.2f} | {st.get('decode', 0):.2f} |")
PY
}
rows() {
  gen bf16-stream
  gen bf16-resident "${RESIDENT[@]}"
  # Streamed by its flag: with the defaults a LoRA'd DiT that fits the free memory is held on the device.
  gen bf16-lora-stream --lora "$W/lora.safetensors" --dit-layerwise-offload
  gen bf16-lora-default --lora "$W/lora.safetensors"
  gen bf16-lora-resident --lora "$W/lora.safetensors" "${RESIDENT[@]}"
  gen q8-stream --transformer "$W/q8.gguf"
  gen q8-resident --transformer "$W/q8.gguf" "${RESIDENT[@]}"
  gen fp8-stream --storage-dtype float8_e4m3fn
  gen fp8-resident --storage-dtype float8_e4m3fn "${RESIDENT[@]}"
  gen fp8mm-stream --fp8-matmul
  gen fp8mm-resident --fp8-matmul "${RESIDENT[@]}"
  gen sage-stream --attention sage
  gen sage-resident --attention sage "${RESIDENT[@]}"
  gen fast-resident --fp8-matmul --attention sage "${RESIDENT[@]}"
}
# WARM=1: one default run first, unrecorded, so the machine's first-run costs (page cache, the driver's
# first pinning) fall on no row. REPEAT=N: the rows N times, interleaved (load times move between runs).
[ "${WARM:-0}" = 1 ] && ROWS= SUFFIX=-warm gen bf16-stream > /dev/null
echo "| run | status | transformer load (s) | text stage (s) | forwards 2-6 (s) | pinned GB | host GB | denoise used / plan GiB | max RSS / plan host GiB | decode (s) |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for r in $(seq "${REPEAT:-1}"); do
  if [ "${REPEAT:-1}" = 1 ]; then SUFFIX= rows; else SUFFIX=-$r rows; fi
done
