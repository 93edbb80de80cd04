"""diffusers' resident Wan2.1 DiT forward (s/forward, CUDA events), as ../shared/peer/wan_offload_bench.py
measures it, for one model, so it can run beside vidgen's `offload_bench` in the same device call.

    python3 bench/peer_wan_forward.py [1.3b|14b] [warm-up forwards] [timed forwards] [path/to/wan_offload_bench.py]

Prints one JSON line (s_per_forward, wall, model memory, peak allocation).
"""
import importlib.util
import json
import sys

model = sys.argv[1] if len(sys.argv) > 1 else "14b"
n_warm = int(sys.argv[2]) if len(sys.argv) > 2 else 1
n_timed = int(sys.argv[3]) if len(sys.argv) > 3 else 3
path = sys.argv[4] if len(sys.argv) > 4 else "../shared/peer/wan_offload_bench.py"
spec = importlib.util.spec_from_file_location("wan_offload_bench", path)
wob = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wob)
cfg = {"1.3b": wob.WAN_1_3B, "14b": wob.WAN_14B}[model]
row, _ = wob.run_transformer_mode(f"wan2.1-t2v-{model}", cfg, wob.LATENT_480P_81F, "resident", wob.Dev("cuda"),
                                  n_warm, n_timed)
keys = ["model", "s_per_forward", "forward_s_events", "s_per_forward_wall", "model_memory_GiB",
        "inference_peak_alloc_GiB", "achieved_tflops", "out_finite"]
print(json.dumps({k: row.get(k) for k in keys}))
