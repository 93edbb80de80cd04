#!/usr/bin/env bash
# The seed table's rows (diffusers' "Module Group Offloading" PR) for LTX-Video, CogVideoX-5b,
# HunyuanVideo, Mochi-1, Allegro, Latte-1 and FLUX.1-dev, vidgen beside diffusers 0.42.1 in the same
# call: the transformer alone, synthetic
# full-size weights (written once to /dev/shm as safetensors so every mode loads them from the page
# cache), bf16, the table's sizes; 1 warm-up + 2 timed forwards per mode.
#   bash bench/seed_table.sh ltx cogvideox     # one call (~7 min on an H200)
#   bash bench/seed_table.sh hunyuan           # one call (~7 min)
#   bash bench/seed_table.sh hunyuan-720p     # HunyuanVideo 720x1280x129 with default flags, one forward
#   bash bench/seed_table.sh allegro latte     # one call (~6 min)
#   PEER_MODES=none,model,block_level_N1_stream,block_level_N8_stream,leaf_level_stream \
#     bash bench/seed_table.sh mochi           # one call each for mochi and flux (~6 min)
#   NO_VIDGEN=1 PEER_TAG=nostream PEER_MODES=none,block_level_N1,block_level_N8 \
#     bash bench/seed_table.sh mochi flux      # diffusers' rows without a stream for both (~6 min)
# Needs .device/offload_bench (the CUDA build of the offload_bench example, or .xz of it) and, for the peer,
# the diffusers wheel in .whl (../shared/peer/README.md). The last four families' peer is
# bench/peer_seed_table_rest.py (the shared script's machinery with their inputs). Writes $OUT/<family>-vidgen.jsonl,
# $OUT/peer-<family>/results.json and $OUT/seed-table.md.
set -u
OUT=${OUT:-/tmp/vidgen-bench}
mkdir -p "$OUT"
export VIDGEN_BENCH_FILES=/dev/shm/vidgen-bench
B=./.device/offload_bench
[ -f $B.xz ] && xz -dc $B.xz > $B && chmod +x $B
# The peer script: from ../shared/peer here, carried in .device on the GPU machine.
PEER=../shared/peer/seed_table_bench.py; [ -f $PEER ] || PEER=.device/seed_table_bench.py
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -d .whl ]; then
  export PATH=/opt/torch/.venv/bin:$PATH
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site
fi
# The table's modes, in diffusers' names, as vidgen flags.
MODES=("none: --dit-layerwise-offload=false --dit-cpu-offload=false"
  "model: --dit-layerwise-offload=false --dit-cpu-offload"
  "block_level_N1: --offload-stream=false"
  "block_level_N8: --offload-stream=false --num-blocks-per-group 8"
  "block_level_N1_stream: --num-blocks-per-group 1"
  "block_level_N8_stream: --num-blocks-per-group 8"
  "leaf_level_stream: --offload-type leaf-level")
# (vidgen's default flags are block_level_N1_stream's: layerwise streaming, one block per group.)
# EXTRA_MODE='label: flags' adds one vidgen-only row (e.g. leaf level with --prefetch-depth 2).
# PEER_MODES=none,block_level_N1_stream,... runs only those diffusers rows (its slow rows without a copy
# stream can then go in a call of their own); PEER_BUDGET_S bounds the peer's time; FORWARDS sets vidgen's
# timed forwards per mode (default 2). NO_VIDGEN=1 runs diffusers alone, and PEER_TAG=T writes its rows to
# peer-<family>+T (bench/seed_table.py merges them with peer-<family>'s: copy that folder beside the first call's).
[ -n "${EXTRA_MODE:-}" ] && MODES+=("$EXTRA_MODE")
REST="bench/peer_seed_table_rest.py --base $PEER"
for F in "$@"; do
  P=$PEER
  case $F in
    ltx) M=synthetic:ltx-video; S=161x512x768 ;;
    cogvideox) M=synthetic:cogvideox-5b; S=49x480x720 ;;
    hunyuan) M=synthetic:hunyuanvideo; S=61x320x512 ;;
    hunyuan-720p) M=synthetic:hunyuanvideo; S=129x720x1280 ;;
    mochi) M=synthetic:mochi-1; S=85x480x848; P=$REST ;;
    allegro) M=synthetic:allegro; S=88x720x1280; P=$REST ;;
    latte) M=synthetic:latte-1; S=16x512x512; P=$REST ;;
    flux) M=synthetic:flux.1-dev; S=1x768x768; P=$REST ;;
    *) echo "unknown family $F"; continue ;;
  esac
  if [ -z "${NO_VIDGEN:-}" ]; then
    if [ "$F" = hunyuan-720p ]; then
      /usr/bin/time -v $B $M 1 $S "default: " > "$OUT/$F-vidgen.jsonl" 2> "$OUT/$F-vidgen.log"
    else
      /usr/bin/time -v $B $M ${FORWARDS:-2} $S "${MODES[@]}" > "$OUT/$F-vidgen.jsonl" 2> "$OUT/$F-vidgen.log"
    fi
    echo "== vidgen $F: exit $?"; grep -E "wrote|Maximum resident|Elapsed|rror" "$OUT/$F-vidgen.log"
    rm -rf /dev/shm/vidgen-bench
  fi
  if [ "$F" != hunyuan-720p ] && [ -z "${NO_PEER:-}" ]; then
    PO=$OUT/peer-$F${PEER_TAG:++$PEER_TAG}
    python3 $P --models "$F" --out "$PO" --budget-s ${PEER_BUDGET_S:-560} \
      ${PEER_MODES:+--modes $PEER_MODES} > "$PO.log" 2>&1
    echo "== diffusers $F: exit $?"; tail -3 "$PO.log"
  fi
done
python3 bench/seed_table.py "$OUT" | tee "$OUT/seed-table.md"
