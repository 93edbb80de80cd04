#!/usr/bin/env python3
"""MiniMax H3's whole video (issue 34 item 5) at the published size, vidgen beside diffusers 0.42.1 in one call.

The published checkpoint (~133 GB in bf16) fits neither the device machine's host memory (128 GiB) nor its disk
(64 GiB), so both programs load, from the page cache (/dev/shm), the published checkpoint with its DiT cut to
`--layers` blocks (its widths as published; minimax_text_stage.py's writer): the published Qwen3-VL-32B encoder,
video and audio VAEs, schedulers and tokenizer, random weights. Every stage but the DiT's depth is the published
one; the full DiT's time follows from the per-block time (examples/minimax_blocks, bench/peer_minimax_blocks.py).

  diffusers:  `ModularPipeline.from_pretrained(ckpt, workflow="t2va")`, `load_components(dtype=bf16,
              device_map="cuda")` (straight to the device: the host could not hold a CPU copy beside the page
              cache; the audio VAE stays f32, as diffusers keeps it), then one call at 124x768x1344 with
              `output_type="np"`. The processor's only use in t2va is the text-only token types, all 0:
              transformers' Qwen3VLProcessor needs torchvision to construct, so a stand-in gives those zeros.
              Timed apart: the load, the text encoder, the transformer's forwards, each VAE's decode.
              With `--free-encoder` (a card of 80 GB, where holding every component runs out of memory in the
              DiT's feed-forward) the text encoder's weights are dropped at the first forward.
  vidgen:     the command line on the same checkpoint, each mode in its own process (`--stats-json`: stages
              and loads), output as safetensors; its frames compared with diffusers'.

Usage (GPU machine, repository root, diffusers' wheel on PYTHONPATH):
  python3 bench/minimax_e2e.py --vidgen BIN --out DIR [--layers 2] [--steps 4] [--modes default,resident]
"""
import argparse, functools, json, os, shutil, sys, time

# The index names MiniMaxAI/MiniMax-H3; every component with files in the folder loads from it, offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_e2e as e2e  # noqa: E402  (the random-weight writer's helpers and vidgen's runner)
import minimax_text_stage as text_stage  # noqa: E402  (the checkpoint writer)


class TextOnlyTokenTypes:
    """What Qwen3VLProcessor.create_mm_token_type_ids gives for text: 0 for every token."""

    def create_mm_token_type_ids(self, ids):
        return [[0] * len(row) for row in ids]


