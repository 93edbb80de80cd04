#!/usr/bin/env python3
"""One whole video (FLUX.1: one image) per family: vidgen beside diffusers 0.42.1, in one call on one GPU.

The family's full-size checkpoint is written once in the diffusers layout with random weights: every model
component is built from its published config in assets/<family>/ with the diffusers or transformers class that
model_index.json names, filled on the GPU with the scale vidgen's `synthetic:` weights use (matrices
U(+-sqrt(3/fan_in)), norm scales 1, other vectors U(+-0.05): activations stay O(1) through deep stacks, so no
run turns to NaN), and saved in bf16 (the VAE in the dtype the pipeline loads it: f32 for Wan); tokenizers and
scheduler are copied. Both programs then load it from the page cache and make the same thing: the pipeline's
default size, frames, guidance and text length, N steps (default 4), bf16, one prompt, seed 1 (vidgen draws what
`torch.Generator("cpu").manual_seed(1)` draws, so the frames are compared too).

  diffusers:  from_pretrained + .to(cuda) = load | encode_prompt | each step (callback_on_step_end) and each
              transformer forward | vae.decode | the whole call | max_memory_allocated / reserved | then,
              for issue 34's text-stage target, the pipeline loaded again with its text encoders only
              (the other model components None) + .to(cuda), which with encode_prompt is the text stage
  vidgen:     the process's wall time and max RSS (GNU time) | --stats-json stages, each component's load (its
              "loaded X in Ys" lines, taken out of the stage that paid them, and the stage's wait for the
              components loading beside it, `waited_for_loads_beside`, likewise) | forward_seconds | device peaks;
              with default flags (its plan chooses offloading) and everything resident

Usage (GPU machine; bench/family_e2e.sh runs several families in one device call):
  python3 bench/family_e2e.py --family NAME --vidgen BIN --out DIR [--steps 4] [--ckpt-root /dev/shm/vidgen-e2e]
  python3 bench/family_e2e.py --quick --family NAME --vidgen BIN --out DIR   # CPU smoke test, tiny fixture configs
  python3 bench/family_e2e.py --table DIR                                    # the markdown table of DIR/*.json
--quick writes its random checkpoint from tests/fixtures/<tiny>/'s configs and tokenizers (the same writer,
components sharded as the full-size ones are), on the CPU in f32, and runs both programs at the fixture's tiny
size with 2 steps: on the CPU in f32 the two programs' frames agree to about 1e-5, which checks that both made the
same thing. (`--quick --dtype bf16` runs diffusers' bf16 path too; vidgen's CPU backend has no bf16 convolution,
so only Wan, whose VAE runs in f32, decodes there.) `--quick --configs DIR` writes it from DIR's configs instead;
`--quick --published-layers N` from the published ones (assets/<family>) with N layers in each transformer stack and
one in each text encoder (three in Llama, whose third-from-last hidden state HunyuanVideo reads): every width of the
full-size model, on the CPU (session 42: every video family within 3e-5 of diffusers this way, FLUX.1 within its
PNG's uint8 rounding).
The ratio in the table is vidgen's whole process (start-up, CUDA context, loads, stages, writing the file) over
diffusers' from_pretrained + .to(cuda) + its call (its interpreter, imports and CUDA context are not counted).
"""
import argparse, functools, gc, importlib, json, os, re, shutil, subprocess, tempfile, time
from dataclasses import dataclass, field

import torch

GiB = 1024 ** 3
PROMPT = "a red fox runs through fresh snow at dawn, cinematic"
SEED = 1
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESIDENT = ["--dit-layerwise-offload=false", "--dit-cpu-offload=false",
            "--text-encoder-cpu-offload=false", "--vae-cpu-offload=false"]
FAST = ["--fp8-matmul", "--attention", "sage"]  # issue 36's opt-in kernels
VIDGEN_MODES = {"default": [], "resident": RESIDENT, "fast": FAST, "fast-resident": RESIDENT + FAST,
                "fp8": ["--fp8-matmul"], "fp8-resident": RESIDENT + ["--fp8-matmul"],
                "fast-mp4": FAST + ["--output-type", "mp4"], "fast-stream": FAST + ["--dit-layerwise-offload"],
                # Issue 36's step cache: every attention PAB reaches reused every other call, at every timestep.
                "pab": ["--cache", "pab:spatial_attention_block_skip_range=2,spatial_attention_timestep_skip_range=0;1000,"
                        "cross_attention_block_skip_range=2,cross_attention_timestep_skip_range=0;1000"],
                # Issue 34's first run: default flags with the driver's compile cache empty, as on a fresh machine
                # (a `default` run after it is the second run of the same command).
                "first": []}
# The step-distillation recipe (README "Few-step recipes"): Euler at shift 5 over these sigmas, CFG off.
FEWSTEP_SIGMAS = [1.0, 0.75, 0.5, 0.25]
FEWSTEP_SHIFT = 5.0


