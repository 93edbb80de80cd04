#!/usr/bin/env bash
# vidgen sharing a GPU with other work (issue 37), on a GPU machine with PyTorch:
#   bash bench/gpu_faults.sh PATH/TO/vidgen [KEEP_GIB]
# 1. Another process holds all but KEEP_GIB (default 3.3) of the GPU: synthetic Wan2.1 14B with
#    default flags plans from what is free: at 81x480x832 it takes the leaner options it prints
#    (leaf level, lazy load, VAE tiling, the low-activation DiT, synchronous copies, 128 px VAE
#    tiles) and finishes;
#    with --no-low-activation pinned nothing fits: exit 2 within 3 s, before loading, with advice.
# 2. SIGTERM in the middle of denoising: exit 130 (the Ctrl-C path), no partial file, stats
#    written; `--resume` then writes the video.
# 3. Two vidgen processes started together on one GPU: both finish.
# 4. Memory taken mid-run: another process takes all but KEEP_GIB of the GPU while a two-prompt
#    batch denoises its first prompt; the run finishes that prompt through its one retry with a
#    leaner set (or fails it alone, with no partial file), and writes the second.
# 5. SIGKILL mid-denoise (no handler runs): the temporary it leaves is cleared by `--resume`,
#    which writes the video.
# 6. A host limit through a cgroup (v2, as root): synthetic MiniMax H3 with default flags inside a
#    cgroup whose memory.max is HOST_LIMIT (default 64G) takes lazy loading and finishes; its
#    maximum resident set stays under the limit and near the host peak the dry run predicts.
# Each case prints one line (ok / FAIL) and what it measured; logs and stats under $OUT.
# CASES="4 5" runs only those (case 6 runs only when asked: CASES="6").
set -u
B=$1 KEEP=${2:-3.3}
want() { [[ " ${CASES:-1 2 3 4 5} " == *" $1 "* ]]; }
O=${OUT:-/tmp/gpu-faults}; rm -rf "$O"; mkdir -p "$O"
gen() { # name model size steps extra...
  local n=$1 m=$2 size=$3 steps=$4; shift 4
  IFS=x read -r f h w <<< "$size"
  "$B" generate --model "$m" --prompt "a red fox runs through fresh snow" --seed 1 \
    --num-frames "$f" --height "$h" --width "$w" --num-inference-steps "$steps" --dtype bf16 \
    --output-type safetensors --output-path "$O" --output-video-name "$n" \
    --stats-json "$O/$n.json" "$@" 2> "$O/$n.log"
}
stats() { # name: wall seconds, overrides, stage times, forward times, device peaks
  python3 - "$O/$1.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no stats:", e); sys.exit()
job = (s.get("jobs") or [{}])[0]
m = job.get("metrics", {})
over = ["%s=%s (%s)" % (o["option"], o["to"], o["reason"]) for o in s.get("overrides", [])]
print("  status %s; wall %.1f s; overrides %s" % (s.get("status"), s.get("wall_seconds", 0), over))
print("  stages %s" % {x["name"]: round(x["seconds"], 2) for x in job.get("stages", [])})
print("  forwards %s" % [round(x, 3) for x in m.get("forward_seconds", [])][:8])
print("  device peak GiB %s" % {k: round(v.get("device_reserved_peak", 0) / 2**30, 2)
                                for k, v in m.get("stages", {}).items()})
PY
}

hold() { # log: another process takes all but KEEP GiB of the GPU (its pid in HOLDER)
  python3 - "$KEEP" > "$O/$1" 2>&1 <<'PY' &
import sys, time, torch
free, total = torch.cuda.mem_get_info()
keep = float(sys.argv[1]) * 2**30
x = torch.empty(int(free - keep), dtype=torch.uint8, device="cuda")
free, total = torch.cuda.mem_get_info()
print(f"holding {x.numel() / 2**30:.1f} GiB, free {free / 2**30:.2f} of {total / 2**30:.2f} GiB", flush=True)
time.sleep(900)
PY
  HOLDER=$!
  for _ in $(seq 60); do grep -q holding "$O/$1" && break; sleep 1; done
  cat "$O/$1"
}

