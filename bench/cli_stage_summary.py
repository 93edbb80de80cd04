"""A command-line run against its dry run: each stage's device peak used and planned, what the offload engine kept
and copied, the stages' and forwards' seconds.

python3 bench/cli_stage_summary.py STATS.json PLAN.json   (`--stats-json` of the run, `--dry-run --json` of the same)
"""
import json
import sys

stats, plan = (json.load(open(p)) for p in sys.argv[1:3])
job = stats["jobs"][0]
planned = {s["name"]: s["memory"]["peak_bytes"] for s in plan["stages"]}
for name, m in job["metrics"]["stages"].items():
    print(f"  {name}: used {m['device_used_peak'] / 2**30:.3f} GiB, planned {planned.get(name, 0) / 2**30:.3f}")
off = job["metrics"].get("offload")
if off:
    print(f"  offload: kept {off['kept_groups']} groups, {off['kept_bytes'] / 2**30:.2f} GiB; "
          f"{off['groups_copied']} groups, {off['bytes_copied'] / 1e9:.1f} GB copied")
print(f"  stages {[(s['name'], round(s['seconds'], 3)) for s in job['stages']]}; "
      f"forwards {[round(t, 4) for t in job['metrics']['forward_seconds']]}")