@dataclass(frozen=True)
class Family:
    """What differs between families: the rest is one code path."""
    fixture: str              # tiny checkpoint in tests/fixtures/ (--quick)
    size: tuple               # (frames, height, width): the pipeline's call defaults
    tiny: tuple               # (frames, height, width) for --quick
    guidance: float           # the pipeline's default guidance_scale
    max_seq: int | None       # its default max_sequence_length; None: not a parameter (Latte: 120 tokens)
    frames_kwarg: str | None = "num_frames"   # diffusers' name for the frame count; None: an image model
    vae_dtype: torch.dtype | None = None      # where the pipeline's usage loads the VAE in another dtype
    call: dict = field(default_factory=dict)  # more diffusers call kwargs
    prepare: object = None    # set-up of the loaded diffusers pipeline, returning call kwargs computed from it
    published_tiny: tuple | None = None  # --published-layers' size where the published config refuses `tiny`


def hunyuan_template(pipe):
    """diffusers' prompt template with its crop counted by the checkpoint's tokenizer, as vidgen counts it:
    95 for the published Llama-3 tokenizer (the value diffusers hard-codes), 219 for the stand-in tokenizer
    shipped in assets/; with 95 diffusers would feed template tokens to the DiT."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    template = DEFAULT_PROMPT_TEMPLATE["template"]
    crop_start = len(pipe.tokenizer(template.split("{}")[0]).input_ids)
    return {"prompt_template": {"template": template, "crop_start": crop_start}}


def ltx_noise_on_cpu(pipe):
    """LTX-Video's decoder adds `torch.randn` noise from the global generator of the VAE's device: on a GPU that
    is CUDA's Philox stream (its values depend on the launch), which no other program reproduces. diffusers then
    draws it as on the CPU, where vidgen draws it on every device: f32 from the CPU's global generator, cast and
    moved (the call's `torch.manual_seed` seeds both)."""
    from diffusers.models.autoencoders import autoencoder_kl_ltx

    class CpuRandn:  # the module's `torch`, whose randn draws on the CPU
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def randn(*shape, generator=None, device=None, dtype=None):
            return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)
    autoencoder_kl_ltx.torch = CpuRandn()
    return {}


def allegro_tiles(pipe):
    """Allegro's VAE decodes in tiles only: diffusers raises without enable_tiling(), vidgen always tiles."""
    pipe.vae.enable_tiling()
    return {}


# clean_caption=False: the lower-cased, stripped prompt vidgen encodes, without depending on beautifulsoup4.
FAMILIES = {
    "ltx-video": Family("ltx-video-tiny-a", (161, 512, 704), (9, 64, 64), 3.0, 128, prepare=ltx_noise_on_cpu),
    "cogvideox-5b": Family("cogvideox-tiny-a", (49, 480, 720), (17, 32, 48), 6.0, 226),
    "hunyuanvideo": Family("hunyuanvideo-tiny-a", (129, 720, 1280), (17, 32, 48), 6.0, 256,
                           prepare=hunyuan_template),
    "mochi-1": Family("mochi-tiny-a", (19, 480, 848), (13, 32, 48), 4.5, 256),
    "allegro": Family("allegro-tiny-a", (88, 720, 1280), (24, 64, 64), 7.5, 512, call={"clean_caption": False},
                      prepare=allegro_tiles, published_tiny=(24, 320, 320)),  # whole VAE tiles
    "latte-1": Family("latte-tiny-a", (16, 512, 512), (5, 32, 48), 7.5, None, frames_kwarg="video_length",
                      call={"clean_caption": False}, published_tiny=(16, 32, 48)),  # its 16-frame position table
    "flux.1-dev": Family("flux-tiny-a", (1, 1024, 1024), (1, 48, 64), 3.5, 512, frames_kwarg=None),
    "wan2.1-t2v-1.3b": Family("wan-tiny-a", (81, 480, 832), (9, 32, 32), 5.0, 512, vae_dtype=torch.float32),
    "wan2.1-t2v-14b": Family("wan-tiny-a", (81, 480, 832), (9, 32, 32), 5.0, 512, vae_dtype=torch.float32),
    # Its model card's size, vidgen's default (WanPipeline's call defaults are Wan2.1's 81x480x832).
    "wan2.2-ti2v-5b": Family("wan22-ti2v-tiny-a", (121, 704, 1280), (5, 64, 64), 5.0, 512, vae_dtype=torch.float32),
    "wan2.2-t2v-a14b": Family("wan22-a14b-tiny-a", (81, 480, 832), (9, 32, 32), 5.0, 512, vae_dtype=torch.float32),
}
QUICK_MAX_SEQ = 16
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}  # vidgen's --dtype names


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- checkpoint

def component_class(spec):
    """The class model_index.json names for a component ([library, class]), or None for an empty slot."""
    if not isinstance(spec, list) or len(spec) != 2 or spec[0] is None:
        return None
    return getattr(importlib.import_module(spec[0]), spec[1])


