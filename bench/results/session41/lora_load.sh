# Session 41: the streamed LoRA load (issue 35) of HEAD (.device/vidgen.xz, built from d7e97d2) beside the
# patched build in .devL (vidgen.xz, vidgen-lib-tests.xz: the arenas a LoRA changes filled one at a time and
# locked in turn by one thread and merged by another), interleaved on one machine, after the patch's CUDA tests of the
# LoRA and offload paths (fx.tar.xz: the two fixture folders they read).
#   run(carry: [".device/vidgen.xz", ".device/wan2.1-configs.json", ".devL"],
#       command: "bash bench/results/session41/lora_load.sh")
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B/head $B/patch
xz -dc .device/vidgen.xz > $B/head/vidgen && xz -dc .devL/vidgen.xz > $B/patch/vidgen
xz -dc .devL/vidgen-lib-tests.xz > $B/patch/vidgen-lib-tests && chmod +x $B/*/*
mkdir -p tests/fixtures && xz -dc .devL/fx.tar.xz | tar -xf - -C tests/fixtures
# The library's tests find the fixtures under the path they were built in.
[ -d /work/main/tests/fixtures ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
el "patch: CUDA tests of the LoRA and offload paths"
$B/patch/vidgen-lib-tests --test-threads=1 lora:: offload:: 2>&1 | grep -E "^test .*(cuda|gpu|lora)|panicked|result:" | tee $OUT/tests.txt
el "warm-up"
TABLE=.device/wan2.1-configs.json OUT=$OUT/warm ROWS=bf16-stream timeout 120 bash bench/weights_14b.sh $B/head/vidgen
for r in 1 2; do
  for b in head patch; do
    el "round $r, $b"
    TABLE=.device/wan2.1-configs.json OUT=$OUT/$b-$r ROWS="bf16-stream bf16-lora-stream" timeout 150 \
      bash bench/weights_14b.sh $B/$b/vidgen | grep "^| bf16"
    grep -h "task-seconds" $OUT/$b-$r/*.log | cut -c1-240
  done
done
el done
