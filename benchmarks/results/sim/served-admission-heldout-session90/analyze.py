"""Table + pre-registered claim check from a run_study.py results JSON.  python analyze.py RESULTS.json"""
import json
import sys
from collections import defaultdict

rows = json.load(open(sys.argv[1]))
by = defaultdict(dict)
for r in rows:
    by[(r["seed"], r["rate_per_min"])][r["policy"]] = r
print("| seed | rate | fcfs goodput | layerkv goodput | window min | diff (fcfs-lkv meets) | "
      "fcfs TTFT+TPOT | layerkv TTFT+TPOT |")
print("|---|---|---|---|---|---|---|---|")
diffs = []
means = defaultdict(lambda: defaultdict(list))
for (seed, rate), p in sorted(by.items()):
    if "kvplane-fcfs" not in p or "kvplane" not in p:
        continue
    f, k = p["kvplane-fcfs"], p["kvplane"]
    w = f["window_min"]
    assert abs(w - k["window_min"]) < 1e-9
    d = round((f["slo_goodput_req_per_min"] - k["slo_goodput_req_per_min"]) * w)
    assert d == f["slo_ok"] - k["slo_ok"]
    diffs.append((d, seed, rate))
    for pol, r in (("fcfs", f), ("layerkv", k)):
        means[rate][pol].append(r["slo_goodput_req_per_min"])
        means[rate][pol + "_tpot"].append(r["slo_goodput_tpot_req_per_min"])
    print(f"| {seed} | {rate:g} | {f['slo_goodput_req_per_min']:.3f} | {k['slo_goodput_req_per_min']:.3f} | "
          f"{w:.2f} | {d:+d} | {f['slo_goodput_tpot_req_per_min']:.3f} | {k['slo_goodput_tpot_req_per_min']:.3f} |")
n = len(diffs)
print(f"\nruns: {n}; claim (diff >= -1) holds on {sum(d >= -1 for d, *_ in diffs)}/{n}; "
      f"strict (diff >= 0) on {sum(d >= 0 for d, *_ in diffs)}/{n}")
print("worst diff:", min(diffs), "| all diffs:", sorted(d for d, *_ in diffs))
for rate in sorted(means):
    m = {k: sum(v) / len(v) for k, v in means[rate].items()}
    print(f"rate {rate:g} (n={len(means[rate]['fcfs'])}): SLO goodput fcfs {m['fcfs']:.3f} vs layerkv "
          f"{m['layerkv']:.3f}; TTFT+TPOT fcfs {m['fcfs_tpot']:.3f} vs layerkv {m['layerkv_tpot']:.3f}")
print(f"sum of run wall_s: {sum(r['wall_s'] for r in rows):.0f}")