def build(cls, folder, device):
    """The component from its config, constructed on `device` (so buffers such as a VAE's latents_mean
    are computed, not left uninitialized as on the meta device)."""
    with torch.device(device):
        if hasattr(cls, "load_config"):  # diffusers
            return cls.from_config(cls.load_config(folder))
        return cls(cls.config_class.from_pretrained(folder))


def fill_(model, seed, device):
    """vidgen's synthetic scale (src/weights/mod.rs SyntheticWeights): matrices U(+-sqrt(3/fan_in)), norm
    scales 1, every other vector and the token tables U(+-0.05)."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if (p.ndim == 1 and "norm" in name and leaf != "bias") or leaf == "gamma":
                p.fill_(1.0)
                continue
            table = "embed_tokens" in name or name.startswith("shared")
            amplitude = (3.0 / max(1, p[0].numel())) ** 0.5 if p.ndim >= 2 and not table else 0.05
            u = torch.rand(p.shape, generator=g, device=device, dtype=torch.float32)
            p.copy_((u * 2 - 1) * amplitude)


def cut_layers(src, dest, layers):
    """`src`'s configs and tokenizers copied to `dest` with `layers` layers in each transformer stack and one in
    each text encoder (three in Llama); returns `dest`."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    for component in sorted(os.listdir(dest)):
        path = os.path.join(dest, component, "config.json")
        if not os.path.exists(path):
            continue
        cfg = json.load(open(path))
        text = component.startswith("text_encoder")
        for key in ("num_layers", "num_single_layers", "num_decoder_layers", "num_hidden_layers"):
            if isinstance(cfg.get(key), int):
                cfg[key] = (3 if cfg.get("model_type") == "llama" else 1) if text else layers
        json.dump(cfg, open(path, "w"), indent=1)
    return dest


def write_checkpoint(src, dest, dtype, vae_dtype, device, shard_size):
    """The checkpoint of `src`'s configs with random weights, in the diffusers layout, unless `dest` holds one;
    components above `shard_size` are sharded with an index, as the published checkpoints are."""
    if os.path.exists(os.path.join(dest, "done")):
        log(f"checkpoint {dest} exists: reused")
        return {"reused": True}
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    t0 = time.perf_counter()
    index = json.load(open(os.path.join(src, "model_index.json")))
    shutil.copy(os.path.join(src, "model_index.json"), dest)
    written = {}
    try:
        for seed, (name, spec) in enumerate(sorted(index.items()), start=1):
            cls = component_class(spec)
            if cls is None:
                continue
            folder = os.path.join(src, name)
            if not issubclass(cls, torch.nn.Module):  # tokenizers, schedulers: copied as published
                shutil.copytree(folder, os.path.join(dest, name))
                continue
            model = build(cls, folder, device)
            fill_(model, seed, device)
            model = model.to(vae_dtype if name == "vae" and vae_dtype else dtype)
            size = sum(p.numel() * p.element_size() for p in model.parameters())
            free = shutil.disk_usage(dest).free
            if size > free:
                raise SystemExit(f"{name}: {size / GiB:.1f} GiB does not fit in {dest} "
                                 f"({free / GiB:.1f} GiB free): pass another --ckpt-root")
            model.save_pretrained(os.path.join(dest, name), max_shard_size=shard_size)
            written[name] = {"class": spec[1], "gib": size / GiB, "dtype": str(model.dtype)}
            del model
            free_memory()
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    open(os.path.join(dest, "done"), "w").write("ok")
    os.sync()  # the runs below read it back from the page cache, not beside its write-back to a disk
    seconds = time.perf_counter() - t0
    log(f"checkpoint written to {dest} in {seconds:.1f} s: " + ", ".join(
        f"{k} {v['class']} {v['gib']:.2f} GiB" for k, v in written.items()))
    return {"reused": False, "seconds": seconds, "components": written}


# ------------------------------------------------------------------------------------------------ programs

def reset_peak_rss():
    """Sets this process's peak RSS (VmHWM) to its current RSS (Linux's clear_refs 5)."""
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass


def peak_rss_gib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GiB
    return None


def timed(fn, record):
    """`fn`, appending the (start, end) of each call, the device idle at both ends; `fn`'s signature kept (a
    caller may read it, as MiniMax H3's denoise step does to pick the keyword arguments it passes)."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        sync()
        start = time.perf_counter()
        out = fn(*a, **k)
        sync()
        record.append((start, time.perf_counter()))
        return out
    return wrapper


def median(xs):
    return sorted(xs)[len(xs) // 2] if xs else None


def fewstep_scheduler(pipe):
    """The few-step recipe in diffusers: FlowMatchEulerDiscreteScheduler(shift=5) stepping over the recipe's
    sigmas (WanPipeline asks its scheduler for num_inference_steps only)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    scheduler = FlowMatchEulerDiscreteScheduler(shift=FEWSTEP_SHIFT)
    plain = scheduler.set_timesteps
    scheduler.set_timesteps = lambda n=None, device=None, **k: plain(sigmas=FEWSTEP_SIGMAS, device=device)
    pipe.scheduler = scheduler


