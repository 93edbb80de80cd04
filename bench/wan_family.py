#!/usr/bin/env python3
"""Merges bench/wan_family.sh's outputs into markdown: for each part (a14b, ti2v, i2v) vidgen's figures beside
diffusers', and issue 13's targets checked where the figures allow.
usage: wan_family.py OUT_DIR"""
import json
import os
import re
import sys

GIB = 1024**3


def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None


def med(v):
    v = sorted(x for x in v if x is not None)
    return v[len(v) // 2] if v else None


def f(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"


def vidgen(out, part):
    """vidgen's stats for one part, with the component load times from its log."""
    st = load(os.path.join(out, f"{part}-vidgen.json"))
    if not st or not st.get("jobs"):
        return None
    job = st["jobs"][0]
    m = job.get("metrics", {})
    r = {"status": job.get("status"), "error": job.get("error") or st.get("error"), "wall": st.get("wall_seconds"),
         "stages": {s["name"]: s["seconds"] for s in job.get("stages", [])}, "peaks": m.get("stages", {}),
         "forwards": m.get("forward_seconds", []), "switch": m.get("expert_switch"),
         "image": m.get("encode_image_seconds", {}), "offload": [m[k] for k in ("offload", "offload_transformer_2")
                                                                 if k in m],
         "steps": job.get("num_inference_steps")}
    log = open(os.path.join(out, f"{part}-vidgen.log"), errors="replace").read() \
        if os.path.exists(os.path.join(out, f"{part}-vidgen.log")) else ""
    r["loads"] = {n: float(s) for n, s in re.findall(r"loaded (\S+) in ([\d.]+)s", log)}
    rss = re.findall(r"Maximum resident set size \(kbytes\): (\d+)", log)
    r["rss_gib"] = int(rss[-1]) * 1024 / GIB if rss else None
    # Steady forwards: each expert's first forward (kernel choice, first blocks) left out.
    cut = r["switch"]["after_forward"] if r["switch"] else len(r["forwards"])
    r["experts"] = [x for x in (r["forwards"][:cut], r["forwards"][cut:]) if x]
    r["steady"] = med([s for x in r["experts"] for s in x[1:]] or r["forwards"])
    return r


def peak(r, stage, key="device_used_peak"):
    p = r["peaks"].get(stage)
    return None if p is None else p[key] / GIB


def peer(out, part):
    res = load(os.path.join(out, f"peer-{part}", "results.json"))
    return (res or {}).get("models", {}).get(part)


def row(name, ours, theirs):
    print(f"| {name} | {ours} | {theirs} |")


def verdict(ok):
    return "-" if ok is None else ("**pass**" if ok else "**FAIL**")


def a14b(out):
    v, p = vidgen(out, "a14b"), peer(out, "a14b") or {}
    dit = {}
    path = os.path.join(out, "a14b-dit.jsonl")
    if os.path.exists(path):
        for line in open(path):
            if line.startswith("{") and "s_per_forward" in line:
                j = json.loads(line)
                dit[j["label"]] = j
    res, dflt = dit.get("resident", {}), dit.get("default", {})
    print("\n### Wan2.2 T2V-A14B, 480x832x81, CFG 5\n")
    print("| | vidgen | diffusers 0.42.1 (both experts resident) |\n|---|---|---|")
    ps = p.get("s_per_forward_by_expert", {})
    row("DiT forward s, first expert, resident (offload_bench: median of 2 after a warm-up)",
        f(res.get("s_per_forward")), f"{f(ps.get('transformer'))} (pipeline, steady)")
    overhead = None
    if res.get("s_per_forward") and dflt.get("s_per_forward"):
        overhead = dflt["s_per_forward"] / res["s_per_forward"] - 1
    row("DiT forward s, first expert, default flags (streamed)",
        f"{f(dflt.get('s_per_forward'))} ({f(None if overhead is None else overhead * 100, 2)}% vs resident)", "-")
    row("offload_bench peak used / reserved GiB: resident; default",
        f"{f(res.get('peak_alloc_gib'), 2)} / {f(res.get('peak_reserved_gib'), 2)}; "
        f"{f(dflt.get('peak_alloc_gib'), 2)} / {f(dflt.get('peak_reserved_gib'), 2)}", "-")
    if v:
        hi, lo = (v["experts"] + [[], []])[:2]
        row("CLI default: forward s, high / low expert (median, first of each left out)",
            f"{f(med(hi[1:] or hi))} / {f(med(lo[1:] or lo))}",
            f"{f(ps.get('transformer'))} / {f(ps.get('transformer_2'))}")
        den = [v["stages"].get(s) for s in ("denoise_high_noise", "denoise_low_noise")]
        steps = v["steps"] or 1
        row("s/step (denoise stages / steps)",
            f(sum(x for x in den if x) / steps), f"{f(p.get('s_per_step_steady'))} (steady), "
            f"{f((p.get('phases', {}).get('denoise', {}).get('seconds') or 0) / steps)} (denoise / steps)")
        r = vidgen(out, "a14b-resident")
        if r:
            den_r = [r["stages"].get(s) for s in ("denoise_high_noise", "denoise_low_noise")]
            hi_r, lo_r = (r["experts"] + [[], []])[:2]
            row("CLI resident (every component): s/step; forward s high / low",
                f"{f(sum(x for x in den_r if x) / (r['steps'] or 1))}; {f(med(hi_r[1:] or hi_r))} / "
                f"{f(med(lo_r[1:] or lo_r))}", f"{f(p.get('s_per_step_steady'))} (steady)")
        row("denoise peak used / reserved GiB: high; low expert",
            f"{f(peak(v, 'denoise_high_noise'), 2)} / {f(peak(v, 'denoise_high_noise', 'device_reserved_peak'), 2)}; "
            f"{f(peak(v, 'denoise_low_noise'), 2)} / {f(peak(v, 'denoise_low_noise', 'device_reserved_peak'), 2)}",
            f"{f(p.get('phases', {}).get('denoise', {}).get('peak_alloc_gib'), 2)} / "
            f"{f(p.get('phases', {}).get('denoise', {}).get('peak_reserved_gib'), 2)}")
        sw = v["switch"] or {}
        first_low = lo[0] if lo else None
        row("expert switch s (last high-noise step to first low-noise forward); first low forward s",
            f"{f(sw.get('seconds'))}; {f(first_low)}", "- (both resident)")
        row("pinned host GiB (DiT offload), host RSS peak GiB",
            f"{', '.join(f(o['pinned_bytes'] / GIB, 2) for o in v['offload']) or '-'}, {f(v['rss_gib'], 1)}",
            f"{f(p.get('host_pinned_gib'), 2)}, -")
        row("loads s", ", ".join(f"{k} {s:.1f}" for k, s in v["loads"].items()) or "-", f"build {f(p.get('build_s'), 1)}")
        row("whole run s (vidgen: the process, loads included)", f(v["wall"], 1),
            f"call {f(p.get('call_s'), 1)} (latents)")
        if v["error"]:
            print(f"\nvidgen error: {v['error']}")
        pk = max([x for x in (peak(v, "denoise_high_noise"), peak(v, "denoise_low_noise")) if x is not None],
                 default=None)
        print("\nTargets:")
        print(f"- device peak during denoise <= 3.5 GiB: {f(pk, 2)} GiB {verdict(None if pk is None else pk <= 3.5)}")
        fw = v["steady"]
        tot = (sw.get("seconds") or 0) + ((first_low - fw) if first_low and fw else 0)
        print(f"- expert switch <= one forward: {f(sw.get('seconds'))} s (+ first low forward's excess "
              f"{f(first_low - fw if first_low and fw else None)} s) vs {f(fw)} s "
              f"{verdict(None if not sw or not fw else tot <= fw)}")
    print(f"- streaming overhead <= 1%: {f(None if overhead is None else overhead * 100, 2)}% "
          f"{verdict(None if overhead is None else overhead <= 0.01)}")
    r_fw, d_fw = res.get("s_per_forward"), ps.get("transformer")
    print(f"- resident no slower than diffusers' resident: {f(r_fw)} vs {f(d_fw)} s/forward "
          f"{verdict(None if not r_fw or not d_fw else r_fw <= d_fw)}")
    if p.get("error"):
        print(f"\ndiffusers error: {p['error']}")


def ti2v(out):
    v, p = vidgen(out, "ti2v"), peer(out, "ti2v") or {}
    print("\n### Wan2.2 TI2V-5B, 704x1280x121, CFG 5\n")
    print("| | vidgen, default flags | diffusers 0.42.1, block-level group offload N=1 + stream |\n|---|---|---|")
    d = p.get("phases", {}).get("denoise", {})
    if v:
        steps = v["steps"] or 1
        row("forward s (median, first left out)", f(v["steady"]), f(p.get("s_per_forward_steady")))
        row("s/step (denoise / steps)", f((v["stages"].get("denoise") or 0) / steps),
            f"{f(p.get('s_per_step_steady'))} (steady), {f((d.get('seconds') or 0) / steps)} (denoise / steps)")
        row("denoise peak used / reserved GiB", f"{f(peak(v, 'denoise'), 2)} / "
            f"{f(peak(v, 'denoise', 'device_reserved_peak'), 2)}",
            f"{f(d.get('peak_alloc_gib'), 2)} / {f(d.get('peak_reserved_gib'), 2)} (incl. the resident f32 VAE, "
            f"{f(p.get('params_gib', {}).get('vae'), 2)} GiB; {f(d.get('alloc_before_gib'), 2)} in use at the start)")
        row("pinned host GiB (DiT offload)", ", ".join(f(o["pinned_bytes"] / GIB, 2) for o in v["offload"]) or "-",
            f(p.get("host_pinned_gib"), 2))
        row("loads / offload setup s", ", ".join(f"{k} {s:.1f}" for k, s in v["loads"].items()) or "-",
            f"build {f(p.get('build_s'), 1)}, enable_group_offload {f(p.get('offload_setup_s'), 1)}")
        row("whole run s", f(v["wall"], 1), f"call {f(p.get('call_s'), 1)} (latents)")
        if v["error"]:
            print(f"\nvidgen error: {v['error']}")
    if p.get("error"):
        print(f"\ndiffusers error: {p['error']}")


def i2v(out):
    v, p = vidgen(out, "i2v"), peer(out, "i2v") or {}
    print("\n### Wan2.1 I2V 14B 480P, 480x832x81, CFG 5, the whole video\n")
    print("| | vidgen, default flags | diffusers 0.42.1, resident |\n|---|---|---|")
    ph = p.get("phases", {})
    pp = lambda k: f"{f(ph.get(k, {}).get('seconds'), 2)} s, peak {f(ph.get(k, {}).get('peak_alloc_gib'), 2)} / " \
                   f"{f(ph.get(k, {}).get('peak_reserved_gib'), 2)} GiB"
    if v:
        vp = lambda s: f"peak {f(peak(v, s), 2)} / {f(peak(v, s, 'device_reserved_peak'), 2)} GiB"
        row("encode_text", f"{f(v['stages'].get('encode_text'), 2)} s (incl. the loads before it), "
            f"{vp('encode_text')}", pp("encode_text"))
        row("image encoder (CLIP)", f"{f(v['image'].get('image_encoder'), 2)} s", pp("encode_image"))
        row("VAE encode of the condition video", f"{f(v['image'].get('vae_encode'), 2)} s", pp("vae_encode"))
        row("encode_image stage (both)", f"{f(v['stages'].get('encode_image'), 2)} s, {vp('encode_image')}", "-")
        steps = v["steps"] or 1
        row("denoise: s/step; forward s", f"{f((v['stages'].get('denoise') or 0) / steps)}; {f(v['steady'])}",
            f"{f((ph.get('denoise', {}).get('seconds') or 0) / steps)}; {f(p.get('s_per_forward_steady'))}")
        row("denoise peak", vp("denoise"), pp("denoise").split(", ", 1)[1])
        row("decode", f"{f(v['stages'].get('decode'), 2)} s, {vp('decode')}", pp("decode"))
        row("loads s", ", ".join(f"{k} {s:.1f}" for k, s in v["loads"].items()) or "-", f"build {f(p.get('build_s'), 1)}")
        row("whole video s", f"{f(v['wall'], 1)} (process: loads, stages, write)",
            f"{f(p.get('call_s'), 1)} (the call; + {f(p.get('build_s'), 1)} building)")
        again = vidgen(out, "i2v-again")
        if again:
            row("again, a second process: image encoder; VAE encode; whole video s",
                f"{f(again['image'].get('image_encoder'), 2)}; {f(again['image'].get('vae_encode'), 2)}; "
                f"{f(again['wall'], 1)}", "-")
        if v["error"]:
            print(f"\nvidgen error: {v['error']}")
    if p.get("error"):
        print(f"\ndiffusers error: {p['error']}")


def main(out):
    for part, show in (("a14b", a14b), ("ti2v", ti2v), ("i2v", i2v)):
        if os.path.exists(os.path.join(out, f"{part}-vidgen.json")) or os.path.exists(os.path.join(out, f"peer-{part}")):
            show(out)


if __name__ == "__main__":
    main(sys.argv[1])
