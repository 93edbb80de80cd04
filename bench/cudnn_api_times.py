"""Host time per cuDNN API function from cuDNN's API log (CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=FILE): each call
is charged the time to the next logged call, so back-to-back calls (a plan's descriptors, heuristic and workspace
queries) get their own cost and a call followed by GPU work also gets the host time of the launches after it.
    python3 bench/cudnn_api_times.py FILE"""
import collections
import datetime
import re
import sys

calls = []
name = None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"function (\w+)\(\) called", line)
    if m:
        name = m.group(1)
        continue
    m = re.search(r"Time: (\d{4}-\d\d-\d\dT[\d:.]+)", line)
    if m and name:
        calls.append((name, datetime.datetime.fromisoformat(m.group(1))))
        name = None
if len(calls) < 2:
    sys.exit(f"{len(calls)} timed calls in {sys.argv[1]}")
total, count = collections.Counter(), collections.Counter()
for (n, t), (_, t_next) in zip(calls, calls[1:]):
    total[n] += (t_next - t).total_seconds()
    count[n] += 1
span = (calls[-1][1] - calls[0][1]).total_seconds()
print(f"{len(calls)} cuDNN calls over {span * 1e3:.1f} ms")
for n, s in total.most_common(12):
    print(f"{s * 1e3:9.2f} ms {count[n]:6d}x  {n}")
