import json
import sys


def flat(d):
    out = {}
    d = {k: ([x["ids"] for x in v] if isinstance(v, list) else v["ids"]) for k, v in d.items()}
    for k, v in d.items():
        if v and isinstance(v[0], list):
            for i, x in enumerate(v):
                out[f"{k}#{i}"] = x
        else:
            out[k] = v
    return out


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


files = sys.argv[1:]
ds = [flat(json.load(open(f))) for f in files]
s = ds[0]
print("== control (within", files[0], ")")
for key in sorted(s):
    if key.endswith("/None") or "/None#" in key:
        for lora in ("A", "B"):
            k2 = key.replace("/None", "/" + lora)
            if k2 in s:
                print(f"  {key} vs {lora}: first diff at", first_diff(s[key], s[k2]))
# consistency: seq vs conc, and repeated prefix runs
print("== internal consistency", files[0])
for key in sorted(s):
    if key.startswith("conc/p"):
        k2 = key.replace("conc", "seq")
        print(f"  {key} vs seq: diff at", first_diff(s[key], s[k2]))
for j in (0, 1):
    for lora, idx in (("None", (0, 1)), ("A", (0, 1))):
        print(
            f"  prefix/s{j}/{lora} rerun: diff at",
            first_diff(s[f"prefix/s{j}/{lora}#{idx[0]}"], s[f"prefix/s{j}/{lora}#{idx[1]}"]),
        )
for other, f in zip(ds[1:], files[1:], strict=False):
    mism = [k for k in s if s[k] != other.get(k)]
    print(f"== {files[0]} vs {f}: {len(mism)}/{len(s)} mismatching outputs")
    for k in mism:
        print("   ", k, "first diff at", first_diff(s[k], other.get(k, [])))


def lps(d):
    o = {}
    for k, v in d.items():
        if isinstance(v, list):
            for i, x in enumerate(v):
                o[f"{k}#{i}"] = x
        else:
            o[k] = v
    return o



L = [lps(json.load(open(f))) for f in files]
for other, f in zip(L[1:], files[1:], strict=False):
    worst = 0.0
    for k, v in L[0].items():
        if v["ids"] == other[k]["ids"]:
            worst = max(worst, max(abs(a - b) for a, b in zip(v["lp"], other[k]["lp"], strict=False)))
    print(f"== max |logprob diff| over token-identical outputs, {files[0]} vs {f}: {worst:.3g}")
