#!/usr/bin/env python3
"""Merges bench/seed_table.sh's outputs into one markdown table per family: vidgen's row beside
diffusers' for every mode of the seed table (s/forward, the run extrapolated to the table's steps,
model memory, inference peak allocated / reserved, pinned host, max difference from resident).
usage: seed_table.py OUT_DIR"""
import glob
import json
import os
import sys

GIB = 1024**3
# The table's steps and forwards per step (CFG doubles them; HunyuanVideo and FLUX.1-dev embed their
# guidance): the PR's settings, the pipelines' call defaults for the last four.
RUN = {"ltx": (50, 2), "cogvideox": (50, 2), "hunyuan": (30, 1), "hunyuan-720p": (30, 1),
       "mochi": (64, 2), "allegro": (100, 2), "latte": (50, 2), "flux": (28, 1)}


def vidgen_rows(path):
    rows, diffs = {}, {}
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "s_per_forward" in r:
            rows[r["label"]] = r
        else:
            diffs[r["label"]] = r["max_abs_diff_vs_first_mode"]
    for label, d in diffs.items():
        rows.get(label, {})["diff"] = d
    return rows


def main(out):
    for path in sorted(glob.glob(os.path.join(out, "*-vidgen.jsonl"))):
        fam = os.path.basename(path)[: -len("-vidgen.jsonl")]
        steps, fwd = RUN[fam]
        ours = vidgen_rows(path)
        # diffusers' rows, from its calls (peer-<family>, then any peer-<family>+<tag>): the first measured
        # row of a mode, else its first row (skipped or failed).
        peer = {}
        paths = [os.path.join(out, f"peer-{fam}", "results.json")]
        for path in paths + sorted(glob.glob(os.path.join(out, f"peer-{fam}+*", "results.json"))):
            rows = json.load(open(path))["rows"] if os.path.exists(path) else []
            for r in (r for r in rows if r.get("model") == fam):
                if "s_per_forward" not in peer.get(r["mode"], {}):
                    peer[r["mode"]] = r
        print(f"\n### {fam} ({steps} steps x {fwd} forwards)\n")
        print(f"| mode | s/forward vidgen / diffusers | run s ({steps} steps) vidgen / diffusers | model memory GiB vidgen / diffusers (reserved) "
              "| inference peak alloc GiB vidgen / diffusers | reserved vidgen / diffusers | pinned GiB vidgen / diffusers | max diff vs resident vidgen / diffusers |")
        print("|---|---|---|---|---|---|---|---|")
        for mode, r in ours.items():
            p = peer.get(mode, {})
            # vidgen's parked model moves in once per denoise stage, not per forward.
            run = r["s_per_forward"] * steps * fwd + r.get("hold_s", 0.0)
            f = lambda v: "-" if v is None else f"{v:.3f}"
            print(f"| {mode} | {f(r['s_per_forward'])} / {f(p.get('s_per_forward'))} | {run:.1f} / {f(p.get('est_run_s'))} "
                  f"| {f(r['model_memory_gib'])} / {f(p.get('model_memory_reserved_GiB'))} "
                  f"| {f(r['peak_alloc_gib'])} / {f(p.get('inference_peak_alloc_GiB'))} "
                  f"| {f(r['peak_reserved_gib'])} / {f(p.get('inference_peak_reserved_GiB'))} "
                  f"| {f(r['pinned_gib'])} / {f(p.get('host_pinned_after_run_GiB'))} | {r.get('diff', '-')} / {p.get('max_abs_diff_vs_none', '-')} |")


if __name__ == "__main__":
    main(sys.argv[1])
