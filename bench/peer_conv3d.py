#!/usr/bin/env python3
"""torch's bf16 3x3x3 convolutions at the HunyuanVideo VAE decoder's shapes, beside cudnn_check's
(examples/cudnn_check.rs, `bf16_convolution`): the same shapes (inputs already padded), contiguous (NCDHW, as
torch and diffusers run them by default) and channels_last_3d, CUDA-event times (1 warm-up, median of 3) and
TFLOP/s. It tells whether cuDNN reaches the tensor cores on these shapes in vidgen's NCDHW layout.

  python3 bench/peer_conv3d.py
"""

import statistics

import torch
import torch.nn.functional as F

SHAPES = [  # (name, in channels, out channels, padded input frames, output height, output width)
    ("full 128, 1 frame", 128, 128, 3, 720, 1280),
    ("full 256->128, 1 frame", 256, 128, 3, 720, 1280),
    ("full 256, 1 frame", 256, 256, 3, 720, 1280),
    ("full 128, 17 frames", 128, 128, 19, 720, 1280),
    ("half 512, 9 frames", 512, 512, 11, 360, 640),
    ("quarter 512, 5 frames", 512, 512, 7, 180, 320),
]


def timed(f, reps=3):
    times = []
    for i in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    torch.backends.cudnn.benchmark = False
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'shape':<24} {'layout':<16} {'ms':>10} {'TFLOP/s':>9}")
    for name, c_in, c_out, t, h, w in SHAPES:
        x = torch.randn(1, c_in, t, h + 2, w + 2, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(c_out, c_in, 3, 3, 3, device="cuda", dtype=torch.bfloat16) / (c_in * 27) ** 0.5
        flops = 2.0 * c_in * c_out * 27 * (t - 2) * h * w
        for layout, fmt in [("contiguous", torch.contiguous_format), ("channels_last_3d", torch.channels_last_3d)]:
            xs, ks = x.contiguous(memory_format=fmt), k.contiguous(memory_format=fmt)
            try:
                with torch.no_grad():
                    ms = timed(lambda: F.conv3d(xs, ks))
                print(f"{name:<24} {layout:<16} {ms:>10.2f} {flops / (ms * 1e-3) / 1e12:>9.1f}", flush=True)
            except RuntimeError as e:
                print(f"{name:<24} {layout:<16} {str(e).splitlines()[0]}", flush=True)
            del xs, ks
        del x, k
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
