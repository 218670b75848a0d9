"""Build the served layered pool (identity layout: no budget) at Llama-3-8B KV shapes on the CPU and
report its process RSS growth and build time."""
import sys
import time

import torch

from sglang_ext.args import LayeredKVArgs
from sglang_ext.layered_pool import LayeredTokenToKVPool


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

tokens = int(sys.argv[1])
before = rss_mb()
t0 = time.perf_counter()
pool = LayeredTokenToKVPool(size=tokens, page_size=16, dtype=torch.bfloat16, head_num=8, head_dim=128, layer_num=32,
                            device="cpu", enable_memory_saver=False, layered_args=LayeredKVArgs(enable_layered_kv=True))
dt = time.perf_counter() - t0
after = rss_mb()
host = pool.store.host.numel() * pool.store.host.element_size()
dev = pool.store.dev.numel() * pool.store.dev.element_size()
print(f"tokens={tokens} build_s={dt:.2f} rss_growth_mb={after - before:.0f} host_pool_mb={host / 2**20:.1f} device_pool_mb={dev / 2**20:.1f}")