def run_diffusers(fam, ckpt, run, reps):
    """Loads the pipeline resident on the device and makes the video `reps` times; returns the timings and
    the first run's frames [F, H, W, 3] in [0, 1]. A failure (out of memory, a refusal) is recorded, not raised,
    so that vidgen still runs."""
    import diffusers
    cuda = run["device"] == "cuda"
    cls = getattr(diffusers, json.load(open(os.path.join(ckpt, "model_index.json")))["_class_name"])
    r, first, pipe = {"pipeline": cls.__name__}, None, None
    frames, height, width = run["size"]
    kwargs = {"prompt": PROMPT, "height": height, "width": width, "num_inference_steps": run["steps"],
              "guidance_scale": run["guidance"], "output_type": "np", **fam.call}
    if fam.frames_kwarg:
        kwargs[fam.frames_kwarg] = frames
    if run["max_seq"] is not None:
        kwargs["max_sequence_length"] = run["max_seq"]
    spans = {"encode": [], "forward": [], "decode": []}
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        pipe = cls.from_pretrained(ckpt, torch_dtype={"default": run["dtype"], "vae": run["vae_dtype"] or run["dtype"]})
        if run["vae_tiling"]:
            pipe.vae.enable_tiling()
        pipe.to(run["device"])
        sync()
        r["load_s"] = time.perf_counter() - t0
        if cuda:
            r["model_gib"] = torch.cuda.memory_allocated() / GiB
        pipe.set_progress_bar_config(disable=True)
        pipe.encode_prompt = timed(pipe.encode_prompt, spans["encode"])
        pipe.transformer.forward = timed(pipe.transformer.forward, spans["forward"])
        pipe.vae.decode = timed(pipe.vae.decode, spans["decode"])
        if fam.prepare:
            kwargs.update(fam.prepare(pipe))
        if run["fewstep"]:
            fewstep_scheduler(pipe)
        r["call_kwargs"] = dict(kwargs)
        for rep in range(reps):
            for v in spans.values():
                v.clear()
            stamps = []

            def on_step_end(_pipe, _i, _t, _kw):
                sync()
                stamps.append(time.perf_counter())
                return {}
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(SEED)  # LTX-Video's decoder noise comes from the global generator
            sync()
            start = time.perf_counter()
            out = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(SEED), callback_on_step_end=on_step_end)
            sync()
            end = time.perf_counter()
            images = out.frames[0] if hasattr(out, "frames") else out.images
            encode_end = spans["encode"][-1][1] if spans["encode"] else start
            fw = [b - a for a, b in spans["forward"]]
            step_ends = [encode_end] + stamps
            r[f"run{rep}"] = {
                "call_s": end - start,
                "encode_s": sum(b - a for a, b in spans["encode"]),
                "denoise_s": stamps[-1] - encode_end if stamps else None,
                "step_s": [b - a for a, b in zip(step_ends, step_ends[1:])],
                "forward_s_median": median(fw), "n_forwards": len(fw),
                "decode_s": sum(b - a for a, b in spans["decode"]),
                "after_decode_s": end - spans["decode"][-1][1] if spans["decode"] else None,
                "peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB if cuda else None,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB if cuda else None,
                "frames_shape": list(images.shape),
                "finite": bool(torch.isfinite(torch.as_tensor(images)).all()),
            }
            log("diffusers", rep, json.dumps({k: v for k, v in r[f"run{rep}"].items() if k != "step_s"}))
            if first is None:
                first = images
            del out, images
    except Exception as e:  # out of memory or a refusal: recorded, and vidgen still runs
        r["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        log("diffusers failed:", r["error"])
    del pipe
    free_memory()
    return r, first


def time_text_load(ckpt, run):
    """Seconds diffusers takes to load the pipeline with its text encoders alone (tokenizers and
    scheduler too; every other model component None) from the page cache and move it to the device:
    the load a text stage pays. A failure is recorded, not raised."""
    import diffusers
    index = json.load(open(os.path.join(ckpt, "model_index.json")))
    cls = getattr(diffusers, index["_class_name"])
    others = {name: None for name, spec in index.items()
              if isinstance(spec, list) and not name.startswith(("text_encoder", "tokenizer", "scheduler"))}
    pipe = None
    try:
        sync()
        t0 = time.perf_counter()
        pipe = cls.from_pretrained(ckpt, torch_dtype=run["dtype"], **others)
        pipe.to(run["device"])
        sync()
        return {"text_load_s": time.perf_counter() - t0}
    except Exception as e:
        return {"text_load_error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
    finally:
        del pipe
        free_memory()


STAGE_LINE = re.compile(r"^\[\d+/\d+\] (\w+)$")
LOADED_LINE = re.compile(r"^loaded (\S+) in ([\d.]+)s")


def loads_by_stage(stderr):
    """Each component's load time and the stage it was paid in, from vidgen's progress lines."""
    stage, loads = "startup", []
    for line in stderr.splitlines():
        if m := STAGE_LINE.match(line):
            stage = m.group(1)
        elif m := LOADED_LINE.match(line):
            loads.append({"component": m.group(1), "seconds": float(m.group(2)), "stage": stage})
    return loads


def run_vidgen(binary, ckpt, run, label, flags, out):
    """One vidgen process making the video; returns its timings and the path of its output."""
    frames, height, width = run["size"]
    stats = os.path.join(out, f"{run['family']}-{label}.stats.json")
    logfile = os.path.join(out, f"{run['family']}-{label}.log")
    name = f"{run['family']}-{label}"
    cmd = [binary, "generate", "--model", ckpt, "--prompt", PROMPT, "--seed", str(SEED),
           "--num-inference-steps", str(run["steps"]), "--height", str(height), "--width", str(width),
           "--num-frames", str(frames), "--device", run["device"], "--dtype", run["vidgen_dtype"], "--output-path", run["videos"],
           "--output-video-name", name, "--output-type", run["output_type"], "--overwrite", "--stats-json", stats]
    if run["guidance"] is not None:  # None: a guidance-distilled pipeline, which refuses the flag
        cmd += ["--guidance-scale", str(run["guidance"])]
    if run["max_seq"] is not None:
        cmd += ["--max-sequence-length", str(run["max_seq"])]
    if run["vae_tiling"]:
        cmd += ["--vae-tiling"]
    if run["fewstep"]:
        cmd += ["--scheduler", "euler", "--flow-shift", str(FEWSTEP_SHIFT),
                "--sigmas", ",".join(map(str, FEWSTEP_SIGMAS))]
    for lora in run["loras"]:
        cmd += ["--lora", lora]
    if "--output-type" in flags:  # the mode's own output type (mp4: what a user writes; not compared)
        at = cmd.index("--output-type")
        del cmd[at:at + 2]
    cmd += flags
    if os.path.exists(stats):
        os.remove(stats)
    # GNU time measures the maximum RSS from outside (a child of this process would inherit its RSS from
    # the fork); without it the stats' VmHWM stands in.
    rss_file = logfile + ".time"
    timer = ["/usr/bin/time", "-v", "-o", rss_file] if os.path.exists("/usr/bin/time") else []
    start = time.perf_counter()
    # Each stderr line is kept as written and, in <label>.stamped.log, after the seconds since start.
    with open(logfile, "w") as err, open(logfile[:-4] + ".stamped.log", "w") as stamped:
        # Removed once the process ends, as a fresh machine's would never have been.
        cache = tempfile.TemporaryDirectory(prefix="vidgen-cuda-cache-") if label == "first" else None
        env = dict(os.environ, CUDA_CACHE_PATH=cache.name) if cache else None
        p = subprocess.Popen(timer + cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for line in p.stderr:
            err.write(line)
            stamped.write(f"{time.perf_counter() - start:8.3f} {line}")
        stdout = p.stdout.read()
        p.wait()
        if cache:
            cache.cleanup()
    wall = time.perf_counter() - start
    stamped_end = f"{wall:8.3f} (exit {p.returncode})\n"
    open(logfile[:-4] + ".stamped.log", "a").write(stamped_end)
    stderr = open(logfile).read()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(rss_file).read()) if timer else None
    r = {"label": label, "flags": flags, "cmd": cmd, "exit": p.returncode, "process_wall_s": wall,
         "max_rss_gib": int(rss.group(1)) * 1024 / GiB if rss else None, "stdout": stdout.strip()}
    if p.returncode != 0:
        r["stderr_tail"] = stderr[-3000:]
    if os.path.exists(stats):
        st = json.load(open(stats))
        job = st["jobs"][0] if st.get("jobs") else {}
        metrics = job.get("metrics", {})
        memory = metrics.get("stages", {}).values()
        fw = metrics.get("forward_seconds", [])
        r.update({
            "status": st.get("status"), "error": st.get("error") or job.get("error"),
            "wall_seconds": st.get("wall_seconds"),
            "stages": {s["name"]: s["seconds"] for s in job.get("stages", [])},
            "loads": loads_by_stage(stderr),
            # What a stage waited, after its own work, for the components loading beside it.
            "waited_for_loads_beside": metrics.get("waited_for_loads_beside", {}),
            "forward_s_median": median(fw), "n_forwards": len(fw),
            "device_used_peak_gib": max((m.get("device_used_peak", 0) for m in memory), default=0) / GiB,
            "device_reserved_peak_gib": max((m.get("device_reserved_peak", 0) for m in memory), default=0) / GiB,
            "host_rss_peak_gib": max((m.get("host_rss_peak", 0) for m in memory), default=0) / GiB,
            "offload": {k: v for k, v in metrics.items() if k.startswith("offload")},
            "load_policy": st.get("load_policy"), "overrides": st.get("overrides"),
        })
        r["max_rss_gib"] = r["max_rss_gib"] or r["host_rss_peak_gib"]
    if p.returncode != 0 and not r.get("error"):  # bad input (exit 2) writes no stats: its one line says why
        r["error"] = (stderr.strip().splitlines() or [""])[-1]
    log("vidgen", label, json.dumps({k: v for k, v in r.items() if k not in ("cmd", "stderr_tail", "load_policy", "overrides")}))
    if p.returncode != 0:
        log(stderr[-2000:])
    return r, (stdout.strip().splitlines() or [None])[-1]


def vidgen_defaults(binary, ckpt, device):
    """vidgen's resolved call defaults for this checkpoint (a dry run: nothing loads)."""
    p = subprocess.run([binary, "generate", "--model", ckpt, "--prompt", PROMPT, "--device", device,
                        "--dry-run", "--json"], capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": p.stderr.strip()[-1000:]}
    c = json.loads(p.stdout)["config"]
    return {k: c.get(k) for k in ("num_frames", "height", "width", "num_inference_steps", "guidance_scale",
                                  "max_sequence_length", "fps", "scheduler", "vae_tiling")}


def read_frames(path):
    """A vidgen output as float32 [F, H, W, 3] in [0, 1]: safetensors `frames`, or one PNG (an image)."""
    import numpy as np
    if path.endswith(".png"):
        from PIL import Image
        return np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)[None] / 255.0
    from safetensors.numpy import load_file
    return load_file(path)["frames"]


def compare(path, reference):
    """max and mean |vidgen - diffusers| over the frames, or why they could not be compared."""
    import numpy as np
    if reference is None:
        return {"error": "no diffusers frames"}
    if not path or not os.path.exists(path):
        return {"error": "no vidgen output"}
    mine = read_frames(path)
    ref = np.asarray(reference, dtype=np.float32)
    if mine.shape != ref.shape:
        return {"error": f"shapes differ: vidgen {list(mine.shape)}, diffusers {list(ref.shape)}"}
    d = np.abs(mine - ref)
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}


# --------------------------------------------------------------------------------------------------- table

HEADER = ("| family | program | load s | encode s | denoise s (s/forward) | decode s | write s | whole s "
          "| x diffusers | device peak GiB used / reserved | max RSS GiB | frames vs diffusers, max / mean abs |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def fmt(x, digits=2):
    return "—" if x is None else f"{x:.{digits}f}"


def cell(text):
    """A message's first line as one table cell (vidgen's errors may carry a backtrace)."""
    return (text.strip().splitlines() or [""])[0].replace("|", "/")[:160]


def rows(res):
    """One markdown row per program: diffusers (load + first call) and each vidgen mode (its process)."""
    out = []
    d = res.get("diffusers", {})
    d0 = d.get("run0", {})
    base = d["load_s"] + d0["call_s"] if "call_s" in d0 else None
    run = res.get("run", {})
    fam = (res["family"] + (" (quick)" if res.get("quick") else "") + (" 4-step" if run.get("fewstep") else "")
           + (" + LoRA" if run.get("loras") else ""))
    if d:
        whole = fmt(base) if base else cell(d.get("error", "failed"))
        out.append(f"| {fam} | diffusers {res['versions']['diffusers']} | {fmt(d.get('load_s'))} "
                   f"| {fmt(d0.get('encode_s'))} | {fmt(d0.get('denoise_s'))} ({fmt(d0.get('forward_s_median'), 3)}) "
                   f"| {fmt(d0.get('decode_s'))} | — | {whole} | {1 if base else '—'} "
                   f"| {fmt(d0.get('peak_alloc_gib'))} / {fmt(d0.get('peak_reserved_gib'))} | {fmt(res.get('diffusers_max_rss_gib'))} | — |")
    for label, v in res.get("vidgen", {}).items():
        stages = v.get("stages") or {}
        paid = {}
        for load in v.get("loads", []):
            paid[load["stage"]] = paid.get(load["stage"], 0.0) + load["seconds"]
        for stage, waited in v.get("waited_for_loads_beside", {}).items():
            paid[stage] = paid.get(stage, 0.0) + waited
        net = {k: s - paid.get(k, 0.0) for k, s in stages.items()}
        part = {"encode": 0.0, "denoise": 0.0, "decode": 0.0, "write": 0.0}
        for k, s in net.items():  # denoise holds every stage that is not encoding, decoding or writing
            part["encode" if k.startswith("encode") else "decode" if k.startswith("decode")
                 else "write" if k == "write" else "denoise"] += s
        ok = v.get("exit") == 0
        whole = fmt(v["process_wall_s"]) if ok else cell(f"exit {v.get('exit')}: {v.get('error') or ''}")
        cmp = v.get("frames_vs_diffusers", {})
        diff = cell(cmp["error"]) if "error" in cmp else f"{cmp['max_abs']:.3g} / {cmp['mean_abs']:.3g}"
        out.append(f"| {fam} | vidgen {label} | {fmt(sum(paid.values()))} | {fmt(part['encode'])} "
                   f"| {fmt(part['denoise'])} ({fmt(v.get('forward_s_median'), 3)}) | {fmt(part['decode'])} "
                   f"| {fmt(part['write'])} | {whole} | {fmt(v['process_wall_s'] / base, 3) if ok and base else '—'} "
                   f"| {fmt(v.get('device_used_peak_gib'))} / {fmt(v.get('device_reserved_peak_gib'))} "
                   f"| {fmt(v.get('max_rss_gib'))} | {diff} |")
    return out


TEXT_HEADER = ("| family | diffusers text-encoder load s | encode_prompt s | diffusers text stage s "
               "| vidgen encode_text stage s, less its wait for loads beside it (mode) | x diffusers |\n|---|---|---|---|---|---|")


def text_rows(res):
    """Issue 34's text-stage target, one row per vidgen mode: vidgen's encode_text stage (its text encoders'
    loads included, its wait for the other components loading beside it not) against diffusers' text-encoder
    load + its call's encode_prompt."""
    d = res.get("diffusers", {})
    load, encode = d.get("text_load_s"), d.get("run0", {}).get("encode_s")
    base = load + encode if load is not None and encode is not None else None
    out = []
    for label, v in res.get("vidgen", {}).items():
        stage = (v.get("stages") or {}).get("encode_text")
        if stage is not None:
            stage -= v.get("waited_for_loads_beside", {}).get("encode_text", 0.0)
        ratio = fmt(stage / base, 3) if stage is not None and base else "—"
        out.append(f"| {res['family']} | {fmt(load) if load is not None else cell(d.get('text_load_error', '—'))} "
                   f"| {fmt(encode)} | {fmt(base)} | {fmt(stage)} ({label}) | {ratio} |")
    return out


def print_table(folder):
    results = [json.load(open(os.path.join(folder, name))) for name in sorted(os.listdir(folder))
               if name.endswith(".json") and not name.endswith(".stats.json")]
    results = [res for res in results if "family" in res]
    print(HEADER)
    for row in (row for res in results for row in rows(res)):
        print(row)
    print()
    print(TEXT_HEADER)
    for row in (row for res in results for row in text_rows(res)):
        print(row)


# ---------------------------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES))
    ap.add_argument("--vidgen", help="the vidgen binary")
    ap.add_argument("--out", help="folder for <family>.json, vidgen's logs and stats")
    ap.add_argument("--steps", type=int, help="denoising steps (default 4; --quick 2)")
    ap.add_argument("--ckpt-root", help="where checkpoints are written (default /dev/shm/vidgen-e2e; --quick "
                                        "/tmp/vidgen-e2e-quick); <root>/<family> is reused when complete")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny fixture configs, f32, tiny size")
    ap.add_argument("--configs", help="with --quick: the configs and tokenizers to write the checkpoint from, in "
                                      "place of the tiny fixture's (e.g. the published ones with fewer layers)")
    ap.add_argument("--published-layers", type=int, metavar="N", help="with --quick: the published configs with N "
                    "transformer layers per stack and one text-encoder layer (see above)")
    ap.add_argument("--size", help="F,H,W in place of the family's (its call defaults; --quick: the tiny size)")
    ap.add_argument("--max-seq", type=int, help="the text length in place of the family's (--quick: 16)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="run dtype (default bf16; --quick f32)")
    ap.add_argument("--reps", type=int, default=1, help="diffusers calls after one load (the first is reported)")
    ap.add_argument("--vidgen-modes", default="default,resident", help=f"of {sorted(VIDGEN_MODES)}")
    ap.add_argument("--vae-tiling", action="store_true", help="both programs decode in spatial tiles")
    ap.add_argument("--fewstep", action="store_true", help="the Wan step-distillation recipe in both programs: "
                    f"Euler at shift {FEWSTEP_SHIFT} over sigmas {FEWSTEP_SIGMAS}, guidance 1 (steps: their count)")
    ap.add_argument("--lora", action="append", default=[], help="a LoRA file merged by vidgen (repeatable); "
                    "diffusers then does not run (its PEFT loading is another measurement)")
    ap.add_argument("--skip-diffusers", action="store_true", help="vidgen's runs only")
    ap.add_argument("--diffusers-frames", metavar="NPY", help="diffusers' frames are saved here (float16) or, where "
                    "the file exists, compared with it (e.g. its bf16 run against its f32 one: what rounding alone "
                    "moves)")
    ap.add_argument("--videos", default="/tmp/vidgen-e2e-videos", help="vidgen's outputs (removed once compared)")
    ap.add_argument("--table", metavar="DIR", help="print the markdown table of DIR's results and exit")
    a = ap.parse_args()
    if a.table:
        print_table(a.table)
        return
    if not (a.family and a.vidgen and a.out):
        ap.error("--family, --vidgen and --out are needed")
    modes = [m for m in a.vidgen_modes.split(",") if m]
    if unknown := set(modes) - set(VIDGEN_MODES):
        ap.error(f"unknown --vidgen-modes {sorted(unknown)}: use {sorted(VIDGEN_MODES)}")
    fam = FAMILIES[a.family]
    if not a.quick and not torch.cuda.is_available():
        ap.error("no CUDA device: the benchmark needs one (--quick runs on the CPU)")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.videos, exist_ok=True)
    import diffusers, transformers
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    dtype = a.dtype or ("f32" if a.quick else "bf16")
    run = {
        "family": a.family, "steps": len(FEWSTEP_SIGMAS) if a.fewstep else a.steps or (2 if a.quick else 4),
        "guidance": 1.0 if a.fewstep else fam.guidance, "fewstep": a.fewstep, "loras": a.lora,
        "device": "cpu" if a.quick else "cuda", "dtype": DTYPES[dtype], "vidgen_dtype": dtype,
        "vae_dtype": fam.vae_dtype if dtype != "f32" else None,
        "size": tuple(map(int, a.size.split(","))) if a.size else fam.size if not a.quick
        else fam.published_tiny or fam.tiny if a.published_layers else fam.tiny,
        "max_seq": None if fam.max_seq is None else a.max_seq or (QUICK_MAX_SEQ if a.quick else fam.max_seq),
        "output_type": "png" if fam.frames_kwarg is None else "safetensors",
        "vae_tiling": a.vae_tiling, "videos": a.videos,
    }
    vidgen_version = subprocess.run([a.vidgen, "--version"], capture_output=True, text=True).stdout.strip()
    res = {"family": a.family, "quick": a.quick, "prompt": PROMPT, "seed": SEED,
           "run": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in run.items()},
           "versions": {"vidgen": vidgen_version, "diffusers": diffusers.__version__,
                        "transformers": transformers.__version__, "torch": torch.__version__},
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if (a.configs or a.published_layers) and not a.quick:
        ap.error("--configs and --published-layers go with --quick")
    if a.published_layers:
        a.configs = cut_layers(os.path.join(ROOT, "assets", a.family), os.path.join(a.out, "configs"),
                               a.published_layers)
    src = (a.configs or os.path.join(ROOT, "tests", "fixtures", fam.fixture)) if a.quick \
        else os.path.join(ROOT, "assets", a.family)
    root = a.ckpt_root or ("/tmp/vidgen-e2e-quick" if a.quick else "/dev/shm/vidgen-e2e")
    made_from = f"-published{a.published_layers}" if a.published_layers else "-configs" if a.configs else ""
    ckpt = os.path.join(root, a.family + ("-tiny" + made_from if a.quick else "")
                        + ("" if dtype == "bf16" else "-" + dtype))
    res["checkpoint"] = {"path": ckpt, "from": os.path.relpath(src, ROOT),
                         **write_checkpoint(src, ckpt, run["dtype"], run["vae_dtype"], run["device"],
                                            shard_size="100KB" if a.quick else "10GB")}

    defaults = vidgen_defaults(a.vidgen, ckpt, run["device"])
    frames, height, width = fam.size
    published = {"num_frames": frames, "height": height, "width": width, "guidance_scale": fam.guidance}
    if fam.max_seq is not None:
        published["max_sequence_length"] = fam.max_seq
    res["vidgen_defaults"] = defaults
    if not a.quick:  # the tiny fixtures' configs give other defaults
        res["vidgen_defaults_differ"] = {k: {"vidgen": defaults.get(k), "diffusers": v}
                                         for k, v in published.items() if defaults.get(k) != v}
        if res["vidgen_defaults_differ"]:
            log("vidgen's defaults differ from the pipeline's:", res["vidgen_defaults_differ"])

    result_name = a.family + ("-fewstep" if a.fewstep else "") + ("-lora" if a.lora else "")

    def save():  # after each program, so a call cut short keeps what ran
        json.dump(res, open(os.path.join(a.out, f"{result_name}.json"), "w"), indent=1)
    save()
    reset_peak_rss()  # the writer's peak is not diffusers'
    reference = None
    if not (a.lora or a.skip_diffusers):
        res["diffusers"], reference = run_diffusers(fam, ckpt, run, a.reps)
        if a.diffusers_frames and reference is not None:
            import numpy as np
            if os.path.exists(a.diffusers_frames):
                d = np.abs(np.asarray(reference, dtype=np.float32) - np.load(a.diffusers_frames).astype(np.float32))
                res["diffusers"]["frames_vs_saved"] = {"max_abs": float(d.max()), "mean_abs": float(d.mean())}
                log("diffusers frames vs", a.diffusers_frames, res["diffusers"]["frames_vs_saved"])
            else:
                np.save(a.diffusers_frames, np.asarray(reference, dtype=np.float16))
        res["diffusers_max_rss_gib"] = peak_rss_gib()
        res["diffusers"].update(time_text_load(ckpt, run))
    res["vidgen"] = {}
    save()
    for label in modes:
        v, path = run_vidgen(a.vidgen, ckpt, run, label, VIDGEN_MODES[label], a.out)
        v["frames_vs_diffusers"] = compare(path, reference)
        log("vidgen", label, "frames vs diffusers:", v["frames_vs_diffusers"])
        if path and os.path.exists(path):
            os.remove(path)
        res["vidgen"][label] = v
        save()
    print(HEADER)
    print("\n".join(rows(res)), flush=True)
    print()
    print(TEXT_HEADER)
    print("\n".join(text_rows(res)), flush=True)


if __name__ == "__main__":
    main()
