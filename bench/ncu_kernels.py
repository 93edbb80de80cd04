#!/usr/bin/env python3
"""Kernel times from Nsight Compute's CSV (`ncu --csv [--page raw] --metrics gpu__time_duration.sum PROGRAM`),
summed per kernel name, in ms.

    python3 bench/ncu_kernels.py FILE.csv LABEL     (the 25 largest kernels; bench/profile_dit.sh)
"""
import collections
import csv
import sys

# ms per unit of the duration column (its unit is the row under the header).
UNIT_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def kernels(path, name_len=None):
    """(ms, launches) per kernel name (cut to `name_len` characters where given)."""
    rows = [r for r in csv.reader(open(path)) if len(r) > 5]
    # The profiled program's own output lines come first.
    rows = rows[next(i for i, r in enumerate(rows) if "Kernel Name" in r):]
    head = rows[0]
    name_i = head.index("Kernel Name")
    if "Metric Value" in head:  # without `--page raw`: one row per kernel and metric, its unit beside it
        unit_i, t_i = head.index("Metric Unit"), head.index("Metric Value")
        data = [r for r in rows[1:] if r[head.index("Metric Name")] == "gpu__time_duration.sum"]
    else:  # `--page raw`: a column per metric, its unit in the row under the header
        t_i = head.index("gpu__time_duration.sum")
        unit_i, data = None, rows[2:]
    total, count = collections.Counter(), collections.Counter()
    for r in data:
        try:
            t = float(r[t_i].replace(",", "")) * UNIT_MS[r[unit_i] if unit_i is not None else rows[1][t_i]]
        except ValueError:
            continue
        name = r[name_i][:name_len]
        total[name] += t
        count[name] += 1
    return total, count


if __name__ == "__main__":
    total, count = kernels(sys.argv[1], 110)
    all_ms = sum(total.values())
    print(f"== {sys.argv[2]}: {sum(count.values())} kernels, {all_ms:.1f} ms in all")
    for name, t in total.most_common(25):
        print(f"{t:9.2f} ms {100 * t / all_ms:5.1f}% x{count[name]:5d}  {name}")
