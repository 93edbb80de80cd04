# Session 38, call 1: the GPU paths of sessions 37-38's CPU-checked work, on the tiny fixtures.
# Carry: .device (vidgen.xz and vidgen-lib-tests.xz built with --features cuda; fx.tar.xz: the fixture folders
# named below without their references, flux-kohya(-te).safetensors and cache-families' README.json).
#   1. every CUDA test of the library (bench/cuda_tests.sh): among them each family's fused block against its
#      composition with a step cache hooking its attentions and, new, its feed-forwards;
#   2. gpu_vs_cpu.py: each run on the CPU (f32), then CUDA f32 resident and streamed, and CUDA bf16 (the fused
#      paths): TaylorSeer on the feed-forwards of five families, FLUX.1's CLIP LoRA, Wan's PEFT-halves LoRA,
#      and the original-layout single files (GGUF row cuts and swapped halves on the copy stream).
set -u
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/b; mkdir -p $B
xz -dc .device/vidgen.xz > $B/vidgen; chmod +x $B/vidgen
mkdir -p tests/fixtures && xz -dc .device/fx.tar.xz | tar -xf - -C tests/fixtures
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
el "CUDA lib tests"
bash bench/cuda_tests.sh > $OUT/cuda-tests.log 2>&1; echo "exit $?"
grep -E "FAILED|panicked|result:" $OUT/cuda-tests.log | head -20
el "GPU vs CPU"
python3 bench/results/session38/gpu_vs_cpu.py $B/vidgen tests/fixtures $OUT/runs 2>&1 | tee $OUT/gpu-vs-cpu.txt
el done
