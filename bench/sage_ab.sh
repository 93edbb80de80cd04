#!/usr/bin/env bash
# The 8-bit Hopper attention of several attn_bench builds, interleaved (clocks drift within a call): each build
# over the 14B self-attention shape, the 1.3B one, then the 14B again; attn_bench's accuracy line and its timed
# rounds, without the portable and GB10 columns.
#   bash bench/sage_ab.sh LABEL=BINARY ...      e.g. base=/tmp/ab_base now=/tmp/ab_now
set -u
for c in "14B self" 1.3B "14B self"; do
  for build in "$@"; do
    echo "-- ${build%%=*} $c"
    timeout 60 "${build#*=}" sage "$c" 2>&1 | grep -E "sage sm90 vs|round" \
      | sed -E 's/, portable.*sage m1 [^,]*//; s/, sage gb10.*//; s/ vs f32//'
  done
done
