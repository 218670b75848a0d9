"""Host work of a steady decode step at Llama-3-8B's batch (README.md next to this file).

Run from the repository root: ``.venv/bin/python benchmarks/results/core/session38-steady/steady_probe.py``
``[resident|placed] [profile|ops]``. It drives `kvplane gpu-check`'s ``CoreCheck`` (the served
core at Llama-3-8B's batch: 32 requests, contexts 2K-8K, 32 layers, page 16, paged reads; tiny
heads, so the CPU device ops stay small) on this host's CPU, three warm steps, then:
``profile``: thread CPU ms of kvplane's share per step (``CoreCheck.kvplane_cpu_ms``: boundary,
enter, write, exit) and cProfile's top functions by own time inside kvplane's scopes;
``ops``: the aten ops kvplane dispatches per step (OpAudit), by phase -- each is a kernel launch or
a host op on a GPU host.
"""

from __future__ import annotations

import collections
import sys

from sglang_ext.testing.op_audit import OpAudit
from sglang_ext.tools.gpu_check_config import GpuCheckConfig
from sglang_ext.tools.gpu_check_measure import CoreCheck


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "resident"
    what = sys.argv[2] if len(sys.argv) > 2 else "profile"
    cfg = GpuCheckConfig(name="probe", layers=32, q_heads=4, kv_heads=1, head_dim=8, page_size=16, requests=32,
                         context_min=2048, context_max=8192, hidden=32, intermediate=32, dtype="float32", repeat=9)
    check = CoreCheck(cfg, "cpu")
    b = check.batch
    if mode == "placed":
        b.place(check.plan([0.5] * cfg.layers, 1000.0))
    for _ in range(3):
        check.step()
    if what == "profile":
        ms = check.kvplane_cpu_ms()
        print(f"{mode}: kvplane CPU {ms:.3f} ms/step (boundary {check.prepare_cpu_ms:.3f}, "
              + ", ".join(f"{k} {v:.3f}" for k, v in check.parts_cpu_ms.items()) + ")")
        for row in check.host_profile()[:25]:
            print(f"  {row['own_ms_per_step']:8.4f} ms {row['calls_per_step']:8.1f}x  {row['function']}")
        return
    audit = OpAudit()
    phase = {"p": "boundary"}

    def scope(kind, layer, part=""):  # noqa: ANN001, ANN202
        return audit.scope((kind, part)) if kind == "kvplane" else audit.scope(None)

    class Boundary:
        def __enter__(self):  # noqa: ANN204
            self.cm = audit.scope(("kvplane", "boundary"))
            return self.cm.__enter__()

        def __exit__(self, *exc):  # noqa: ANN002, ANN204
            return self.cm.__exit__(*exc)

    b.boundary_scope = Boundary
    steps = 4
    with audit:
        for _ in range(steps):
            check.step(scope)
    del phase
    for label, ops in sorted(audit.ops.items(), key=lambda kv: str(kv[0])):
        if label is None:
            continue
        c = collections.Counter(ops)
        print(f"{mode} {label[1]}: {len(ops) / steps:.1f} ops/step")
        for name, n in c.most_common(12):
            print(f"    {n / steps:7.1f}  {name}")


if __name__ == "__main__":
    main()
