# Ready for the next session's device (builds git-ignored in .device44/, at this session's last commit for
# vae_decode; vidgen and the library's CUDA tests at 3fece99):
#   run(carry: [".device44/vae_decode.xz", ".whl"], command: "bash bench/results/session43/next_calls.sh 1")
#   1: Allegro's full-size decode (88x720x1280, always in tiles) on the channels-last 2D convolutions beside
#      diffusers' tiled decode: time, used memory, and the plan's estimate to compare with it.
#   For Mochi-1's bf16 spread, bench/results/session42/calls.sh 2 (an H200: diffusers' f32 run needs its memory).
set -u
case $1 in
  1) FAMILIES=allegro SMALL=0 UNFUSED=0 VAE_DECODE=/tmp/vae_decode-44 OUT=$OUT/vae \
       bash -c 'xz -dc .device44/vae_decode.xz > /tmp/vae_decode-44 && chmod +x /tmp/vae_decode-44 && bash bench/vae_family.sh' 2>&1 | tail -12;;
esac
