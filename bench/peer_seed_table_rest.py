#!/usr/bin/env python3
"""diffusers 0.42.1's side of the group-offloading table for Mochi-1, Allegro, Latte-1 and FLUX.1-dev: the
transformer alone, built from its published config with random weights, bf16, fed the inputs its pipeline feeds it
at one CFG branch at the table's sizes (Mochi 480x848x85, Allegro 720x1280x88, Latte 512x512x16, FLUX.1-dev
768x768).

Everything but the families is the shared peer script's (../shared/peer/seed_table_bench.py, or --base): the
modes, the random weights, the timing (1 warm-up + 2 timed forwards, CUDA events), the memory readings and the
results.json / results.md it writes, so bench/seed_table.py reads both alike.

  python3 bench/peer_seed_table_rest.py --models mochi,allegro --out OUT [--modes none,model,...] [--budget-s S]
  python3 bench/peer_seed_table_rest.py --quick     # CPU: the tiny fixtures through every mode, the real-size plan
"""

import argparse
import importlib.util
import json
import os
import sys
import traceback
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BASES = [os.path.join(HERE, "..", "..", "shared", "peer", "seed_table_bench.py"),
         os.path.join(HERE, "..", ".device", "seed_table_bench.py")]

# Published transformer configs (../shared/fixtures/seed-rest-configs.json, transformer/config.json).
MOCHI_CFG = {"patch_size": 2, "num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 48,
             "pooled_projection_dim": 1536, "in_channels": 12, "out_channels": None, "qk_norm": "rms_norm",
             "text_embed_dim": 4096, "time_embed_dim": 256, "activation_fn": "swiglu", "max_sequence_length": 256}
ALLEGRO_CFG = {"patch_size": 2, "patch_size_t": 1, "num_attention_heads": 24, "attention_head_dim": 96,
               "in_channels": 4, "out_channels": 4, "num_layers": 32, "dropout": 0.0, "cross_attention_dim": 2304,
               "attention_bias": True, "sample_height": 90, "sample_width": 160, "sample_frames": 22,
               "activation_fn": "gelu-approximate", "norm_elementwise_affine": False, "norm_eps": 1e-06,
               "caption_channels": 4096, "interpolation_scale_h": 2.0, "interpolation_scale_w": 2.0,
               "interpolation_scale_t": 2.2}
LATTE_CFG = {"num_attention_heads": 16, "attention_head_dim": 72, "in_channels": 4, "out_channels": 8, "num_layers": 28,
             "dropout": 0.0, "cross_attention_dim": 1152, "attention_bias": True, "sample_size": 64, "patch_size": 2,
             "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000, "norm_type": "ada_norm_single",
             "norm_elementwise_affine": False, "norm_eps": 1e-06, "caption_channels": 4096, "video_length": 16}
