"""Compares vidgen's safetensors frames with a diffusers reference tensor (fixture README tolerances).

usage: python3 compare_frames.py OURS.safetensors REFERENCE.safetensors TENSOR_NAME
"""
import sys

from safetensors.numpy import load_file

ours = load_file(sys.argv[1])["frames"]
ref = load_file(sys.argv[2])[sys.argv[3]][0]
excess = abs(ours - ref) - (1e-4 + 1e-4 * abs(ref))
print(f"{sys.argv[3]}: shape {ours.shape} vs {ref.shape}, max |diff| {abs(ours - ref).max():.3e}, "
      f"within 1e-4+1e-4|ref|: {bool((excess <= 0).all())}")
sys.exit(0 if ours.shape == ref.shape and (excess <= 0).all() else 1)
