"""Serve the bench's tiny (or small) model (vanilla or layered), run the throughput workload 4 times, then
ask every server process to write its call timer (call_timer_sitecustomize.py, loaded through
PYTHONPATH as ``sitecustomize``).

    LAYERED=1 .venv/bin/python benchmarks/results/sglang/kv-write-session42/call_timer_run.py OUT_DIR
    LAYERED=0 ...   # vanilla with --disable-overlap-schedule, as --enable-layered-kv forces
    MODEL=small ... # the bench's small model (default tiny)

Run from the repository root. The timer's files are OUT_DIR/<pid>.json; the scheduler's holds the
set_kv_buffer entry.
"""
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from sglang_ext.testing.server import SGLangServer  # noqa: E402
from sglang_ext.testing.tiny_model import build_tiny_model  # noqa: E402
from sglang_ext.tools.bench_workloads import model_spec, run_once  # noqa: E402

here = Path(__file__).resolve().parent
out = Path(sys.argv[1]).resolve()
out.mkdir(parents=True, exist_ok=True)
work = Path(tempfile.mkdtemp(prefix="kvplane-call-timer-"))
site = work / "site"
site.mkdir()
shutil.copy(here / "call_timer_sitecustomize.py", site / "sitecustomize.py")
layered = os.environ.get("LAYERED", "1") == "1"
flags = ("--mem-fraction-static", "0.3", "--sleep-on-idle") + (
    ("--enable-layered-kv",) if layered else ("--disable-overlap-schedule",))
model = build_tiny_model(work / "model", model_spec(os.environ.get("MODEL", "tiny")))
env = {"KVPROF_DIR": str(out), "PYTHONPATH": f"{site}:{os.getcwd()}"}
server = SGLangServer(model, log_path=work / "server.log", extra_args=flags, env=env)
server.start()
try:
    for _ in range(4):
        print(run_once(server, "throughput"))
    os.killpg(server._proc.pid, signal.SIGUSR2)
    time.sleep(3)
finally:
    server.stop()
