"""diffusers 0.42.1's VAE decode of one family, bf16, random weights from vidgen's synthetic config
(assets/<family>/vae/config.json), at the shape `examples/vae_decode.rs --family` uses: one JSON
line per run (untiled, then tiled with `enable_tiling()`), after a warm-up on two latent frames. Allegro's VAE
decodes in tiles only (untiled it raises), warmed up on the whole latents; MiniMax H3's decodes in clips and
256 px tiles by default (`use_tiling` is on from the start), its one run that default.

python3 bench/peer_vae_decode.py FAMILY [B,C,F,h,w]
"""
import json
import sys
import time

import torch
import diffusers

DEFAULT = {
    "ltx-video": [1, 128, 21, 16, 22],
    "cogvideox-5b": [1, 16, 13, 60, 90],
    "hunyuanvideo": [1, 16, 33, 90, 160],
    "mochi-1": [1, 12, 15, 60, 106],
    "latte-1": [1, 4, 16, 64, 64],
    "allegro": [1, 4, 22, 90, 160],
    "flux.1-dev": [1, 16, 1, 128, 128],
    "minimax-h3": [1, 24, 37, 48, 84],
}
# The VAEs whose only decode (or default one) is tiled.
TILED_ONLY = ("allegro", "minimax-h3")

family = sys.argv[1]
shape = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else DEFAULT[family]
cfg = json.load(open(f"assets/{family}/vae/config.json"))
cls = getattr(diffusers, cfg["_class_name"])
torch.manual_seed(0)
with torch.device("cuda"):
    vae = cls.from_config(cfg).to(torch.bfloat16).eval()
torch.cuda.synchronize()
weights = torch.cuda.memory_allocated()
z = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
kwargs = {}
if getattr(vae.config, "timestep_conditioning", False):
    kwargs["temb"] = torch.tensor([0.05], device="cuda", dtype=torch.bfloat16)


def decode(x):
    with torch.no_grad():
        if family == "latte-1":  # LattePipeline.decode_latents: the frames as images, 14 at a time
            x = x.permute(0, 2, 1, 3, 4).flatten(0, 1)
            return torch.cat([vae.decode(x[i:i + 14]).sample for i in range(0, x.shape[0], 14)])
        if family == "flux.1-dev":  # FluxPipeline: one image, its frame axis dropped
            return vae.decode(x[:, :, 0], return_dict=False)[0]
        return vae.decode(x, return_dict=False, **kwargs)[0]


for tiled in (True,) if family in TILED_ONLY else (False, True):
    if tiled:
        vae.enable_tiling()
    try:
        start = time.perf_counter()
        decode(z if family == "allegro" else z[:, :, : min(2, shape[2])])
        torch.cuda.synchronize()
        warm = time.perf_counter() - start
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = decode(z)
        torch.cuda.synchronize()
        secs = time.perf_counter() - start
        gib = 2**30
        print(json.dumps({
            "peer": "diffusers " + diffusers.__version__, "family": family, "tiled": tiled,
            "latents": shape, "frames": list(out.shape), "decode_s": round(secs, 3),
            "warm_up_s": round(warm, 3), "weights_gib": round(weights / gib, 2),
            "peak_allocated_above_weights_gib": round((torch.cuda.max_memory_allocated() - weights) / gib, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2),
            "finite": bool(torch.isfinite(out).all()),
        }), flush=True)
        del out
    except Exception as e:  # an out-of-memory untiled decode is a result too
        print(json.dumps({"peer": "diffusers", "family": family, "tiled": tiled, "error": str(e)[:200]}), flush=True)
    torch.cuda.empty_cache()
