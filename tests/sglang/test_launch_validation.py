"""Bad kvplane launch options stop `python -m sglang.launch_server` with a message naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-scheduler", "sjf"], "kvplane: invalid launch option: --kv-scheduler='sjf' is invalid; allowed: fcfs, layerkv, lvf"),
        (["--radix-cache-backend", "foo"], "kvplane: --enable-layered-kv needs --radix-cache-backend layered (implied), got 'foo'"),
        (["--kv-profile", "/nonexistent-kvplane-dir/profile.json"],
         "kvplane: invalid launch option: --kv-profile='/nonexistent-kvplane-dir/profile.json': no such file"),
        (["--attention-backend", "fa3"],
         "kvplane: --attention-backend fa3 reads SGLang's flat KV buffers, which the layered KV pool "
         "does not have; on cpu use torch_native or triton (or leave it unset)"),
        (["--attention-backend", "torch_native", "--kv-cache-dtype", "fp8_e4m3"],
         "kvplane: --kv-cache-dtype fp8_e4m3: quantized KV caches are not supported with --enable-layered-kv"),
        (["--attention-backend", "torch_native", "--cuda-graph-backend-decode", "full"],
         "kvplane: --cuda-graph-backend-decode full: CUDA graph capture is not supported with "
         "--enable-layered-kv"),
    ],
)
def test_launcher_rejects_bad_options(tiny_model_dir, extra, message):
    """The launcher exits non-zero before starting any subprocess and prints the reason."""
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_model_dir),
         "--device", "cpu", "--enable-layered-kv", *extra],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    assert message in proc.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVPLANE_LOG_LEVEL": "chatty"},
         "kvplane: KVPLANE_LOG_LEVEL: 'chatty' is not a log level (allowed: debug, info, warning"),
        ({"KVPLANE_STATS_FILE": "/nonexistent-kvplane-dir/stats.jsonl"},
         "kvplane: KVPLANE_STATS_FILE='/nonexistent-kvplane-dir/stats.jsonl': directory "
         "'/nonexistent-kvplane-dir' does not exist"),
    ],
)
def test_launcher_rejects_bad_kvplane_env(tiny_model_dir, env, message):
    """A bad KVPLANE_* variable stops the launcher with the variable, its value and what is allowed."""
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_model_dir),
         "--device", "cpu", "--enable-layered-kv"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env},
    )
    assert proc.returncode != 0
    assert message in proc.stderr
