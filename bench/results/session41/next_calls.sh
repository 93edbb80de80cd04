# The device calls session 41 left for the next session (built at its last commit, git-ignored: .device/ holds
# vidgen.xz, linear_bench.xz and wan2.1-configs.json; .device-tests/ the library's CUDA test binary and fx.tar.xz,
# the fixture folders the library's tests read, without their reference outputs). From the repository root:
#   1: run(carry: [".device-tests"], command: "bash bench/results/session41/next_calls.sh 1")
#      every CUDA test of the library (bench/cuda_tests.sh), among them the Hopper attention at head dims 64-128
#      and the LoRA streaming through the new lock and merge threads.
#   2: run(carry: [".device", ".whl"], command: "bash bench/results/session41/next_calls.sh 2")
#      the whole videos of the head_dim-64/72 families now on the Hopper kernel (issue 34: Latte-1 was 0.829x,
#      1.9 s of its first forward in cuDNN's compile), a fresh machine's first runs.
#   3: run(carry: [".device", ".whl"], command: "bash bench/results/session41/next_calls.sh 3")
#      LTX-Video's and Mochi-1's frames against diffusers' in f32 (session 41: mean |diff| 0.20 and 0.25 in bf16,
#      where Wan2.1 and Latte-1 differ by 0.06 and 0.05): is the full-size GPU path right? (On the CPU in f32,
#      `family_e2e.py --quick --configs` with the published configs cut to two layers: within 4.1e-6 and 2.9e-5;
#      diffusers' own bf16 against f32 at LTX-Video's full depth on the CPU: mean 0.0033.) Both decode through the
#      causal-conv VAEs' channels-last moves (rebuilt in session 39); if f32 agrees, decode diffusers' final bf16
#      latents with both programs to isolate the VAE.
#   4: the clock-sampled Linear bench and calls 1, 4, 5 of bench/results/session40/calls.sh (rebuild
#      .device-call1 first if channel_ops changed).
set -u
export PATH=/opt/torch/.venv/bin:$PATH
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case $1 in
  1) mkdir -p .device tests/fixtures && cp .device-tests/vidgen-lib-tests.xz .device/
     xz -dc .device-tests/fx.tar.xz | tar -xf - -C tests/fixtures
     # The library's tests find the fixtures under the path they were built in.
     [ -d /work/main/tests/fixtures ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
     bash bench/cuda_tests.sh > $OUT/cuda-tests.log 2>&1; echo "exit $?"
     grep -E "FAILED|panicked|result:" $OUT/cuda-tests.log | head -30;;
  2) OUT=$OUT/e2e MODES=default timeout 560 bash bench/family_e2e.sh latte-1 ltx-video cogvideox-5b 2>&1 | tail -20;;
  3) for f in ltx-video mochi-1; do
       el "$f f32"
       python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
       xz -dc .device/vidgen.xz > /tmp/vidgen && chmod +x /tmp/vidgen
       PYTHONPATH=/tmp/site timeout 280 python3 bench/family_e2e.py --family $f --dtype f32 --steps 2 \
         --vidgen /tmp/vidgen --out $OUT/f32 --ckpt-root /dev/shm/vidgen-e2e --vidgen-modes default 2>&1 |
         grep -E "frames vs diffusers|Error" | cut -c1-300
       rm -rf /dev/shm/vidgen-e2e/$f*
     done;;
esac
el done
