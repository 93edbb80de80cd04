#!/usr/bin/env python3
"""MiniMax H3's text stage (issue 34 item 4: load from the page cache + encode, no slower than diffusers'), vidgen
beside diffusers 0.42.1 + transformers in one call on one GPU.

The published checkpoint (33.1 B DiT + 33.4 B Qwen3-VL-32B encoder, ~133 GB in bf16) fits neither the device
machine's host memory (128 GiB) nor its disk (64 GiB), so no whole-video run of it can load from the page cache.
The text stage does not depend on the DiT's depth, so the checkpoint written here (in /dev/shm, diffusers'
modular layout, family_e2e.py's random-weight writer) has the published text encoder, tokenizer, VAEs and
schedulers and a one-block transformer (its widths as published): ~74 GB.

  diffusers:  the text encoder as a user with a large GPU loads it (`Qwen3VLForConditionalGeneration
              .from_pretrained(..., dtype=bf16, device_map="cuda")`: straight to the device, as the host could
              not hold a CPU copy beside the page cache) and the pipeline's text step
              (`get_qwen3vl_prompt_embeds`: the verbatim prompt's ids, `text_encoder.model(...,
              output_hidden_states=True).hidden_states[50]`); the vision-token type ids are all 0 (text only:
              what the processor derives for them), so the processor is not loaded
  vidgen:     one process on the checkpoint with everything resident, 2 steps, 124x256x256 (the text stage is
              the same at any size; the rest is then quick): the `encode_text` stage and the text encoder's load line (taken out of the stage that paid it)

Usage (GPU machine, repository root, diffusers' wheel on PYTHONPATH):
  python3 bench/minimax_text_stage.py --vidgen BIN --out DIR [--reps 2] [--ckpt /dev/shm/vidgen-minimax-text]
"""
import argparse, inspect, json, os, shutil, sys, time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_e2e as e2e  # noqa: E402  (the random-weight writer and vidgen's runner)

ASSETS = os.path.join(e2e.ROOT, "assets", "minimax-h3")
LAYER = 50  # MiniMaxH3ModularPipeline.text_encoder_layer


def write(src, dest, device, dtype, layers=1):
    """The checkpoint: `src`'s configs, a transformer of `layers` blocks, random weights in `dtype` (the audio VAE
    in f32, as diffusers keeps it); unless `dest` holds one."""
    if os.path.exists(os.path.join(dest, "done")):
        e2e.log(f"checkpoint {dest} exists: reused")
        return {"reused": True}
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors*", "reference"))
    for name in ("vae", "audio_vae"):  # the published normalisation is unknown; the audio VAE's class default
        path = os.path.join(dest, name, "config.json")  # (None) fails diffusers' decode step: the identity, as the
        vae = json.load(open(path))                     # video VAE's class defaults, where the config has none
        for key, value in (("latents_mean", 0.0), ("latents_std", 1.0)):
            if vae.get(key) is None:
                vae[key] = [value] * vae["latent_channels"]
        json.dump(vae, open(path, "w"), indent=1)
    cfg_path = os.path.join(dest, "transformer", "config.json")
    cfg = json.load(open(cfg_path))
    cfg["num_layers"] = layers
    json.dump(cfg, open(cfg_path, "w"), indent=1)
    index = json.load(open(os.path.join(dest, "modular_model_index.json")))
    t0, written = time.perf_counter(), {}
    default = torch.get_default_dtype()
    for seed, name in enumerate(["text_encoder", "transformer", "vae", "audio_vae"], start=1):
        cls = e2e.component_class(index[name][:2])
        kept = torch.float32 if name == "audio_vae" else dtype
        torch.set_default_dtype(kept)  # built in its dtype: the encoder in f32 would not fit the device
        try:
            model = e2e.build(cls, os.path.join(dest, name), device)
        finally:
            torch.set_default_dtype(default)
        e2e.fill_(model, seed, device)
        model = model.to(kept)
        model.save_pretrained(os.path.join(dest, name), max_shard_size="5GB")
        written[name] = sum(p.numel() * p.element_size() for p in model.parameters()) / e2e.GiB
        del model
        e2e.free_memory()
    open(os.path.join(dest, "done"), "w").write("ok")
    seconds = time.perf_counter() - t0
    e2e.log(f"checkpoint written to {dest} in {seconds:.1f} s: {json.dumps(written)}")
    return {"reused": False, "seconds": seconds, "gib": written}


