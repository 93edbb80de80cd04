set -u
export PATH=/opt/torch/.venv/bin:$PATH
[ -x /tmp/cudnn-bin/vidgen ] || { mkdir -p /tmp/cudnn-bin; xz -dc .device/gz/vidgen.xz > /tmp/cudnn-bin/vidgen; chmod +x /tmp/cudnn-bin/vidgen; }
which nsys ncu 2>&1 | head -2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl && export PYTHONPATH=/tmp/site
python3 .device/wan_offload_bench.py --out $OUT/peer --skip bw,sdpa,big,seq --budget-s 60 > $OUT/peer.log 2>&1; echo "peer exit $?"
grep -E "none|resident" $OUT/peer/results.md | head -5
B=/tmp/cudnn-bin/vidgen
R="--no-dit-layerwise-offload --no-dit-cpu-offload --no-text-encoder-cpu-offload --no-vae-cpu-offload"
for s in /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib off; do
VIDGEN_CUDNN=$s $B generate --model synthetic:wan2.1-t2v-1.3b --prompt "a fox" --seed 1 --num-inference-steps 5 --device cuda --dtype bf16 $R --output-type safetensors --output-path /tmp/v --overwrite --stats-json $OUT/v-$(basename $s).json 2>&1 | grep -E "forwards|denoise:|error"
done
