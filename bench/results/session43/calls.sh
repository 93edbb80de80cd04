# Session 43's device calls: run(carry: [".device", ".device43", ".whl"], command: "bash bench/results/session43/calls.sh N")
# .device43/: vidgen, vae_decode and the library's CUDA tests at this session's src (the image VAEs' convolutions
# channels last; session 39's pair-wise store); .device/vae_decode.xz: the build before (95b900d).
#   1 (carry .device43/vidgen-lib-tests.xz): the CUDA tests of the convolutions and moves.
#   2 (carry .device/vae_decode.xz, .device43/vidgen.xz, .device43/vae_decode.xz, .whl): Latte-1's decode on the GPU
#      against the host at the published widths; Latte-1's and CogVideoX-5b's decodes before and after beside diffusers; Latte-1's and FLUX.1's whole
#      runs against diffusers; a per-kernel profile of one 14-frame Latte-1 decode.
#   3 (carry .device43/vidgen-lib-tests.xz, .device43/vidgen.xz, .device43/vae_decode.xz, .whl): the CUDA tests again
#      (the image test's tolerance relative), cuDNN's host time per API function in Latte-1's first decode, and HunyuanVideo's text stage beside diffusers' (a whole run at 33x320x512).
set -u
export PATH=/opt/torch/.venv/bin:$PATH
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
for b in vidgen vae_decode vidgen-lib-tests; do for d in .device43 .device44; do [ -f $d/$b.xz ] && xz -dc $d/$b.xz > /tmp/$b && chmod +x /tmp/$b; done; done
[ -f .device/vae_decode.xz ] && xz -dc .device/vae_decode.xz > /tmp/vae_decode_before && chmod +x /tmp/vae_decode_before
e2e() { PYTHONPATH=/tmp/site timeout "$1" python3 bench/family_e2e.py --vidgen /tmp/vidgen --ckpt-root /dev/shm/vidgen-e2e \
  --vidgen-modes default "${@:2}" 2>&1 | grep -E "frames vs|Error|^\| " | cut -c1-300; }
case $1 in
  1) el "CUDA tests"
     /tmp/vidgen-lib-tests --test-threads=1 conv3d::cuda_tests channel_ops 2>&1 | grep -E "^test |panicked|skipped|result:" | tail -40;;
  2) el "latte-1 host check"
     HOST_CHECK=1 FAMILIES=latte-1 VAE_DECODE=/tmp/vae_decode OUT=$OUT/host bash bench/vae_family.sh 2>&1 | grep -E "^\{|t\+"
     for v in before after; do
       el "decodes $v"
       bin=/tmp/vae_decode; [ $v = before ] && bin=/tmp/vae_decode_before
       PEERS=$([ $v = after ] && echo "latte-1 cogvideox-5b") FAMILIES="latte-1 cogvideox-5b" SMALL=0 UNFUSED=0 \
         VAE_DECODE=$bin OUT=$OUT/vae-$v bash bench/vae_family.sh 2>&1 | grep -E "^\{|t\+" | cut -c1-400
     done
     el "latte-1 ncu after"
     FAMILIES=latte-1 NCU=1 SMALL=0 UNFUSED=0 NCU_SHAPE=1,4,14,64,64 PEERS= VAE_DECODE=/tmp/vae_decode OUT=$OUT/ncu \
       bash bench/vae_family.sh 2>&1 | sed -n '/ncu/,$p' | head -24
     for f in latte-1 flux.1-dev; do el "$f whole"; e2e 200 --family $f --out $OUT/e2e; rm -rf /dev/shm/vidgen-e2e/$f*; done;;
  3) el "CUDA tests"
     /tmp/vidgen-lib-tests --test-threads=1 conv3d::cuda_tests channel_ops 2>&1 | grep -E "^test |panicked|skipped|result:|max " | tail -40
     el "latte-1: cuDNN's host time in a first 14-frame decode"
     CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=/tmp/cudnn.log /tmp/vae_decode --family latte-1 1,4,14,64,64 | cut -c1-300
     python3 bench/cudnn_api_times.py /tmp/cudnn.log; grep -m3 "Time:" /tmp/cudnn.log; rm -f /tmp/cudnn.log
     el "hunyuanvideo whole at 33x320x512 (its text stage: issue 34 item 4)"
     e2e 480 --family hunyuanvideo --size 33,320,512 --out $OUT/e2e; rm -rf /dev/shm/vidgen-e2e/hunyuanvideo*;;
  4) el "every CUDA test of the library"
     /tmp/vidgen-lib-tests --test-threads=1 cuda_tests candle_strided 2>&1 | grep -E "^test .*FAILED|panicked|max |result:" | tail -20
     el "allegro whole at 24x320x320 (its VAE's 2D convolutions channels last, frames against diffusers')"
     e2e 300 --family allegro --size 24,320,320 --out $OUT/e2e; rm -rf /dev/shm/vidgen-e2e/allegro*;;
  5) el "which cuDNN libraries a first decode opens (LD_DEBUG=files)"
     xz -dc .device44/vidgen.xz > /tmp/vidgen-new && xz -dc .device43/vidgen.xz > /tmp/vidgen-old && chmod +x /tmp/vidgen-*
     xz -dc .device44/vae_decode.xz > /tmp/vae_decode && chmod +x /tmp/vae_decode
     LD_DEBUG=files /tmp/vae_decode --family latte-1 1,4,2,8,8 2>&1 | grep -oE "file=[^ ]*cudnn[^ ]*" | sort | uniq -c
     el "latte-1 whole, vidgen before and after opening cuDNN's engine libraries on the preload thread"
     for i in 1 2; do for v in old new; do
       PYTHONPATH=/tmp/site timeout 200 python3 bench/family_e2e.py --vidgen /tmp/vidgen-$v --ckpt-root /dev/shm/vidgen-e2e \
         --vidgen-modes default --skip-diffusers --family latte-1 --out $OUT/e2e-$v-$i 2>&1 | grep -E "Error|^\| latte" | sed "s/^/$v $i /"
       grep -h -E "decode|denoise  |forwards" $OUT/e2e-$v-$i/*stamped.log | sed "s/^/$v $i /"
     done; done;;
  6) el "every CUDA test of the library at the session's last source, with the fixtures its tests read"
     /tmp/vidgen-lib-tests --test-threads=1 cuda_tests candle_strided 2>&1 | grep -E "^test .*FAILED|panicked|Error|result:" | tail -20;;
esac
el done
