"""Warp stall samples of one kernel from `ncu --page source --csv --print-source sass`: totals by reason, and the
instructions with the most samples with their two largest reasons (as session 48's call1/sage-stalls.txt), and the
samples by opcode."""
import collections, csv, sys

rows = list(csv.reader(open(sys.argv[1], errors="replace")))
start = next((i for i, r in enumerate(rows) if "Source" in r), None)
if start is None:
    print("no header with Source; first lines:", rows[:3])
    sys.exit()
head = rows[start]
body = [r for r in rows[start + 1:] if len(r) == len(head)]
src = head.index("Source")
total = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
reasons = [(i, h) for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
num = lambda v: float(v.replace(",", "") or 0) if v.replace(",", "").replace(".", "").isdigit() else 0.0
if total is None or not reasons:
    print("columns:", head)
    sys.exit()
all_samples = sum(num(r[total]) for r in body)
print(f"samples {all_samples:.0f}")
for i, h in sorted(reasons, key=lambda x: -sum(num(r[x[0]]) for r in body))[:12]:
    n = sum(num(r[i]) for r in body)
    print(f"  {h:28s} {n:9.0f} {100 * n / max(all_samples, 1):5.1f}%")
print("top instructions:")
for r in sorted(body, key=lambda r: -num(r[total]))[:40]:
    top = sorted(((num(r[i]), h.replace("stall_", "")) for i, h in reasons), reverse=True)[:2]
    print(f"  {100 * num(r[total]) / max(all_samples, 1):5.2f}% {r[src][:60]:60s} {[(int(n), h) for n, h in top]}")
print("by opcode:")
by, why = collections.Counter(), collections.defaultdict(collections.Counter)
for r in body:
    op = next((w for w in r[src].split() if not w.startswith("@")), "?")
    by[op] += num(r[total])
    for i, h in reasons:
        why[op][h.replace("stall_", "")] += num(r[i])
for op, n in by.most_common(16):
    top = [(h, round(100 * v / max(all_samples, 1), 1)) for h, v in why[op].most_common(3)]
    print(f"  {100 * n / max(all_samples, 1):5.1f}% {op:42s} {top}")
