#!/usr/bin/env python3
"""One video, end to end: diffusers' WanPipeline and vidgen on the same GPU, same checkpoint, same call.

A full-size Wan2.1 T2V checkpoint with random weights (the published configs from vidgen's assets/ folder) is
written once in the diffusers layout (transformer and text encoder bf16, VAE f32), to /dev/shm, so both programs
load it from the page cache. Then each program makes the same video (480x832x81, CFG 5, N UniPC steps) and the
wall time of each phase is recorded:

  diffusers: from_pretrained + .to(cuda)  |  encode_prompt  |  each denoise step  |  vae.decode  |  whole call
  vidgen:    the process's wall time and its --stats-json stages / forward_seconds

../shared/peer/wan_e2e_bench.py as vidgen runs it: REPS (env, default 2) sets diffusers' repetitions, each
vidgen run's whole stderr is kept in OUT/<label>.log, and diffusers runs first (then vidgen's default flags,
then everything resident), so every vidgen run follows another CUDA process.

Usage (GPU machine):  python3 wan_e2e_bench.py --assets DIR --vidgen BIN --out OUT [--steps 10] [--model 1.3b]
"""
import argparse, json, os, shutil, subprocess, sys, time

import torch

GiB = 1024 ** 3


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def init_(model, std=0.02, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            low = name.lower()
            if p.ndim == 1 and ("norm" in low or low.endswith("scale")) and "bias" not in low:
                p.fill_(1.0)
            elif p.ndim == 1 and "bias" in low:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32).to(p.dtype) * std)


def write_checkpoint(assets, dest):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel
    if os.path.exists(os.path.join(dest, "done")):
        return
    os.makedirs(dest, exist_ok=True)
    for sub in ("tokenizer", "scheduler"):
        shutil.copytree(os.path.join(assets, sub), os.path.join(dest, sub), dirs_exist_ok=True)
    shutil.copy(os.path.join(assets, "model_index.json"), dest)
    t0 = time.time()
    cfg = json.load(open(os.path.join(assets, "transformer", "config.json")))
    with torch.device("meta"):
        dit = WanTransformer3DModel.from_config(cfg)
    dit = dit.to_empty(device="cuda").to(torch.bfloat16)
    init_(dit, seed=1)
    dit.save_pretrained(os.path.join(dest, "transformer"), max_shard_size="10GB")
    del dit
    vcfg = json.load(open(os.path.join(assets, "vae", "config.json")))
    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(vcfg)
    vae = vae.to_empty(device="cuda").float()
    init_(vae, seed=2)
    vae.save_pretrained(os.path.join(dest, "vae"))
    del vae
    tcfg = UMT5Config.from_dict(json.load(open(os.path.join(assets, "text_encoder", "config.json"))))
    with torch.device("meta"):
        te = UMT5EncoderModel(tcfg)
    te = te.to_empty(device="cuda").to(torch.bfloat16)
    init_(te, seed=3)
    te.save_pretrained(os.path.join(dest, "text_encoder"), max_shard_size="5GB")
    del te
    torch.cuda.empty_cache()
    open(os.path.join(dest, "done"), "w").write("ok")
    log(f"checkpoint written to {dest} in {time.time() - t0:.1f} s")


