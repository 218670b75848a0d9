import concurrent.futures as cf
import json
import sys
import time
import urllib.request

from transformers import AutoTokenizer

port, out = int(sys.argv[1]), sys.argv[2]
base = f"http://127.0.0.1:{port}"
tok = AutoTokenizer.from_pretrained("/tmp/lora81/model")


def wait():
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except Exception:
            time.sleep(1)
    raise SystemExit("no health")


def gen(ids, lora, n=48):
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
        "return_logprob": True,
    }
    if lora is not None:
        body["lora_path"] = lora
    req = urllib.request.Request(
        base + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    r = json.load(urllib.request.urlopen(req, timeout=600))
    LP_[id(ids), lora] = 0
    lps = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
    return {"ids": r["output_ids"], "lp": lps}


wait()
texts = [
    "The quick brown fox jumps over the lazy dog. A cache keeps recent data close to the processor so that",
    "Once upon a time there was a small model with random weights.",
    "User: hello! Assistant: hi, how can I help you today? User: tell me a story please.",
    "Numbers: zero one two three four five six seven eight nine ten eleven twelve. Colors: red orange yellow green blue",
]
long_prefix = (" ".join(texts) + " ") * 3  # long shared prefix (~ some hundred tokens)
P = [tok(t)["input_ids"] for t in texts]
LP = tok(long_prefix)["input_ids"]
res = {}
LP_ = {}
# 1. sequential, each prompt with base/A/B
for i, ids in enumerate(P):
    for lora in (None, "A", "B"):
        res[f"seq/p{i}/{lora}"] = gen(ids, lora)
# 2. shared long prefix: base first (fills radix), then A, then B, then base again; suffixes differ
for j, suf in enumerate([" The scheduler decides", " Time to first token"]):
    ids = LP + tok(suf)["input_ids"]
    for lora in (None, "A", "B", None, "A"):
        res.setdefault(f"prefix/s{j}/{lora}", []).append(gen(ids, lora))
# 3. concurrent mixed batch
jobs = [(f"conc/p{i}/{lora}", P[i], lora) for i in range(len(P)) for lora in (None, "A", "B")]
jobs += [(f"conc/lp/{lora}", LP + tok(" When the cache")["input_ids"], lora) for lora in (None, "A", "B")]
with cf.ThreadPoolExecutor(len(jobs)) as ex:
    futs = {k: ex.submit(gen, ids, lora) for k, ids, lora in jobs}
    for k, f in futs.items():
        res[k] = f.result()
print("prompt lens", [len(p) for p in P], len(LP))
json.dump(res, open(out, "w"))
print("done", len(res))
