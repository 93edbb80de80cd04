# Sourced by a session's calls.sh on the GPU machine, with DEV set to its carried build folder (.deviceNN):
# sets OUT and `el` (a line stamped with the seconds since the start), prints the GPU, installs the carried
# diffusers wheel (.whl) for the peer scripts, unpacks DEV's xz'd binaries into /tmp, and puts offload_bench
# and the peer script where bench/seed_table.sh looks for them. `planned` runs a synthetic model through the command
# line and prints each stage's planned device bytes beside the measured peak.
set -u
export PATH=/opt/torch/.venv/bin:$PATH
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
for b in vidgen vidgen-lib-tests offload_bench; do
  [ -f $DEV/$b.xz ] && xz -dc $DEV/$b.xz > /tmp/$b && chmod +x /tmp/$b
done
mkdir -p .device && cp /tmp/offload_bench .device/offload_bench && cp $DEV/seed_table_bench.py .device/
export VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench
planned() {  # planned NAME MODEL [FLAGS...]: two steps through the command line, planned against measured
  local name=$1 model=$2; shift 2
  el "$name"
  timeout 200 /tmp/vidgen generate --model synthetic:$model --prompt "a red fox runs through fresh snow" \
    --seed 1 --num-inference-steps 2 --dtype bf16 --output-type safetensors --output-path /tmp/v \
    --output-video-name $name --overwrite --stats-json $OUT/plan/$name.json "$@" > $OUT/plan/$name.log 2>&1
  echo "exit $?"; grep -E "^error" $OUT/plan/$name.log
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); j=d['jobs'][0]
for s,v in j['metrics']['stages'].items():
    p=v.get('device_planned_bytes'); m=v['device_used_peak']
    print('  %-12s used %7.3f GiB, planned %7.3f (%s)' % (s, m/2**30, (p or 0)/2**30, '%+.1f%%' % (100*(p/m-1)) if p and m else '-'))
" $OUT/plan/$name.json
}
