"""One line per mode of an offload_bench JSON-lines file: time per forward, device peaks, copies."""
import json
import sys

for line in open(sys.argv[1]):
    r = json.loads(line)
    if "s_per_forward" in r:
        print(f"{r['label']:>10} {r['s_per_forward']:.4f} s  peak {r['peak_alloc_gib']:.3f} GiB  model {r['model_memory_gib']:.3f}  reserved {r['peak_reserved_gib']:.3f}  copy busy {r['copy_busy_s']:.3f} s at {r['copy_gb_s']:.1f} GB/s  times {[round(t, 4) for t in r['times']]}")
    else:
        print(f"{r['label']:>10} max diff vs the first mode {r['max_abs_diff_vs_first_mode']}")
