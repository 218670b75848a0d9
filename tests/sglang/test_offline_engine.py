"""kvplane on SGLang's offline engine (``sglang_ext/offline_engine.py``).

``sgl.Engine(**kwargs)`` has no field for kvplane's options and skips the launcher's parse;
:func:`~sglang_ext.offline_engine.layered_engine` builds the engine's ``ServerArgs`` through it.
Each engine runs in its own process (``engine_driver.py``): an engine loads SGLang's plugins and
applies their hooks in the process that builds it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from tests.sglang.conftest import FAULT_INJECT_DIR, LOGPROB_ATOL, PROMPTS, result_line

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]

ROOT = Path(__file__).parents[2]
DRIVER = Path(__file__).parent / "engine_driver.py"
NEW_TOKENS = 8


def _start(mode: str, model: Path, prompts: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """The driver in ``mode`` with ``env`` added (its ``PYTHONPATH`` entries first), output in ``log``."""
    path = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT), os.environ.get("PYTHONPATH")]))
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, str(DRIVER), mode, str(model), json.dumps(prompts), str(NEW_TOKENS)],
                                stdout=out, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
                                env={**os.environ, **env, "PYTHONPATH": path})


def _result(proc: subprocess.Popen, log: Path) -> dict:
    assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
    result = result_line(log.read_text())
    assert result is not None, log.read_text()[-4000:]
    return result


def _same(got: dict, want: dict) -> bool:
    return got["ids"] == want["ids"] and len(got["logprobs"]) == len(want["logprobs"]) > 0 and max(
        abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) <= LOGPROB_ATOL


def test_a_layered_offline_engine_generates_as_stock_with_most_kv_on_host(tiny_model_dir, tmp_path):
    """``layered_engine(enable_layered_kv=True, kv_gpu_budget_tokens=49)`` runs with the options
    the launcher's parse sets (layered radix cache, no overlap scheduler, the layered attention
    backend), puts the parse's exports back (and its options in this process at shutdown: a stock
    engine after it is not checked by kvplane), and generates what stock ``sgl.Engine`` does (greedy
    ids, logprobs within LOGPROB_ATOL) while at least half of the live layer-KV is on host and
    pages are fetched. Negative control: the same engine with one written-back host page of layer 3
    perturbed per step (the test-only fault injector) no longer matches."""
    prompts = list(PROMPTS[:4])
    stats, flag = tmp_path / "pool_stats.jsonl", tmp_path / "corrupt"
    layered_env = {POOL_STATS_FILE_ENV: str(stats), "PYTHONPATH": str(FAULT_INJECT_DIR),
                   "KVPLANE_TEST_CORRUPT_LAYER": "3", "KVPLANE_TEST_CORRUPT_FILE": str(flag)}
    runs = {"stock": _start("stock", tiny_model_dir, prompts, {}, tmp_path / "stock.log"),
            "layered": _start("layered", tiny_model_dir, prompts, layered_env, tmp_path / "layered.log")}
    stock, layered = (_result(runs[name], tmp_path / f"{name}.log") for name in ("stock", "layered"))
    assert layered["args"] == {"radix_cache_backend": "layered", "disable_overlap_schedule": True,
                               "attention_backend": "torch_native"}
    assert layered["env_restored"]
    assert layered["launch_command"].startswith("layered_engine(model_path=") and "enable_layered_kv=True" in \
        layered["launch_command"]  # how it was asked for, as Engine records "Engine(...)"
    assert layered["server_info"] == {"launch_command": layered["launch_command"], "custom_sigquit_handler": None}
    assert layered["stock_after"] == "accepted"  # kvplane's request checks left with the engine
    for prompt, got, want in zip(prompts, layered["clean"], stock["clean"], strict=True):
        assert _same(got, want), (prompt, got, want)
    assert not all(_same(got, want) for got, want in zip(layered["armed"], stock["clean"], strict=True))
    steps = [s for s in read_jsonl(stats) if s["live_layer_pages"] > 0]
    assert len(steps) >= len(prompts) * NEW_TOKENS // 2
    assert sum(s["host_layer_pages"] for s in steps) / sum(s["live_layer_pages"] for s in steps) >= 0.5
    assert steps[-1]["fetched_layer_pages_total"] > steps[0]["fetched_layer_pages_total"]


def test_a_refusal_in_the_scheduler_process_is_a_value_error_and_the_caller_goes_on(tiny_model_dir, tmp_path):
    """A launch kvplane refuses only in the scheduler process (``kv_recompute_ratio`` with every
    layer of the 48-token slot space on the device: SGLang sizes the slot space there) raises
    kvplane's ``ValueError`` in the caller, whose process goes on: no process of the failed start
    left running, no ``KVPLANE_*`` variable or failure file left, and a stock engine started after
    it generates what a stock engine in a fresh process does. The refusal is made twice, and the
    garbage collection after them returns (the failed starts' zmq sockets closed: it hung before;
    the control is ``test_engine_start_watch.py``'s). Negative control: with the start
    watch switched off (SGLang's own ``SIGQUIT`` handler, as before session 84), the same launch
    kills the caller's process (no result line)."""
    prompts, tmp = list(PROMPTS[:1]), tmp_path / "refused-tmp"
    tmp.mkdir()
    runs = {mode: _start(mode, tiny_model_dir, prompts, {"TMPDIR": str(tmp if mode == "refused" else tmp_path)},
                         tmp_path / f"{mode}.log")
            for mode in ("refused", "stock", "refused_unwatched")}  # at once: each mostly waits on its start
    refused, stock = (_result(runs[mode], tmp_path / f"{mode}.log") for mode in ("refused", "stock"))
    kind, message = refused["refusal"]
    assert kind == "ValueError" and message.startswith("kvplane: --kv-recompute-ratio=0.5: ") and \
        "every layer of this launch's slot space (48 tokens) is on the device" in message, message
    assert refused["children_left"] == [] and refused["env_left"] == []
    assert refused["other_child_alive"]  # a child of the caller's own, started during the start, is not stopped
    assert not list(tmp.glob("kvplane-engine-start-*"))
    assert _same(refused["stock_after"], stock["clean"][0])
    assert runs["refused_unwatched"].wait(timeout=600) != 0
    assert result_line((tmp_path / "refused_unwatched.log").read_text()) is None


def test_a_detokenizer_that_fails_to_start_fails_the_start(tiny_model_dir, tmp_path):
    """SGLang's detokenizer that fails to start sends ``SIGQUIT`` and exits 0 while the schedulers
    start and report ready (stock SGLang then kills the caller's process; nothing else notices):
    ``layered_engine`` raises, with no process of the engine left (the caller's own child kept).
    Negative control: with the watch's check of a ``SIGQUIT`` during
    the start switched off, the engine is returned (it would hang on its first request: found in
    session 84's review)."""
    prompts, tmp = list(PROMPTS[:1]), tmp_path / "failed-tmp"
    tmp.mkdir()
    runs = {mode: _start(mode, tiny_model_dir, prompts,
                         {"TMPDIR": str(tmp if mode == "refused_detokenizer" else tmp_path)}, tmp_path / f"{mode}.log")
            for mode in ("refused_detokenizer", "refused_detokenizer_unchecked")}
    failed, control = (_result(runs[mode], tmp_path / f"{mode}.log") for mode in runs)
    kind, message = failed["refusal"]
    assert kind == "RuntimeError" and message.startswith("a process of the engine failed during its start"), message
    assert failed["children_left"] == [] and failed["env_left"] == [] and failed["other_child_alive"]
    assert not list(tmp.glob("kvplane-engine-start-*"))
    assert "stock_after" not in failed  # a stock engine after a failed start: the refusal's test
    assert control["refusal"] is None and control["children_left"]  # the engine returned, its scheduler up


_REFUSALS = """
import json, os
from pathlib import Path
from sglang_ext.offline_engine import layered_server_args
before = sorted(k for k in os.environ if k.startswith("KVPLANE_"))
out = {}
for name, kwargs in {"bad_option": {"kv_scheduler": "sjf"}, "unknown": {"no_such_option": 1},
                     "launcher_only": {"config": "/nonexistent.yaml"},
                     "path_option": {"kv_profile": Path("/nonexistent-kvplane-dir/profile.json")},
                     "lora_recompute": {"kv_recompute_ratio": 0.5, "enable_lora": True, "max_lora_rank": 8,
                                        "lora_target_modules": ["q_proj"]},
                     "lora": {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]},
                     "routed_recompute": {"kv_recompute_ratio": 0.5, "enable_return_routed_experts": True},
                     "no_model": None, "good": {}}.items():
    try:
        if kwargs is None:
            layered_server_args(enable_layered_kv=True)
        else:
            args = layered_server_args(model_path=MODEL, device="cpu", enable_layered_kv=True, **kwargs)
            out[name] = ["ok", args.radix_cache_backend]
            continue
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]
out["env_unchanged"] = sorted(k for k in os.environ if k.startswith("KVPLANE_")) == before
print("RESULT " + json.dumps(out))
"""


def test_the_offline_engines_options_are_refused_as_the_launchers_are(tiny_model_dir):
    """A bad kvplane option is the launcher's refusal as a ``ValueError`` (the caller's process
    goes on; a path-like option is read as its path); an argument that is neither a ``ServerArgs``
    field nor kvplane's (the launcher's own ``config`` too), and a missing ``model_path``, are
    ``TypeError``s, as ``sgl.Engine`` raises them; ``--kv-recompute-ratio`` with LoRA is refused
    (session 85). Control: good options (LoRA alone too) build the record with the implied
    layered radix cache, and leave no exported variable behind."""
    proc = subprocess.run([sys.executable, "-c", _REFUSALS.replace("MODEL", repr(str(tiny_model_dir)))],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    out = result_line(proc.stdout)
    assert proc.returncode == 0 and out is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert out["bad_option"] == ["ValueError", "kvplane: invalid launch option: --kv-scheduler='sjf' is invalid; "
                                               "allowed: fcfs, layerkv, lvf"]
    assert out["unknown"][0] == "TypeError" and "no_such_option" in out["unknown"][1]
    assert out["launcher_only"][0] == "TypeError" and "config" in out["launcher_only"][1]  # no ServerArgs field
    assert out["path_option"] == ["ValueError", "kvplane: invalid launch option: "
                                                "--kv-profile='/nonexistent-kvplane-dir/profile.json': no such file"]
    assert out["no_model"][0] == "TypeError" and "model_path" in out["no_model"][1]
    kind, message = out["lora_recompute"]  # eLLM's recompute with LoRA (rebuilt with the base weights)
    assert kind == "ValueError" and message.startswith(
        "kvplane: --kv-recompute-ratio=0.5: eLLM's recompute cannot run in LlamaForCausalLM's forward (LoRA "
        "adapters are served (--enable-lora)") and "drop the flag" in message, message
    assert out["lora"] == ["ok", "layered"]  # LoRA alone is served (test_lora_server.py)
    kind, message = out["routed_recompute"]  # the MoE capture's buffer: the recompute rows overran it
    assert kind == "ValueError" and "(--enable-return-routed-experts records" in message, message
    assert out["good"] == ["ok", "layered"]
    assert out["env_unchanged"]  # the record alone: the parse's exports put back