def diffusers_text_stage(ckpt, device, dtype):
    """Load (straight to the device) + the pipeline's text step, timed apart; the embeddings' shape."""
    from transformers import Qwen3VLForConditionalGeneration
    from tokenizers import Tokenizer
    e2e.sync()
    t0 = time.perf_counter()
    te = Qwen3VLForConditionalGeneration.from_pretrained(
        os.path.join(ckpt, "text_encoder"), dtype=dtype, device_map=device).eval()
    tokenizer = Tokenizer.from_file(os.path.join(ckpt, "tokenizer", "tokenizer.json"))
    e2e.sync()
    load = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.no_grad():
        ids = torch.tensor([tokenizer.encode(e2e.PROMPT, add_special_tokens=False).ids], device=device)
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False,
                  "output_hidden_states": True}
        if "mm_token_type_ids" in inspect.signature(te.model.forward).parameters:
            kwargs["mm_token_type_ids"] = torch.zeros_like(ids)
        embeds = te.model(**kwargs).hidden_states[LAYER].to(dtype)
    e2e.sync()
    encode = time.perf_counter() - t1
    r = {"load_s": load, "encode_s": encode, "text_stage_s": load + encode, "tokens": ids.shape[1],
         "embeds": list(embeds.shape)}
    if device == "cuda":
        r["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / e2e.GiB
        torch.cuda.reset_peak_memory_stats()
    del te, embeds
    e2e.free_memory()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidgen", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ckpt", default="/dev/shm/vidgen-minimax-text")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--configs", default=ASSETS, help="configs and tokenizer (a tiny fixture for a CPU smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=sorted(e2e.DTYPES))
    ap.add_argument("--size", default="124,256,256", help="vidgen's frames,height,width")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dtype = e2e.DTYPES[a.dtype]
    res = {"checkpoint": write(a.configs, a.ckpt, a.device, dtype)}
    os.sync()
    # The shortest video at a small size: the text stage is the same at any size, the rest is quick.
    run = {"family": "minimax-h3", "size": tuple(int(v) for v in a.size.split(",")), "steps": 2,
           "guidance": None, "device": a.device, "vidgen_dtype": a.dtype,
           "videos": "/tmp/vidgen-minimax-text-out", "output_type": "safetensors",
           "max_seq": None, "vae_tiling": False, "fewstep": False, "loras": []}
    for rep in range(a.reps):  # interleaved: each program once per round, the page cache warm for both
        d = diffusers_text_stage(a.ckpt, a.device, dtype)
        e2e.log("diffusers", rep, json.dumps(d))
        res[f"diffusers{rep}"] = d
        v, _ = e2e.run_vidgen(a.vidgen, a.ckpt, run, f"resident{rep}", e2e.RESIDENT, a.out)
        loads = [x for x in v.get("loads", []) if x["component"] == "text_encoder"]
        v["text_encoder_load_s"] = sum(x["seconds"] for x in loads)
        v["text_stage_s"] = v.get("stages", {}).get("encode_text", 0) + sum(
            x["seconds"] for x in loads if x["stage"] != "encode_text")
        e2e.log("vidgen", rep, json.dumps({k: v.get(k) for k in ("exit", "stages", "loads", "text_stage_s")}))
        res[f"vidgen{rep}"] = v
    json.dump(res, open(os.path.join(a.out, "minimax_text_stage.json"), "w"), indent=1, default=str)
    if not a.keep:
        shutil.rmtree(a.ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()