FLUX_CFG = {"patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
            "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
            "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]}

# Each family at the table's size and its pipeline's call defaults (steps; CFG doubles the forwards, FLUX.1-dev's
# guidance is embedded); `quick` is a size the tiny fixture runs (every tiny VAE keeps the real scale factors).
FAMILIES = {
    "mochi": dict(cls="MochiTransformer3DModel", repo="genmo/mochi-1-preview", cfg=MOCHI_CFG, fixture="mochi-tiny-a",
                  height=480, width=848, frames=85, steps=64, cfg_fwd=2, quick=dict(height=32, width=48, frames=13)),
    "allegro": dict(cls="AllegroTransformer3DModel", repo="rhymes-ai/Allegro", cfg=ALLEGRO_CFG,
                    fixture="allegro-tiny-a", height=720, width=1280, frames=88, steps=100, cfg_fwd=2,
                    quick=dict(height=32, width=32, frames=8)),
    "latte": dict(cls="LatteTransformer3DModel", repo="maxin-cn/Latte-1", cfg=LATTE_CFG, fixture="latte-tiny-a",
                  height=512, width=512, frames=16, steps=50, cfg_fwd=2, quick=dict(height=32, width=32, frames=5)),
    "flux": dict(cls="FluxTransformer2DModel", repo="black-forest-labs/FLUX.1-dev", cfg=FLUX_CFG,
                 fixture="flux-tiny-a", height=768, width=768, frames=1, steps=28, cfg_fwd=1,
                 quick=dict(height=32, width=32, frames=1)),
}
# The resident s/forward on an H200 as counted from FLOPs (attention over all tokens), for --quick's time plan only.
TYPICAL_S_PER_FORWARD = dict(mochi=2.0, allegro=5.0, latte=0.1, flux=0.25)
VAE_SPATIAL = 8
PROMPT_TOKENS = 40  # the prompt's tokens (unmasked where a mask goes in; Latte's embeddings are cut to them)


def make_inputs(fam, cfg, height, width, frames, device, batch=1, seed=1):
    """The transformer's keyword arguments as the family's pipeline builds them (batch 1 = one CFG branch)."""
    from diffusers import AllegroPipeline, FluxPipeline

    g = torch.Generator(device="cpu").manual_seed(seed)
    bf = torch.bfloat16
    lh, lw = height // VAE_SPATIAL, width // VAE_SPATIAL

    def rn(*shape):
        return torch.randn(shape, generator=g).to(device, bf)

    def mask(text_len, dtype):
        m = torch.zeros(batch, text_len, dtype=dtype)
        m[:, :PROMPT_TOKENS] = 1
        return m.to(device)

    if fam == "mochi":  # pipeline_mochi.py: 6x temporal; 256 T5 tokens, a bool mask; t in the latents' dtype
        lf = (frames - 1) // 6 + 1
        return dict(hidden_states=rn(batch, cfg["in_channels"], lf, lh, lw),
                    encoder_hidden_states=rn(batch, 256, cfg["text_embed_dim"]),
                    timestep=torch.full((batch,), 1000.0, dtype=bf, device=device),
                    encoder_attention_mask=mask(256, torch.bool), return_dict=False)
    if fam == "allegro":  # pipeline_allegro.py: 4x temporal; 512 T5 tokens, the tokenizer's int64 mask; 3-D RoPE
        lf = -(-frames // 4) if frames % 2 == 0 else -(-(frames - 1) // 4) + 1
        # The pipeline's own RoPE method, on a stand-in for the pipeline (it reads these two attributes).
        pipe = SimpleNamespace(vae_scale_factor_spatial=VAE_SPATIAL,
                               transformer=SimpleNamespace(config=SimpleNamespace(**cfg)))
        rope = AllegroPipeline._prepare_rotary_positional_embeddings(pipe, batch, height, width, lf, device)
        return dict(hidden_states=rn(batch, cfg["in_channels"], lf, lh, lw),
                    encoder_hidden_states=rn(batch, 512, cfg["caption_channels"]),
                    encoder_attention_mask=mask(512, torch.long),
                    timestep=torch.full((batch,), 999.0, device=device),  # EulerAncestral timesteps, float32
                    image_rotary_emb=rope, return_dict=False)
    if fam == "latte":  # pipeline_latte.py: no temporal compression; mask_feature cuts the embeddings, no mask
        return dict(hidden_states=rn(batch, cfg["in_channels"], frames, lh, lw),
                    encoder_hidden_states=rn(batch, PROMPT_TOKENS, cfg["caption_channels"]),
                    timestep=torch.full((batch,), 999, dtype=torch.long, device=device),  # DDIM timesteps, int64
                    enable_temporal_attentions=True, return_dict=False)
    if fam == "flux":  # pipeline_flux.py: 2x2-packed latents, 512 T5 tokens, CLIP pooled, ids, embedded guidance
        h, w = 2 * (height // (VAE_SPATIAL * 2)), 2 * (width // (VAE_SPATIAL * 2))
        return dict(hidden_states=rn(batch, (h // 2) * (w // 2), cfg["in_channels"]),
                    timestep=torch.full((batch,), 1000.0, dtype=bf, device=device) / 1000,
                    guidance=torch.full((batch,), 3.5, dtype=torch.float32, device=device) if cfg["guidance_embeds"]
                    else None,
                    pooled_projections=rn(batch, cfg["pooled_projection_dim"]),
                    encoder_hidden_states=rn(batch, 512, cfg["joint_attention_dim"]),
                    txt_ids=torch.zeros(512, 3, dtype=bf, device=device),
                    img_ids=FluxPipeline._prepare_latent_image_ids(batch, h // 2, w // 2, device, bf),
                    return_dict=False)
    raise ValueError(fam)


def describe(v):
    """An input as its shape and dtype (Allegro's RoPE is tuples of tuples of tensors)."""
    if torch.is_tensor(v):
        return f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}"
    if isinstance(v, (tuple, list)):
        return [describe(x) for x in v]
    if isinstance(v, dict):
        return {k: describe(x) for k, x in v.items()}
    return v


def video_tokens(fam, cfg, inputs):
    hs = inputs["hidden_states"]
    if fam == "flux":
        return hs.shape[1]
    p = cfg["patch_size"]
    return hs.shape[2] * (hs.shape[3] // p) * (hs.shape[4] // p)


def load_base(path):
    """The shared peer script as a module, its families swapped for these."""
    paths = [path] if path else BASES
    found = next((p for p in paths if os.path.exists(p)), None)
    if found is None:
        sys.exit(f"no seed_table_bench.py at {' or '.join(paths)}; pass --base")
    spec = importlib.util.spec_from_file_location("seed_table_bench", found)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    base.FAMILIES = FAMILIES
    return base


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--out", default=os.environ.get("OUT") or "out")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip modes that would end past this")
    ap.add_argument("--quick", action="store_true", help="tiny fixture configs on CPU: smoke test")
    ap.add_argument("--fixtures", default=os.path.join(HERE, "..", "..", "shared", "fixtures"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--base", default=None, help="the shared peer script seed_table_bench.py")
    ap.add_argument("--modes", default=None, help="comma-separated (default: all of the shared script's)")
    args = ap.parse_args()
    base = load_base(args.base)
    args.modes = args.modes or ",".join(base.MODES)
    fams = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in fams:
        if m not in FAMILIES:
            ap.error(f"unknown model {m}; choose from {list(FAMILIES)}")
    for m in modes:
        if m not in base.MODES:
            ap.error(f"unknown mode {m}; choose from {list(base.MODES)}")
    if modes[0] != "none" and "none" in modes:
        modes = ["none"] + [m for m in modes if m != "none"]
    dev = base.Dev(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    if not args.quick and not dev.cuda:
        ap.error("the full run needs CUDA; use --quick on CPU")

    results = dict(quick=args.quick, env=base.environment(dev), budget_s=args.budget_s, models={}, rows=[],
                   skipped=[], errors=[])
    base.log("env:", json.dumps(results["env"]))

    def save():
        results["total_s"] = round(base.elapsed(), 1)
        base.write_report(results, args.out)

    if args.quick:  # real-size shapes and sizes, without a real-size forward
        base.log("== real-size plan (shapes as the pipelines build them; params counted on the meta device)")
        total = 20.0
        for fam in fams:
            F = FAMILIES[fam]
            inp = make_inputs(fam, F["cfg"], F["height"], F["width"], F["frames"], torch.device("cpu"))
            ps = base.meta_param_stats(fam, F["cfg"])
            pl = base.plan(TYPICAL_S_PER_FORWARD[fam], 2 * ps["params"])
            total += sum(pl.values())
            results.setdefault("real_size_plan", {})[fam] = dict(
                inputs=describe(inp), video_tokens=video_tokens(fam, F["cfg"], inp), **ps,
                assumed_s_per_forward=TYPICAL_S_PER_FORWARD[fam], est_s_by_mode=pl)
            base.log(f"  {fam}: {json.dumps(results['real_size_plan'][fam])}")
        results["real_size_plan_total_s"] = round(total, 1)
        base.log(f"  estimated full GPU run: {total:.0f} s (+ pip install, python start) "
                 f"vs budget {args.budget_s:.0f} s")
        save()

    for fam in fams:
        F = FAMILIES[fam]
        if args.quick:
            cfg = base.fixture_cfg(args.fixtures, fam)
            h, w, nf = F["quick"]["height"], F["quick"]["width"], F["quick"]["frames"]
        else:
            cfg, h, w, nf = F["cfg"], F["height"], F["width"], F["frames"]
        base.log(f"==== {fam}: {F['cls']} {h}x{w} {nf} frames, cfg {json.dumps(cfg)}")
        info = dict(repo=F["repo"], cls=F["cls"], config=cfg, setting=f"{h}x{w}, {nf} frames, {F['steps']} steps",
                    steps=F["steps"], forwards_per_step=F["cfg_fwd"])
        results["models"][fam] = info
        inputs = make_inputs(fam, cfg, h, w, nf, dev.device)
        info["inputs"] = describe(inputs)
        info["video_tokens"] = video_tokens(fam, cfg, inputs)
        base.log(f"  inputs {json.dumps(info['inputs'])}, video tokens {info['video_tokens']}")
        ref, t_res, pbytes = None, None, None
        for mode in modes:
            row_base = dict(model=fam, mode=mode, mode_args=base.MODES[mode])
            if not dev.cuda and base.MODES[mode].get("use_stream"):
                msg = f"{fam} {mode}: use_stream needs CUDA; ran with use_stream=False on CPU (--quick only)"
                results["skipped"].append(msg)
                base.log("note", msg)
            if mode != "none" and t_res is None and not args.quick:
                msg = f"{fam} {mode}: no resident time to estimate from (resident failed or skipped)"
                results["skipped"].append(msg)
                results["rows"].append(dict(row_base, skipped=msg))
                base.log("skip", msg)
                continue
            est = (5.0 if args.quick else 60.0) if mode == "none" else base.estimate_mode_s(mode, t_res, pbytes,
                                                                                          args.quick)
            if base.elapsed() + est > args.budget_s:
                msg = (f"{fam} {mode}: would pass the {args.budget_s:.0f} s budget (at {base.elapsed():.0f} s, "
                       f"est. {est:.0f} s)")
                results["skipped"].append(msg)
                results["rows"].append(dict(row_base, skipped=msg))
                base.log("skip", msg)
                continue
            base.log(f"== {fam} {mode} (est. {est:.0f} s)")
            try:
                row, o = base.run_mode(fam, cfg, mode, dev, inputs, ref)
                row["est_s_before"] = round(est, 1)
                row["est_run_s"] = round(row["s_per_forward"] * F["cfg_fwd"] * F["steps"], 1)
                if mode == "none":
                    ref, t_res, pbytes = o, row["s_per_forward"], row["param_bytes"]
                    info.update(params=row["params"], param_GiB=row["param_GiB"])
                base.log(f"  -> {mode}: {row['s_per_forward']:.3f} s/forward, model_memory "
                         f"{row['model_memory_reserved_GiB']} GiB, inference {row['inference_peak_reserved_GiB']} GiB, "
                         f"pinned {row['host_pinned_after_run_GiB']}, diff {row.get('max_abs_diff_vs_none', '-')}")
            except Exception as e:
                traceback.print_exc()
                row = dict(row_base, error=repr(e))
                results["errors"].append(f"{fam} {mode}: {e!r}")
                dev.cleanup()
            results["rows"].append(row)
            save()
        inputs = ref = None
        dev.cleanup()
    save()
    base.log("done")
    print(open(os.path.join(args.out, "results.md")).read(), flush=True)


if __name__ == "__main__":
    main()