# 1. Memory held by another process.
if want 1; then
hold holder.log
start=$(date +%s.%N)
gen held-14b-pinned synthetic:wan2.1-t2v-14b 81x480x832 2 --no-low-activation
rc=$?
end=$(date +%s.%N)
secs=$(python3 -c "print(round($end-$start,1))")
[ $rc = 2 ] && [ ! -f "$O/held-14b-pinned.safetensors" ] \
  && echo "ok   14B 81 frames, --no-low-activation pinned, beside another process: exit 2 in $secs s, before loading" \
  || echo "FAIL 14B 81 frames pinned: rc=$rc in $secs s"
cat "$O/held-14b-pinned.log" | tail -2
start=$(date +%s.%N)
gen held-14b-81 synthetic:wan2.1-t2v-14b 81x480x832 2
rc=$?
end=$(date +%s.%N)
kill $HOLDER; wait $HOLDER 2> /dev/null
if [ $rc = 0 ] && [ -f "$O/held-14b-81.safetensors" ]; then
  echo "ok   14B 81 frames beside another process: finished in $(python3 -c "print(round($end-$start,1))") s"
else
  echo "FAIL 14B 81 frames beside another process: rc=$rc"; tail -4 "$O/held-14b-81.log"
fi
grep -i -m2 "free" "$O/held-14b-81.log"
stats held-14b-81
fi

# 2. SIGTERM mid-denoise, then --resume.
if want 2; then
# vidgen itself in the background (not a subshell around it), so that the signal reaches it.
"$B" generate --model synthetic:wan2.1-t2v-1.3b --prompt "a red fox runs through fresh snow" \
  --seed 1 --num-frames 81 --height 480 --width 832 --num-inference-steps 20 --dtype bf16 \
  --output-type safetensors --output-path "$O" --output-video-name term \
  --stats-json "$O/term.json" 2> "$O/term.log" &
P=$!
for _ in $(seq 240); do grep -q "denois\|step 2/" "$O/term.log" 2> /dev/null && break; sleep 0.5; done
sleep 4; kill -TERM $P; wait $P; rc=$?
partial=$(ls "$O" | grep -c -i "partial\|\.tmp")
if [ $rc = 130 ] && [ ! -f "$O/term.safetensors" ] && [ "$partial" = 0 ] && [ -f "$O/term.json" ]; then
  echo "ok   SIGTERM mid-denoise: exit 130, no output, no temporary, stats written"
else
  echo "FAIL SIGTERM: rc=$rc output=$([ -f "$O/term.safetensors" ] && echo yes || echo no) temporaries=$partial stats=$([ -f "$O/term.json" ] && echo yes || echo no)"
  tail -3 "$O/term.log"
fi
gen term synthetic:wan2.1-t2v-1.3b 81x480x832 2 --resume && [ -f "$O/term.safetensors" ] \
  && echo "ok   --resume after SIGTERM writes the video" || { echo "FAIL --resume"; tail -3 "$O/term.log"; }
fi

# 3. Two processes at once.
if want 3; then
gen two-a synthetic:wan2.1-t2v-1.3b 81x480x832 4 & A=$!
gen two-b synthetic:wan2.1-t2v-1.3b 81x480x832 4 & Bp=$!
wait $A; ra=$?; wait $Bp; rb=$?
[ $ra = 0 ] && [ $rb = 0 ] && echo "ok   two processes on one GPU both finished" \
  || { echo "FAIL two processes: rc $ra $rb"; tail -2 "$O/two-a.log" "$O/two-b.log"; }
stats two-a; stats two-b
fi

# 4. Memory taken mid-run: a two-prompt batch; the holder starts once the first prompt denoises.
if want 4; then
printf 'a red fox runs through fresh snow\na grey cat sleeps on a warm roof\n' > "$O/two.txt"
"$B" generate --model synthetic:wan2.1-t2v-1.3b --prompt-file "$O/two.txt" --seed 1 \
  --num-frames 81 --height 480 --width 832 --num-inference-steps 8 --dtype bf16 \
  --output-type safetensors --output-path "$O/mid" --stats-json "$O/mid.json" 2> "$O/mid.log" &
