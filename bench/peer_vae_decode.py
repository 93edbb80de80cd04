"""diffusers 0.42.1's VAE decode of one family, bf16, random weights from vidgen's synthetic config
(assets/<family>/vae/config.json), at the shape `examples/vae_decode.rs --family` uses: one JSON
line per run (untiled, then tiled with `enable_tiling()`), after a warm-up on two latent frames. Allegro's VAE
decodes in tiles only (untiled it raises), warmed up on the whole latents; MiniMax H3's decodes in clips and
256 px tiles by default (`use_tiling` is on from the start), its one run that default; `minimax-h3-audio` is
MiniMax H3's audio VAE (f32, untiled) on the 5 s request's stereo latents; the Wan VAEs decode in f32, as the
Wan pipelines load them.

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
    "minimax-h3-audio": [2, 32, 207],
    "wan2.1-t2v-1.3b": [1, 16, 21, 60, 104],
    "wan2.2-ti2v-5b": [1, 48, 31, 44, 80],
}
# The VAEs whose only decode (or default one) is tiled.
TILED_ONLY = ("allegro", "minimax-h3")

family = sys.argv[1]
shape = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else DEFAULT[family]
# MiniMax H3's audio VAE stays in f32 (`_keep_in_fp32_modules`, as the pipeline loads it) and has no tiling.
AUDIO = family == "minimax-h3-audio"
# The Wan pipelines load their VAE in f32 too.
dtype = torch.float32 if AUDIO or family.startswith("wan") else torch.bfloat16
cfg = json.load(open("assets/minimax-h3/audio_vae/config.json" if AUDIO else f"assets/{family}/vae/config.json"))
cls = getattr(diffusers, cfg["_class_name"])
torch.manual_seed(0)
with torch.device("cuda"):
    vae = cls.from_config(cfg).to(dtype).eval()
# What from_pretrained(torch_dtype=...) keeps in f32 (MiniMax H3's VAEs: its norms and residual scales, so the
# video decoder's residual stream runs in f32): each parameter one of whose path parts is named there.
keep = getattr(cls, "_keep_in_fp32_modules", None) or []
for name, p in vae.named_parameters():
    if any(k in name.split(".") for k in keep):
        p.data = p.data.float()
torch.cuda.synchronize()
weights = torch.cuda.memory_allocated()
z = torch.randn(shape, device="cuda", dtype=dtype)
kwargs = {}
if getattr(vae.config, "timestep_conditioning", False):
    kwargs["temb"] = torch.tensor([0.05], device="cuda", dtype=torch.bfloat16)


def decode(x):
    with torch.no_grad():
        if family == "latte-1":  # LattePipeline.decode_latents: the frames as images, 14 at a time
            x = x.permute(0, 2, 1, 3, 4).flatten(0, 1)
            return torch.cat([vae.decode(x[i:i + 14]).sample for i in range(0, x.shape[0], 14)])
        if AUDIO:  # the pipeline's decode: z * latents_std + latents_mean, then audio_vae.decode
            for key, op in (("latents_std", torch.mul), ("latents_mean", torch.add)):
                if getattr(vae.config, key, None) is not None:
                    x = op(x, torch.tensor(getattr(vae.config, key), device="cuda").view(1, -1, 1))
            return vae.decode(x, return_dict=False)[0]
        if family == "flux.1-dev":  # FluxPipeline: one image, its frame axis dropped
            return vae.decode(x[:, :, 0], return_dict=False)[0]
        return vae.decode(x, return_dict=False, **kwargs)[0]


for tiled in (True,) if family in TILED_ONLY else (False,) if AUDIO else (False, True):
    if tiled:
        vae.enable_tiling()
    try:
        start = time.perf_counter()
        decode(z if family == "allegro" else z[:, :, : min(7 if family == "minimax-h3" else 2, shape[2])])
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
