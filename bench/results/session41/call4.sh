# Session 41, call 4 (on the warm machine of call 1, whose /tmp still held both builds and the rank-32 LoRA of
# bench/make_lora.py): the transformer load streamed by its flag, with and without the LoRA, so both rows stream
# (with the defaults an 80 GB H100 holds the bf16 14B on the device, so call 1's bf16 rows were not streamed).
# One inference step: the load is what is compared. p = this session's build, h = HEAD before it (d7e97d2).
for r in p-bf16 p-lora h-lora p-bf16 p-lora; do
  case $r in p-*) B=/tmp/b/patch/vidgen;; h-*) B=/tmp/b/head/vidgen;; esac
  L=; [[ $r == *lora ]] && L="--lora /tmp/weights-14b-files/lora.safetensors"
  $B generate --model synthetic:wan2.1-t2v-14b --prompt "a red fox" --seed 1 --num-frames 81 --height 480 \
    --width 832 --num-inference-steps 1 --dtype bf16 --dit-layerwise-offload $L --output-type safetensors \
    --output-path /tmp/o --output-video-name $r --overwrite 2>&1 |
    grep -E "transformer: streamed|loaded transformer" | cut -c1-260 | sed "s/^/$r: /"
done
