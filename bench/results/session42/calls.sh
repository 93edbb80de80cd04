# Session 42's device calls (vidgen built at this session's src, in .device/vidgen.xz; diffusers' wheel in .whl):
#   run(carry: [".device", ".whl"], command: "bash bench/results/session42/calls.sh N")
#   1: LTX-Video and CogVideoX-5b whole videos (bf16, default flags, 4 steps) against diffusers after the two
#      parity fixes: diffusers' LTX decoder noise drawn on the CPU, CogVideoX sampling with the checkpoint's DDIM.
#   2: Mochi-1's bf16 frames: diffusers' own bf16 against its f32 (what rounding alone moves at full size), and
#      vidgen's bf16 against diffusers' bf16.
#   3: Latte-1's decode (level with diffusers' in call 4: 0.34 against 0.33 s) beside diffusers', with a per-kernel
#      profile of a small decode (.device/vae_decode.xz at this session's last commit).
set -u
export PATH=/opt/torch/.venv/bin:$PATH
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
xz -dc .device/vidgen.xz > /tmp/vidgen && chmod +x /tmp/vidgen
e2e() { PYTHONPATH=/tmp/site timeout "$1" python3 bench/family_e2e.py --vidgen /tmp/vidgen --ckpt-root /dev/shm/vidgen-e2e \
  --vidgen-modes default "${@:2}" 2>&1 | grep -E "frames vs|Error|^\| (ltx|cog|mochi)" | cut -c1-300; }
case $1 in
  1) for f in ltx-video cogvideox-5b; do el "$f bf16"; e2e 280 --family $f --out $OUT/e2e; rm -rf /dev/shm/vidgen-e2e/$f*; done;;
  2) el "mochi-1 f32: diffusers' frames saved"
     e2e 250 --family mochi-1 --dtype f32 --out $OUT/f32 --diffusers-frames /dev/shm/mochi-f32.npy --vidgen-modes ""
     rm -rf /dev/shm/vidgen-e2e/mochi-1*
     el "mochi-1 bf16: diffusers against its f32 frames, vidgen against diffusers"
     e2e 280 --family mochi-1 --out $OUT/bf16 --diffusers-frames /dev/shm/mochi-f32.npy;;
  3) FAMILIES=latte-1 NCU=1 UNFUSED=0 OUT=$OUT/vae bash bench/vae_family.sh 2>&1 | tail -40;;
esac
el done
