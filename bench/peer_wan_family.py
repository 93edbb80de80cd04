#!/usr/bin/env python3
"""diffusers 0.42.1's side of bench/wan_family.sh (issue 13's targets): the Wan family's pipelines built from
the same published configs as vidgen's `synthetic:` models (assets/<model>/, random weights N(0, 0.02), norm
weights 1 / biases 0, made on the device), run the way the targets say, timed with CUDA events:

  a14b  WanPipeline, Wan2.2 T2V-A14B, both experts resident (transformer + transformer_2, boundary_ratio from
        model_index.json), 480x832x81, CFG 5, --steps (default 4: two steps per expert), output_type="latent"
  ti2v  WanPipeline, Wan2.2 TI2V-5B (expand_timesteps) at its published 704x1280x121, the transformer under
        enable_group_offload(block_level, num_blocks_per_group=1, use_stream=True), the text encoder moved
        to the CPU once the prompt is encoded (as vidgen's default parks it), output_type="latent"
  i2v   WanImageToVideoPipeline, Wan2.1 I2V 14B 480P, everything resident, 480x832x81, the whole video
        (output_type="np"): CLIP image encoder, VAE encode of the condition video, denoise, VAE decode

Per model: each transformer forward (CUDA events, and which expert ran it), each step (host clock after a
device sync, from the step callback), the time and device peak of each phase (encode_text, encode_image,
vae_encode, denoise, decode; peaks are absolute: torch's max_memory_allocated / _reserved with the peak reset as
the phase starts), the model memory before the denoise, setup (building, moving, enabling offload) and the whole
call. JSON in OUT/results.json, rewritten after each model.

  python3 bench/peer_wan_family.py --out OUT [--models a14b,ti2v,i2v] [--image PNG]     # GPU
  python3 bench/peer_wan_family.py --quick --out /tmp/q                                 # CPU, tiny fixtures
  python3 bench/peer_wan_family.py --write-image PNG                                    # the I2V input only
"""

import argparse
import gc
import json
import os
import time

import torch

GiB = 1024**3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.perf_counter()
PROMPT = "a red fox runs through fresh snow at dawn, cinematic"

# name: (assets folder, fixture for --quick, (frames, height, width), quick size, steps)
MODELS = {
    "a14b": ("wan2.2-t2v-a14b", "wan22-a14b-tiny-a", (81, 480, 832), (9, 32, 32), 4),
    "ti2v": ("wan2.2-ti2v-5b", "wan22-ti2v-tiny-a", (121, 704, 1280), (5, 64, 64), 3),
    "i2v": ("wan2.1-i2v-14b-480p", "wan21-i2v-tiny-a", (81, 480, 832), (9, 32, 48), 2),
}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')} {time.perf_counter() - T0:7.1f}s]", *a, flush=True)


