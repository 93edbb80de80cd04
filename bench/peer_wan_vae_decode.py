#!/usr/bin/env python3
"""diffusers 0.42.1's Wan VAE decode on the GPU, timed like vidgen's decode stage, for the
side-by-side row of issue 11 (run in the same device call as vidgen's decode).

AutoencoderKLWan() with its default (published Wan2.1) config, random weights, f32, torch's
defaults (cuDNN convolutions with TF32 allowed, benchmark off); latents [1, 16, 21, 60, 104]
(480x832, 81 frames). One warm-up decode of 2 latent frames, then the whole decode timed with
CUDA events. Prints one JSON line.
"""
import json
import sys
import time

import torch
from diffusers import AutoencoderKLWan

shape = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,16,21,60,104").split(",")]
torch.manual_seed(0)
start = time.perf_counter()
vae = AutoencoderKLWan().to("cuda").eval()
for p in vae.parameters():
    torch.nn.init.normal_(p, std=0.02)
setup = time.perf_counter() - start
z = torch.randn(shape, device="cuda")
with torch.no_grad():
    vae.decode(z[:, :, :2]).sample
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = vae.decode(z).sample
    b.record()
    torch.cuda.synchronize()
print(json.dumps({
    "peer": "diffusers AutoencoderKLWan.decode",
    "latents": shape, "frames": list(out.shape),
    "decode_s": a.elapsed_time(b) / 1e3, "setup_s": setup,
    "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
    "cudnn": torch.backends.cudnn.version(), "allow_tf32_conv": torch.backends.cudnn.allow_tf32,
}))