def run_diffusers(ckpt, size, steps, dtype, device, free_encoder=False):
    """Load + one call; the spans of each part, the peaks and the frames [F, H, W, 3] in [0, 1].

    free_encoder: the text encoder's weights are dropped (emptied in place) at the transformer's first
    forward, as a user of an 80 GB card must: diffusers otherwise holds every component on the device through the
    call and runs out of memory there. Less work for diffusers than any offloading; its load is unchanged."""
    from diffusers import ModularPipeline
    frames, height, width = size
    r, spans = {}, {"text": [], "forward": [], "decode_video": [], "decode_audio": []}
    try:
        cuda = device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        e2e.sync()
        t0 = time.perf_counter()
        pipe = ModularPipeline.from_pretrained(ckpt, workflow="t2va")
        pipe.load_components(dtype=dtype, device_map=device)
        e2e.sync()
        r["load_s"] = time.perf_counter() - t0
        r["model_gib"] = torch.cuda.memory_allocated() / e2e.GiB if cuda else None
        pipe.processor = TextOnlyTokenTypes()
        encoder = pipe.text_encoder.model
        encoder.forward = e2e.timed(encoder.forward, spans["text"])
        del encoder  # a local would keep the encoder's 62 GiB after the pipeline is gone
        pipe.transformer.forward = e2e.timed(pipe.transformer.forward, spans["forward"])
        if free_encoder:
            pipe.transformer.forward = free_before(pipe.transformer.forward, pipe.text_encoder)
        r["encoder_freed_after_text"] = free_encoder
        pipe.vae.decode = e2e.timed(pipe.vae.decode, spans["decode_video"])
        pipe.audio_vae.decode = e2e.timed(pipe.audio_vae.decode, spans["decode_audio"])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        e2e.sync()
        start = time.perf_counter()
        state = pipe(prompt=e2e.PROMPT, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                     generator=torch.Generator("cpu").manual_seed(e2e.SEED), output_type="np")
        e2e.sync()
        end = time.perf_counter()
        videos, audio = state.get("videos"), state.get("audio")
        total = {k: sum(b - a for a, b in v) for k, v in spans.items()}
        text_end = spans["text"][-1][1] if spans["text"] else start
        r.update({
            "call_s": end - start, "text_s": total["text"],
            "denoise_s": spans["decode_video"][0][0] - text_end if spans["decode_video"] else None,
            "forward_s": [b - a for a, b in spans["forward"]],
            "decode_video_s": total["decode_video"], "decode_audio_s": total["decode_audio"],
            "after_decode_s": end - max(v[-1][1] for v in spans.values() if v),
            "peak_alloc_gib": torch.cuda.max_memory_allocated() / e2e.GiB if cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / e2e.GiB if cuda else None,
            "frames_shape": list(videos.shape), "audio_shape": list(audio.shape),
        })
        r["whole_s"] = r["load_s"] + r["call_s"]
        e2e.log("diffusers", json.dumps(r))
        return r, videos[0]
    except Exception as e:  # out of memory or a refusal: recorded, and vidgen still runs
        r["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        e2e.log("diffusers failed:", r["error"])
        return r, None
    finally:
        pipe = None
        e2e.free_memory()


def free_before(forward, encoder):
    """`forward` that first drops `encoder`'s weights, once; its signature kept (the denoise step reads it)."""
    @functools.wraps(forward)
    def call(*args, **kwargs):
        for t in [*encoder.parameters(), *encoder.buffers()]:  # empty on its device: the pipeline's execution
            t.data = t.data.new_empty(0)                       # device is the first component's
        return forward(*args, **kwargs)
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidgen", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2, help="the DiT's blocks (published: 50)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", default="124,768,1344", help="frames,height,width (the published default)")
    ap.add_argument("--modes", default="default,resident", help=f"vidgen modes, of {sorted(e2e.VIDGEN_MODES)}")
    ap.add_argument("--ckpt", help="default /dev/shm/vidgen-minimax-e2e-<layers>")
    ap.add_argument("--configs", default=text_stage.ASSETS, help="configs and tokenizer (a tiny fixture for a "
                                                                 "CPU smoke test of the writer)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--skip-diffusers", action="store_true", help="vidgen's runs only (diffusers holds every "
                    "component on the device: about 76 GiB with one DiT block, more than an H100 has, unless --free-encoder)")
    ap.add_argument("--free-encoder", action="store_true", help="diffusers drops its text encoder's weights once "
                    "the prompt is encoded (run_diffusers), so that it fits an 80 GB card")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test (with --configs of the tiny fixture)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(e2e.DTYPES))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ckpt = a.ckpt or f"/dev/shm/vidgen-minimax-e2e-{a.layers}"
    size = tuple(int(v) for v in a.size.split(","))
    dtype = e2e.DTYPES[a.dtype]
    import diffusers
    diffusers.utils.logging.disable_progress_bar()
    res = {"layers": a.layers, "steps": a.steps, "size": size,
           "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
           "versions": {"diffusers": diffusers.__version__, "torch": torch.__version__},
           "checkpoint": text_stage.write(a.configs, ckpt, a.device, dtype, layers=a.layers)}
    os.sync()

    def save():  # after each program, so a call cut short keeps what ran
        json.dump(res, open(os.path.join(a.out, "minimax_e2e.json"), "w"), indent=1, default=str)
    reference = None
    if not a.skip_diffusers:
        res["diffusers"], reference = run_diffusers(ckpt, size, a.steps, dtype, a.device, a.free_encoder)
        e2e.free_memory()  # torch's cache would keep the device's memory from vidgen's plan
    save()
    run = {"family": "minimax-h3", "size": size, "steps": a.steps, "guidance": None, "device": a.device,
           "vidgen_dtype": a.dtype, "videos": "/tmp/vidgen-minimax-e2e-out", "output_type": "safetensors",
           "max_seq": None, "vae_tiling": False, "fewstep": False, "loras": []}
    os.makedirs(run["videos"], exist_ok=True)
    res["vidgen"] = {}
    for label in [m for m in a.modes.split(",") if m]:
        v, path = e2e.run_vidgen(a.vidgen, ckpt, run, label, e2e.VIDGEN_MODES[label], a.out)
        v["frames_vs_diffusers"] = e2e.compare(path, reference)
        e2e.log("vidgen", label, "frames vs diffusers:", v["frames_vs_diffusers"])
        if path and os.path.exists(path):
            os.remove(path)
        res["vidgen"][label] = v
        save()
    if not a.keep:
        shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()
