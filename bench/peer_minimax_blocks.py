#!/usr/bin/env python3
"""diffusers 0.42.1's MiniMaxH3Transformer3DModel per block, for issue 14's "per-block forward time against
diffusers, no slower": the published transformer config (tests/fixtures/minimax-h3-configs.json) with fewer
blocks (--blocks, default 2 and 6), random weights N(0, 0.02) made on the device (norm weights 1), bf16 with the
model's `_keep_in_fp32_modules` in f32 (as `from_pretrained(torch_dtype=bfloat16)` leaves them), on the packed
sequence of a 5 s 768x1344 request (37,296 video rows, 414 audio rows, 512 text rows; vidgen's geometry for 124
frames). Each size: 1 warm-up and 3 timed forwards (CUDA events); the per-block time is the difference of the
medians over the difference of the block counts (the refiner, embeddings and heads cancel). vidgen's side is its
whole 50-block forward from the same call (bench/gpu_minimax_h3.sh): no slower per block when 50 x diffusers'
per-block time is at least vidgen's whole forward.

  python3 bench/peer_minimax_blocks.py --out OUT            # GPU
  python3 bench/peer_minimax_blocks.py --quick --out /tmp/q # CPU, a tiny sequence
"""

import argparse
import json
import os
import statistics

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(blocks, device):
    from diffusers import MiniMaxH3Transformer3DModel

    with open(os.path.join(ROOT, "tests/fixtures/minimax-h3-configs.json")) as f:
        cfg = json.load(f)["configs"]["transformer/config.json"]
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg["num_layers"] = blocks
    cfg["patch_size"] = tuple(cfg["patch_size"])
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    keep = model._keep_in_fp32_modules or []
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in keep):  # substrings, as diffusers matches them
                p.data = p.data.float()
            if "norm" in name and p.ndim == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02))
    return model.eval(), cfg


def inputs(cfg, sizes, device):
    (frames, h, w), audio, text = sizes
    p = cfg["patch_size"]
    video_rows = frames * (h // p[1]) * (w // p[2])
    seq = text + video_rows + audio
    g = torch.Generator(device=device).manual_seed(1)
    tags = torch.cat([torch.full((text,), 1), torch.zeros(video_rows), torch.full((audio,), 2)]).long()
    t, hh, ww = torch.meshgrid(
        torch.arange(frames), torch.arange(h // p[1]), torch.arange(w // p[2]), indexing="ij"
    )
    video_pos = torch.stack([t.flatten(), hh.flatten(), ww.flatten()], 1)
    text_pos = torch.arange(text).unsqueeze(1).repeat(1, 3)
    audio_pos = torch.arange(audio).unsqueeze(1).repeat(1, 3)
    return dict(
        hidden_states=torch.randn(1, video_rows, cfg["in_channels"] * p[0] * p[1] * p[2], generator=g, device=device),
        audio_hidden_states=torch.randn(1, audio, cfg["audio_in_channels"], generator=g, device=device),
        encoder_hidden_states=torch.randn(1, text, cfg["text_dim"], generator=g, device=device),
        timestep=torch.tensor([0.9, 0.7], device=device),
        timestep_indices=(tags == 2).long().to(device),
        token_tags=tags.to(device),
        position_ids=torch.cat([text_pos, video_pos, audio_pos]).long().to(device),
        video_indices=torch.arange(text, text + video_rows, device=device),
        audio_indices=torch.arange(text + video_rows, seq, device=device),
        text_indices=torch.arange(text, device=device),
        return_dict=False,
    )


def timed(model, kw, cuda, warm, runs):
    times = []
    with torch.no_grad():
        for i in range(warm + runs):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            model(**kw)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                if i >= warm:
                    times.append(start.elapsed_time(end) / 1e3)
            elif i >= warm:
                times.append(0.0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--blocks", default="2,6")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cuda = not a.quick and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sizes = ((2, 4, 4), 4, 3) if a.quick else ((37, 48, 84), 414, 512)
    result = {"sizes": {"video_latents_fhw": sizes[0], "audio_rows": sizes[1], "text_rows": sizes[2]}, "forwards": {}}
    counts = [int(b) for b in a.blocks.split(",")]
    for n in counts:
        model, cfg = build(n, device)
        kw = inputs(cfg, sizes, device)
        times = timed(model, kw, cuda, 1, 1 if a.quick else 3)
        result["forwards"][n] = times
        print(f"diffusers MiniMaxH3Transformer3DModel, {n} blocks: forwards {['%.4f' % t for t in times]} s", flush=True)
        del model, kw
        if cuda:
            torch.cuda.empty_cache()
    lo, hi = counts[0], counts[-1]
    per_block = (statistics.median(result["forwards"][hi]) - statistics.median(result["forwards"][lo])) / (hi - lo)
    result["per_block_s"] = per_block
    print(f"diffusers per block {per_block:.4f} s; x50 blocks {50 * per_block:.3f} s", flush=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
