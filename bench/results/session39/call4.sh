# Session 39, call 4: whole videos of Wan2.1 1.3B, LTX-Video and Latte-1 beside diffusers 0.42.1
# (4 steps, default flags), with issue 34's text-stage columns (diffusers' text-encoder load plus
# encode_prompt against vidgen's encode_text stage).
set -u
export PATH=/opt/torch/.venv/bin:$PATH
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
OUT=$OUT/e2e MODES=default timeout 560 bash bench/family_e2e.sh wan2.1-t2v-1.3b ltx-video latte-1 2>&1 | tail -20
el done
