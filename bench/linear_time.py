#!/usr/bin/env python3
"""One DiT forward's GPU time by kind, from Nsight Compute kernel durations (issue 36: "the DiT's Linear time").

    python3 bench/linear_time.py exact=EXACT_1.csv,EXACT_2.csv fp8=FAST_1.csv,FAST_2.csv [NAME=ONE.csv,TWO.csv ...]

Each NAME is a column; the first is the baseline the others' ratios are against. Each CSV is `ncu --csv --page raw --metrics gpu__time_duration.sum` over a `vidgen generate` run; the two files of
a pair differ by one denoising step (one forward without CFG), so subtracting the first's kernels from the second's
leaves that forward's (the text stage, the decode and, with --fp8-matmul, the weights' quantization at the first
forward cancel). Kinds: the Linear layers (cuBLAS/cuBLASLt products, and fp8's input quantization and scale pass),
attention, everything else.
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_kernels import kernels  # noqa: E402


def kind(name):
    n = name.lower()
    if "quantize" in n or "scale_rows" in n:
        return "linear: fp8 input quantization"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "splitk", "fp8_linear")):
        return "linear: products"
    if any(s in n for s in ("flash", "sage", "attn", "fmha")):
        return "attention"
    return "rest"


def forward(one, two):
    (t1, c1), (t2, c2) = kernels(one), kernels(two)
    by_kind, by_name = collections.Counter(), collections.Counter()
    for name in t2:
        d = t2[name] - t1.get(name, 0.0)
        by_name[name] += d
        by_kind[kind(name)] += d
    launches = sum(c2.values()) - sum(c1.values())
    return by_kind, by_name, launches


def main():
    runs = {}
    for arg in sys.argv[1:]:
        name, files = arg.split("=", 1)
        runs[name] = forward(*files.split(","))
    base = next(iter(runs))
    kinds = sorted({k for r in runs.values() for k in r[0]})
    print("| one forward, ms of kernel time | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{r[0][k]:.1f}" for r in runs.values()) + " |")
    linear = {m: sum(v for k, v in r[0].items() if k.startswith("linear")) for m, r in runs.items()}
    total = {m: sum(r[0].values()) for m, r in runs.items()}
    print("| **the Linear layers** | " + " | ".join(f"**{linear[m]:.1f}**" for m in runs) + " |")
    print("| all kernels | " + " | ".join(f"{total[m]:.1f}" for m in runs) + " |")
    print("| launches | " + " | ".join(str(r[2]) for r in runs.values()) + " |")
    for m in list(runs)[1:]:
        print(f"\nLinear time {base} / {m}: {linear[base] / linear[m]:.3f}x; "
              f"all kernels: {total[base] / total[m]:.3f}x")
    for m, r in runs.items():
        print(f"\n{m}: largest kernels of one forward")
        for name, t in r[1].most_common(14):
            print(f"{t:9.2f} ms  {kind(name):32s} {name[:100]}")


main()
