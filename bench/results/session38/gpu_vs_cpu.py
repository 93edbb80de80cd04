"""Runs each case of session 38's call 1 on the CPU (f32), then on CUDA in f32 (resident, then streamed by block
groups) and bf16 (the fused paths), and prints per case and mode the frames' max |difference| from the CPU run and
whether the step cache's record (`cache.computed.*`) equals the CPU run's.

Usage: python3 gpu_vs_cpu.py VIDGEN FIXTURES OUT"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

vidgen, fixtures, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
cache_cases = json.loads((fixtures / "cache-families-README.json").read_text())["cli_cases"]


def without_cache(args):
    """A case's arguments without its `--cache`."""
    i = args.index("--cache")
    return args[:i] + args[i + 2:]


# Each fixture's small call (sizes, steps, prompt) from its first cache case.
base = {}
for c in cache_cases:
    base.setdefault(c["fixture"], without_cache(c["args"]))
wan_loras = json.loads((fixtures / "wan-loras/README.json").read_text())["cli_cases"]
base["wan-tiny-a"] = wan_loras[0]["args"]

runs = []
for c in cache_cases:
    if ".taylorseer_ff." in c["name"]:
        runs.append((c["name"], c["fixture"], c["args"]))
        runs.append((c["name"].replace("taylorseer_ff", "no_cache"), c["fixture"], without_cache(c["args"])))
runs += [
    ("flux-kohya-lora", "flux-tiny-a", base["flux-tiny-a"] + ["--lora", str(fixtures / "flux-kohya.safetensors")]),
    ("flux-clip-lora", "flux-tiny-a", base["flux-tiny-a"] + ["--lora", str(fixtures / "flux-kohya-te.safetensors")]),
    ("wan-no-lora", "wan-tiny-a", base["wan-tiny-a"]),
    ("wan-peft-lora", "wan-tiny-a",
     base["wan-tiny-a"] + ["--lora", str(fixtures / "wan-loras/wan-original-peft.safetensors") + ":0.7"]),
]
for model, file in [("flux-tiny-a", "flux-tiny-a-Q8_0.gguf"), ("flux-tiny-a", "flux-tiny-a-comfyui-bf16.safetensors"),
                    ("hunyuanvideo-tiny-a", "hunyuanvideo-tiny-a-Q8_0.gguf"), ("mochi-tiny-a", "mochi-tiny-a-Q8_0.gguf"),
                    ("ltx-video-tiny-a", "ltx-video-tiny-a-Q8_0.gguf")]:
    runs.append((file, model, base[model] + ["--transformer", str(fixtures / "original-layouts" / file)]))

MODES = {
    "cpu": ["--device", "cpu", "--dtype", "f32"],
    "cuda": ["--device", "cuda", "--dtype", "f32"],
    "cuda-streamed": ["--device", "cuda", "--dtype", "f32", "--memory-model", "discrete", "--dit-layerwise-offload"],
    "cuda-bf16": ["--device", "cuda", "--dtype", "bf16"],
}
for name, model, args in runs:
    got = {}
    for mode, flags in MODES.items():
        cmd = [vidgen, "generate", "--model", str(fixtures / model), *args, "--seed", "7", *flags,
               "--output-type", "safetensors", "--output-path", str(out), "--output-video-name", f"{name}.{mode}",
               "--overwrite"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{name} {mode}: FAILED {r.stderr.strip().splitlines()[-1:]}")
            continue
        got[mode] = load_file(str(out / f"{name}.{mode}.safetensors"))
    if "cpu" not in got:
        continue
    ref = got["cpu"]
    for mode, t in got.items():
        if mode == "cpu":
            continue
        diff = float(np.abs(t["frames"].astype(np.float64) - ref["frames"].astype(np.float64)).max())
        records = [k for k in ref if k.startswith("cache.computed.")]
        same = all(k in t and np.array_equal(t[k], ref[k]) for k in records)
        print(f"{name:48s} {mode:14s} max |frames - cpu| {diff:.2e}" + (f"  records {'equal' if same else 'DIFFER'}"
                                                                          if records else ""))
