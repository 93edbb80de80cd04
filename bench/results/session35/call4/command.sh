set -u; mkdir -p $OUT
export PATH=/opt/torch/.venv/bin:$PATH
B=/tmp/vae-bin; mkdir -p $B; xz -dc .device/vae_decode.xz > $B/vae_decode && chmod +x $B/vae_decode
for round in 1; do
  for f in ltx-video cogvideox-5b mochi-1; do
    timeout 40 $B/vae_decode --family $f 2>&1 | grep decode_s | sed "s/^/cap=output /" | tee -a $OUT/vae.jsonl
    VIDGEN_CUDNN_CONV_WORKSPACE_MIB=4096 timeout 40 $B/vae_decode --family $f 2>&1 | grep decode_s | sed "s/^/cap=4096 /" | tee -a $OUT/vae.jsonl
  done
done
timeout 40 $B/vae_decode 2>&1 | grep decode_s | sed "s/^/wan cap=output /" | tee -a $OUT/vae.jsonl
VIDGEN_CUDNN_CONV_WORKSPACE_MIB=4096 timeout 40 $B/vae_decode 2>&1 | grep decode_s | sed "s/^/wan cap=4096 /" | tee -a $OUT/vae.jsonl
timeout 40 $B/vae_decode --family hunyuanvideo 2>&1 | grep decode_s | sed "s/^/cap=output /" | tee -a $OUT/vae.jsonl
VIDGEN_CUDNN_CONV_WORKSPACE_MIB=4096 timeout 40 $B/vae_decode --family hunyuanvideo 2>&1 | grep decode_s | sed "s/^/cap=4096 /" | tee -a $OUT/vae.jsonl
echo "[vae done $(date +%T)]"
MODES=default OUT=$OUT/e2e timeout 450 bash bench/family_e2e.sh hunyuanvideo 2>&1 | tail -6
