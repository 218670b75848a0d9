import cProfile, pstats, sys, time, dataclasses, argparse
import torch
torch.set_num_threads(1)
from sglang_ext.tools import gpu_check as gc
from sglang_ext.tools.gpu_check_measure import CoreCheck
p = argparse.ArgumentParser(); gc.add_arguments(p)
args = p.parse_args(["--device","cpu","--shapes","llama3-8b","--layers","32","--context-min","128","--context-max","512","--repeat","3"])
cfg = dataclasses.replace(gc.config_from_args(args, "cpu"), dtype="float32", intermediate=256, hidden=512)
chk = CoreCheck(cfg, "cpu", "torch")
for _ in range(3): chk.step()
b = chk.batch
# time boundary only: begin_decode many times, with layers run cheaply
def boundary_only(n):
    tot = 0.0
    for _ in range(n):
        chk.step()
        tot += b.prepare_cpu_s
    return tot / n * 1e3
print("boundary ms", boundary_only(10), "advanced", b.core.advanced_decode_steps)
pr = cProfile.Profile()
orig = b.core.prepare_step
def wrapped(*a, **k):
    pr.enable()
    try: return orig(*a, **k)
    finally: pr.disable()
b.core.prepare_step = wrapped
orig2 = b.core.prepare_decode_step
def wrapped2(*a, **k):
    pr.enable()
    try: return orig2(*a, **k)
    finally: pr.disable()
b.core.prepare_decode_step = wrapped2
for _ in range(20): chk.step()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(40)
st.sort_stats("cumtime").print_stats(40)