def run_diffusers(ckpt, prompt, steps, label, cpu_offload=False):
    from diffusers import AutoencoderKLWan, WanPipeline
    r = {"label": label}
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    vae = AutoencoderKLWan.from_pretrained(ckpt, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(ckpt, vae=vae, torch_dtype=torch.bfloat16)
    if cpu_offload:
        pipe.enable_model_cpu_offload()
    else:
        pipe.to("cuda")
    sync()
    r["load_s"] = time.perf_counter() - t0
    times = {"encode": [], "decode": []}

    def wrap(obj, attr, key):
        f = getattr(obj, attr)

        def g(*a, **k):
            sync(); s = time.perf_counter()
            out = f(*a, **k)
            sync(); times[key].append(time.perf_counter() - s)
            return out
        setattr(obj, attr, g)

    wrap(pipe, "encode_prompt", "encode")
    wrap(pipe.vae, "decode", "decode")
    for rep in range(int(os.environ.get("REPS", "2"))):
        times["encode"].clear(); times["decode"].clear()
        stamps = []

        def cb(_p, i, t, kw):
            sync(); stamps.append(time.perf_counter())
            return {}
        torch.cuda.reset_peak_memory_stats()
        sync(); s = time.perf_counter()
        out = pipe(prompt=prompt, negative_prompt="", height=480, width=832, num_frames=81,
                   num_inference_steps=steps, guidance_scale=5.0, output_type="np",
                   generator=torch.Generator("cuda").manual_seed(1), callback_on_step_end=cb)
        sync(); total = time.perf_counter() - s
        frames = out.frames[0]
        steps_s = [b - a for a, b in zip(stamps, stamps[1:])]
        r[f"run{rep}"] = {
            "call_s": total, "encode_s": sum(times["encode"]), "decode_s": sum(times["decode"]),
            "step_s_median": sorted(steps_s)[len(steps_s) // 2] if steps_s else None,
            "denoise_s": (stamps[-1] - stamps[0]) * steps / max(1, steps - 1) if len(stamps) > 1 else None,
            "peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
            "frames_shape": list(frames.shape), "finite": bool(torch.isfinite(torch.as_tensor(frames)).all()),
        }
        log(label, rep, json.dumps(r[f"run{rep}"]))
    del pipe, vae
    torch.cuda.empty_cache()
    return r


def run_vidgen(binary, ckpt, prompt, steps, out, label, flags):
    os.makedirs(out, exist_ok=True)
    stats = os.path.join(out, f"stats-{label}.json")
    videos = os.environ.get("E2E_VIDEOS", "/tmp/e2e-videos")
    cmd = [binary, "generate", "--model", ckpt, "--prompt", prompt, "--negative-prompt", "",
           "--num-inference-steps", str(steps), "--seed", "1", "--device", "cuda", "--output-path", videos,
           "--output-video-name", label, "--output-type", "safetensors", "--overwrite", "--stats-json", stats] + flags
    s = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - s
    open(os.path.join(out, f"{label}.log"), "w").write(p.stderr)
    r = {"label": label, "flags": flags, "exit": p.returncode, "process_wall_s": wall,
         "stderr_tail": p.stderr[-3000:], "stdout": p.stdout.strip()}
    if os.path.exists(stats):
        st = json.load(open(stats))
        job = st["jobs"][0]
        fw = job.get("metrics", {}).get("forward_seconds", [])
        r.update({"stages": job.get("stages"), "forward_s_median": sorted(fw)[len(fw) // 2] if fw else None,
                  "n_forwards": len(fw), "wall_seconds": st.get("wall_seconds"),
                  "stage_memory": job.get("metrics", {}).get("stages"), "offload": job.get("metrics", {}).get("offload")})
    log(label, json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}))
    if p.returncode != 0:
        log(p.stderr[-2000:])
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True, help="vidgen's assets/wan2.1-t2v-<model> folder (configs, tokenizer)")
    ap.add_argument("--vidgen", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ckpt", default="/dev/shm/wan-e2e")
    ap.add_argument("--modes", default="", help="more vidgen modes: 'name=--flag --flag;name2=...'")
    ap.add_argument("--skip", default="", help="comma list: diffusers,offload,vidgen-default,vidgen-resident")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    os.makedirs(a.out, exist_ok=True)
    write_checkpoint(a.assets, a.ckpt)
    prompt = "a red fox runs through fresh snow at dawn, cinematic"
    res = {"steps": a.steps, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    OFF = ["--no-dit-layerwise-offload", "--no-dit-cpu-offload", "--no-text-encoder-cpu-offload", "--no-vae-cpu-offload"]
    if "diffusers" not in skip:
        res["diffusers_resident"] = run_diffusers(a.ckpt, prompt, a.steps, "diffusers-resident")
    if "vidgen-default" not in skip:
        res["vidgen_default"] = run_vidgen(a.vidgen, a.ckpt, prompt, a.steps, a.out, "vidgen-default", [])
    if "vidgen-resident" not in skip:
        res["vidgen_resident"] = run_vidgen(a.vidgen, a.ckpt, prompt, a.steps, a.out, "vidgen-resident", OFF)
    for spec in filter(None, a.modes.split(";")):
        name, _, flags = spec.partition("=")
        res["vidgen_" + name] = run_vidgen(a.vidgen, a.ckpt, prompt, a.steps, a.out, "vidgen-" + name, flags.split())
    if "offload" not in skip:
        res["diffusers_model_cpu_offload"] = run_diffusers(a.ckpt, prompt, a.steps, "diffusers-model-offload", True)
    json.dump(res, open(os.path.join(a.out, "e2e.json"), "w"), indent=1)
    log("wrote", os.path.join(a.out, "e2e.json"))


if __name__ == "__main__":
    main()