P=$!
for _ in $(seq 240); do grep -q "step 2/" "$O/mid.log" 2> /dev/null && break; sleep 0.5; done
hold holder-mid.log
wait $P; rc=$?
kill $HOLDER; wait $HOLDER 2> /dev/null
written=$(ls "$O/mid" 2> /dev/null | grep -c "\.safetensors$")
partial=$(ls "$O/mid" 2> /dev/null | grep -c -i "partial\|\.tmp")
retried=$(grep -c "retrying once" "$O/mid.log")
if [ "$partial" = 0 ] && { { [ $rc = 0 ] && [ "$written" = 2 ]; } || { [ $rc = 1 ] && [ "$written" = 1 ]; }; }; then
  echo "ok   memory taken mid-run: rc=$rc, $written of 2 written, $retried retry, no temporary"
else
  echo "FAIL memory taken mid-run: rc=$rc written=$written temporaries=$partial retries=$retried"
fi
grep -m3 "out of device memory\|retrying\|error" "$O/mid.log"
stats mid
fi

# 5. SIGKILL mid-denoise, then --resume.
if want 5; then
"$B" generate --model synthetic:wan2.1-t2v-1.3b --prompt "a red fox runs through fresh snow" \
  --seed 1 --num-frames 81 --height 480 --width 832 --num-inference-steps 20 --dtype bf16 \
  --output-type safetensors --output-path "$O/kill" --output-video-name killed 2> "$O/kill.log" &
P=$!
for _ in $(seq 240); do grep -q "step 2/" "$O/kill.log" 2> /dev/null && break; sleep 0.5; done
sleep 2; kill -KILL $P; wait $P; rc=$?
left=$(ls -A "$O/kill" | grep -v "^killed\.safetensors$" | tr '\n' ' ')
"$B" generate --model synthetic:wan2.1-t2v-1.3b --prompt "a red fox runs through fresh snow" \
  --seed 1 --num-frames 81 --height 480 --width 832 --num-inference-steps 2 --dtype bf16 \
  --output-type safetensors --output-path "$O/kill" --output-video-name killed --resume 2> "$O/killed.log"
rc2=$?
after=$(ls -A "$O/kill" | grep -v "^killed\.safetensors$" | tr '\n' ' ')
if [ $rc = 137 ] && [ $rc2 = 0 ] && [ -f "$O/kill/killed.safetensors" ] && [ -z "$after" ]; then
  echo "ok   SIGKILL mid-denoise (left: ${left:-nothing}); --resume cleared it and wrote the video"
else
  echo "FAIL SIGKILL: rc=$rc resume rc=$rc2 left before: '$left' after: '$after'"; tail -3 "$O/killed.log"
fi
fi

# 6. A host limit through a cgroup: this shell moves into the cgroup, so vidgen reads the limit
#    itself (memory.max less memory.current), as under a container's limit.
if [[ " ${CASES:-} " == *" 6 "* ]]; then
L=${HOST_LIMIT:-64G} G=/sys/fs/cgroup/vidgen-faults
mkdir -p $G && echo "$L" > $G/memory.max && echo 0 > $G/memory.swap.max 2> /dev/null
(
  echo $BASHPID > $G/cgroup.procs
  /usr/bin/time -v -o "$O/h3-limit.time" "$B" generate --model synthetic:minimax-h3 \
    --prompt "a red fox runs through fresh snow" --seed 1 --num-frames 124 --height 768 --width 1344 \
    --num-inference-steps 2 --output-type safetensors --output-path "$O" --output-video-name h3-limit \
    --stats-json "$O/h3-limit.json" 2> "$O/h3-limit.log"
  echo "rc=$?" > "$O/h3-limit.rc"
)
python3 - "$O" "$L" "$(cat $G/memory.peak 2> /dev/null)" <<'PY'
import re, sys
o, limit, peak = sys.argv[1:]
rc = open(f"{o}/h3-limit.rc").read().strip()
log = open(f"{o}/h3-limit.log").read()
rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{o}/h3-limit.time").read())
over = [l for l in log.splitlines() if "host memory available" in l]
top = int(rss.group(1)) / 2**20 if rss else float("nan")
ok = rc == "rc=0" and over and top < float(limit.rstrip("G"))
print(("ok  " if ok else "FAIL") + f" host limit {limit}: {rc}, maximum RSS {top:.2f} GiB (cgroup peak "
      f"{int(peak or 0) / 2**30:.2f} GiB), override: {over[0] if over else 'none'}")
PY
rmdir $G 2> /dev/null
fi