class Dev:
    """The device, its clock and its memory counters (zeros and the host clock on the CPU)."""

    def __init__(self, name):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def mem(self):
        if not self.cuda:
            return {"alloc_gib": 0.0, "peak_alloc_gib": 0.0, "peak_reserved_gib": 0.0}
        return {"alloc_gib": torch.cuda.memory_allocated() / GiB,
                "peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB}

    def event(self):
        """A timestamp: a recorded CUDA event, or the host clock."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b):
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    def cleanup(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def build(make, dev, dtype, seed, std=0.02):
    """A module from its config with its parameters on the meta device (buffers built for real), then each
    parameter made on `dev` in `dtype` (f32 under the model's _keep_in_fp32_modules, as from_pretrained keeps
    them): N(0, std); 1-d norm weights / scales 1, biases 0 (as the peer scripts)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        m = make()
    keep = getattr(m, "_keep_in_fp32_modules", None) or []
    g = torch.Generator(device=dev.device).manual_seed(seed)
    for mname, mod in m.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            low = full.lower()
            t = torch.empty(p.shape, device=dev.device,
                            dtype=torch.float32 if any(k in full.split(".") for k in keep) else dtype)
            if p.ndim == 1 and ("norm" in low or low.endswith("scale")) and "bias" not in low:
                t.fill_(1.0)
            elif p.ndim == 1 and "bias" in low:
                t.zero_()
            else:
                t.normal_(0.0, std, generator=g)
            mod._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
    return m.to(dev.device).eval()


def read(folder, rel):
    return json.load(open(os.path.join(folder, rel)))


def components(folder, dev, dtype, vae_dtype):
    """Every component of the model in `folder` (diffusers layout: configs, tokenizer, scheduler)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    index = read(folder, "model_index.json")
    present = lambda k: isinstance(index.get(k), list) and index[k][0] is not None
    # model_index.json's class: the shipped tokenizer folders hold tokenizer.json alone.
    c = {"tokenizer": T5TokenizerFast.from_pretrained(os.path.join(folder, "tokenizer")),
         "scheduler": UniPCMultistepScheduler.from_config(read(folder, "scheduler/scheduler_config.json"))}
    t0 = time.perf_counter()
    tcfg = UMT5Config.from_dict(read(folder, "text_encoder/config.json"))
    c["text_encoder"] = build(lambda: UMT5EncoderModel(tcfg), dev, dtype, 3)
    for i, name in enumerate(("transformer", "transformer_2")):
        if present(name):
            cfg = read(folder, f"{name}/config.json")
            c[name] = build(lambda: WanTransformer3DModel.from_config(cfg), dev, dtype, 1 + 10 * i)
    vcfg = read(folder, "vae/config.json")
    c["vae"] = build(lambda: AutoencoderKLWan.from_config(vcfg), dev, vae_dtype, 2)
    if present("image_encoder"):
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection
        icfg = CLIPVisionConfig.from_dict(read(folder, "image_encoder/config.json"))
        c["image_encoder"] = build(lambda: CLIPVisionModelWithProjection(icfg), dev, vae_dtype, 4)
        c["image_processor"] = CLIPImageProcessor.from_pretrained(os.path.join(folder, "image_processor"))
    dev.sync()
    extra = {k: index[k] for k in ("boundary_ratio", "expand_timesteps") if index.get(k) is not None}
    return c, extra, time.perf_counter() - t0


class Recorder:
    """Times and measures the phases of one pipeline call through wrappers on its components."""

    def __init__(self, dev):
        self.dev = dev
        self.phases = {}
        self.forwards = []
        self.steps = []
        self.denoise = None

    def phase(self, obj, attr, name):
        f = getattr(obj, attr)

        def g(*a, **k):
            self.end_denoise()
            self.dev.sync()
            self.dev.reset_peak()
            before = self.dev.mem()["alloc_gib"]
            s = time.perf_counter()
            out = f(*a, **k)
            self.dev.sync()
            p = self.phases.setdefault(name, {"seconds": 0.0, "calls": 0, "alloc_before_gib": before})
            p["seconds"] += time.perf_counter() - s
            p["calls"] += 1
            m = self.dev.mem()
            p["peak_alloc_gib"], p["peak_reserved_gib"] = m["peak_alloc_gib"], m["peak_reserved_gib"]
            return out

        setattr(obj, attr, g)

    def forward(self, model, expert):
        f = model.forward

        def g(*a, **k):
            if self.denoise is None:
                self.dev.sync()
                self.dev.reset_peak()
                self.denoise = {"start": time.perf_counter(), "alloc_before_gib": self.dev.mem()["alloc_gib"]}
                self.steps.append(self.denoise["start"])
            s = self.dev.event()
            out = f(*a, **k)
            e = self.dev.event()
            self.forwards.append((expert, s, e))
            return out

        model.forward = g

    def step_end(self, _pipe, i, t, kw):
        self.dev.sync()
        self.steps.append(time.perf_counter())
        return {}

    def end_denoise(self):
        if self.denoise is None or "seconds" in self.denoise:
            return
        self.dev.sync()
        m = self.dev.mem()
        self.denoise.update(seconds=time.perf_counter() - self.denoise["start"], peak_alloc_gib=m["peak_alloc_gib"],
                            peak_reserved_gib=m["peak_reserved_gib"])
        self.phases["denoise"] = {k: v for k, v in self.denoise.items() if k != "start"}

    def report(self):
        self.end_denoise()
        fw = [(x, self.dev.seconds(s, e)) for x, s, e in self.forwards]
        steps = [b - a for a, b in zip(self.steps, self.steps[1:])]
        med = lambda v: sorted(v)[len(v) // 2] if v else None
        experts = {}
        for x, s in fw:
            experts.setdefault(x, []).append(s)
        # The first forward of each expert pays its first-call costs (kernel choice, offload tracing): the
        # steady figures leave each expert's first forward out.
        steady = [s for v in experts.values() for s in v[1:]]
        return {"phases": self.phases, "forward_seconds": [s for _, s in fw], "forward_expert": [x for x, _ in fw],
                "s_per_forward_steady": med(steady), "step_seconds": steps,
                "s_per_step_steady": med(steps[1:]) if len(steps) > 1 else med(steps),
                "s_per_forward_by_expert": {x: med(v[1:] or v) for x, v in experts.items()}}


def input_image(path, size):
    from PIL import Image
    import numpy as np
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), ((x + y) * 7 % 256)], -1)
    img = Image.fromarray(rgb.astype("uint8"), "RGB")
    if path:
        img.save(path)
    return img


def ftfy_or_stand_in():
    """diffusers' Wan prompt cleaning calls ftfy.fix_text whether or not ftfy is installed; where it is not,
    an identity stands in (the prompt is plain ASCII: fix_text would return it unchanged)."""
    try:
        import ftfy  # noqa: F401
        return "ftfy"
    except ImportError:
        import types
        from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
        stand_in = types.SimpleNamespace(fix_text=lambda text: text)
        pipeline_wan.ftfy = pipeline_wan_i2v.ftfy = stand_in
        return "identity (ftfy not installed)"


def run_model(key, a, dev):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    assets, fixture, size, quick_size, steps = MODELS[key]
    folder = os.path.join(a.fixtures, fixture) if a.quick else os.path.join(a.assets, assets)
    frames, height, width = quick_size if a.quick else size
    steps = a.steps or steps
    dtype = torch.float32 if a.quick else torch.bfloat16
    r = {"model": key, "config_folder": folder, "size_fxhxw": [frames, height, width], "steps": steps,
         "guidance_scale": 5.0}
    dev.cleanup()
    dev.reset_peak()
    c, extra, r["build_s"] = components(folder, dev, dtype, torch.float32)
    r.update(extra)
    r["params_gib"] = {k: sum(p.numel() * p.element_size() for p in m.parameters()) / GiB
                       for k, m in c.items() if isinstance(m, torch.nn.Module)}
    rec = Recorder(dev)
    s = time.perf_counter()
    if key == "ti2v":
        # As from_pretrained leaves it: on the CPU; then diffusers' block-level group offload with a stream.
        c["transformer"].to("cpu")
        dev.cleanup()
        c["transformer"].enable_group_offload(onload_device=dev.device, offload_device=torch.device("cpu"),
                                              offload_type="block_level", num_blocks_per_group=1,
                                              use_stream=dev.cuda)
        r["mode"] = "transformer: enable_group_offload(block_level, num_blocks_per_group=1, use_stream=True)"
    else:
        r["mode"] = "resident"
    dev.sync()
    r["offload_setup_s"] = time.perf_counter() - s
    cls = WanImageToVideoPipeline if key == "i2v" else WanPipeline
    pipe = cls(**c, **extra)
    for name in ("transformer", "transformer_2"):
        if getattr(pipe, name, None) is not None:
            rec.forward(getattr(pipe, name), name)
    rec.phase(pipe, "encode_prompt", "encode_text")
    kw = dict(height=height, width=width, num_frames=frames, num_inference_steps=steps, guidance_scale=5.0,
              generator=torch.Generator(dev.device).manual_seed(1), callback_on_step_end=rec.step_end)
    if key == "i2v":
        rec.phase(pipe, "encode_image", "encode_image")
        rec.phase(pipe.vae, "encode", "vae_encode")
        rec.phase(pipe.vae, "decode", "decode")
        kw.update(prompt=PROMPT, negative_prompt="", image=input_image(None, (height, width)), output_type="np")
    else:
        # The prompt first; the call is then the denoise alone (diffusers' output_type="latent").
        embeds, negative = pipe.encode_prompt(PROMPT, "", do_classifier_free_guidance=True, device=dev.device)
        if key == "ti2v":
            # The VAE stays: the pipeline takes its execution device from it (and it is not used here).
            pipe.text_encoder.to("cpu")
            dev.cleanup()
        kw.update(prompt_embeds=embeds, negative_prompt_embeds=negative, output_type="latent")
    r["memory_before_call_gib"] = dev.mem()["alloc_gib"]
    dev.sync()
    s = time.perf_counter()
    with torch.no_grad():
        out = pipe(**kw)
    dev.sync()
    r["call_s"] = time.perf_counter() - s
    r.update(rec.report())
    video = out.frames
    video = torch.as_tensor(video) if not isinstance(video, torch.Tensor) else video
    r["output_shape"] = list(video.shape)
    r["finite"] = bool(torch.isfinite(video.float()).all())
    if dev.cuda:
        r["host_pinned_gib"] = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / GiB
    del pipe, c, out, video
    dev.cleanup()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--models", default="a14b,ti2v,i2v")
    ap.add_argument("--steps", type=int, default=0, help="denoising steps (default: per model, see MODELS)")
    ap.add_argument("--assets", default=os.path.join(ROOT, "assets"))
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(ROOT), "shared", "fixtures"))
    ap.add_argument("--quick", action="store_true", help="tiny fixture configs on the CPU")
    ap.add_argument("--write-image", metavar="PNG", help="write the I2V input image (480x832) and stop")
    a = ap.parse_args()
    if a.write_image:
        input_image(a.write_image, MODELS["i2v"][2][1:])
        return
    import diffusers
    dev = Dev("cpu" if a.quick or not torch.cuda.is_available() else "cuda")
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(0) if dev.cuda else "cpu", "torch": torch.__version__,
           "diffusers": diffusers.__version__, "quick": a.quick, "prompt_fix_text": ftfy_or_stand_in(),
           "models": {}}
    path = os.path.join(a.out, "results.json")
    for key in filter(None, a.models.split(",")):
        log("start", key)
        try:
            res["models"][key] = run_model(key, a, dev)
        except Exception as e:  # one model's failure leaves the others' rows
            import traceback
            traceback.print_exc()
            res["models"][key] = {"model": key, "error": f"{type(e).__name__}: {e}"}
            dev.cleanup()
        log(key, json.dumps(res["models"][key])[:1500])
        json.dump(res, open(path, "w"), indent=1)
    log("wrote", path)


if __name__ == "__main__":
    main()
