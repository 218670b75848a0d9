"""Test-only driver of SGLang's offline engine (run as a script by ``test_offline_engine.py``: the
engine's process loads SGLang's plugins and applies their hooks, which must not happen in the
test process).

``python tests/sglang/engine_driver.py MODE MODEL_DIR PROMPTS_JSON NEW_TOKENS`` prints one
``RESULT {...}`` line: each prompt's greedy output ids and logprobs. ``MODE`` ``stock``:
``sgl.Engine`` with SGLang's defaults; ``layered``: :func:`sglang_ext.offline_engine.layered_engine`
with ``enable_layered_kv=True`` and a device KV budget of one layer of the 48-token slot space
(most KV on host), then, with the test-only fault injector's flag file (``KVPLANE_TEST_CORRUPT_FILE``)
created and the prefix cache flushed, the same prompts again (``armed``: the negative control),
plus the options the engine ran with and whether the parse's exports were put back; after its
``shutdown()`` a stock ``sgl.Engine`` in the same process, sent a ``kvplane_slo_tbt_ms`` kvplane
would refuse (``stock_after``: SGLang's answer, not kvplane's). ``refused``: a layered engine that
kvplane refuses in its scheduler process (twice, then a garbage collection, which must return),
then (the process alive) the child processes left, the ``KVPLANE_*`` variables left, and a stock
engine's greedy output for the first prompt;
``refused_unwatched``: the same with the engine's start watch switched off (the negative control);
``refused_detokenizer``: a layered engine whose detokenizer fails to start (the schedulers start),
``refused_detokenizer_unchecked`` the same with the watch's check of it switched off (the control:
the engine is returned, and the driver exits at once).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

COMMON = {"device": "cpu", "max_total_tokens": 48, "dtype": "float32", "random_seed": 0}


def _generate(engine, prompts: list[str], new_tokens: int) -> list[dict]:  # noqa: ANN001
    outs = engine.generate(prompts, {"max_new_tokens": new_tokens, "temperature": 0.0}, return_logprob=True)
    return [{"ids": out["output_ids"], "logprobs": [e[0] for e in out["meta_info"]["output_token_logprobs"]]}
            for out in outs]


def _live_children() -> list[int]:
    import psutil  # installed with SGLang

    alive = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not any("resource_tracker" in a for a in child.cmdline()):
                alive.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def failing_detokenizer(server_args, port_args):  # noqa: ANN001, ANN201 (spawned by SGLang: picklable)
    """SGLang's detokenizer process with its manager's ``__init__`` raising: it sends ``SIGQUIT``
    to the engine's process and exits 0, while the schedulers start and report ready."""
    from sglang.srt.managers import detokenizer_manager

    def fail(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise RuntimeError("detokenizer start failed (injected)")

    detokenizer_manager.DetokenizerManager.__init__ = fail
    return detokenizer_manager.run_detokenizer_process(server_args, port_args)


def _refused(mode: str, model: str, prompts: list[str], new_tokens: int) -> dict:
    """A launch kvplane refuses in the scheduler process (eLLM's recompute with every layer on the
    device: the slot space is sized there) -- or, ``refused_detokenizer``, a detokenizer that fails
    to start -- then (``refused``) a stock engine in the same process. Right after the watch's snapshot of this
    process's children, another child (``sleep``) is started, as another thread of the caller would."""
    import subprocess

    from sglang_ext import offline_engine
    from sglang_ext.engine_start_watch import EngineStartWatch

    if mode == "refused_unwatched":  # the negative control: the start unwatched, as before session 84
        offline_engine._watch = lambda server_args: None
    if mode == "refused_detokenizer_unchecked":  # the negative control: started() as before the review
        EngineStartWatch.started = lambda self: True
    from sglang.srt.entrypoints.engine import Engine

    kwargs, detokenizer = {"kv_recompute_ratio": 0.5}, Engine.__dict__["run_detokenizer_process_func"]
    if mode.startswith("refused_detokenizer"):
        Engine.run_detokenizer_process_func = staticmethod(failing_detokenizer)
        kwargs = {"kv_gpu_budget_tokens": 49}
    snapshot, other = EngineStartWatch.before_start.__func__, []

    def before_start_then_child(cls, failure_file):  # noqa: ANN001, ANN202
        watch = snapshot(cls, failure_file)
        other.append(subprocess.Popen(["sleep", "120"]))
        return watch

    EngineStartWatch.before_start = classmethod(before_start_then_child)
    result: dict = {}
    try:
        if mode == "refused":  # a refused start before this one: the next collection must return
            try:
                offline_engine.layered_engine(model_path=model, enable_layered_kv=True, **kwargs, **COMMON)
            except ValueError:
                first = other.pop()
                first.kill()
                first.wait()
        offline_engine.layered_engine(model_path=model, enable_layered_kv=True, **kwargs, **COMMON)
        result["refusal"] = None
        result["children_left"] = _live_children()
        print("RESULT " + json.dumps(result), flush=True)  # returned: the control's answer (it would hang)
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
        os._exit(0)
    except Exception as exc:
        result["refusal"] = [type(exc).__name__, str(exc)]
    import gc
    import threading

    alarm = threading.Timer(60, lambda: (print("the collection hung", flush=True), os._exit(3)))
    alarm.start()
    gc.collect()  # two refused starts' sockets in it (session 84: this hung)
    alarm.cancel()
    Engine.run_detokenizer_process_func = detokenizer  # SGLang's again, for the stock engine after
    result["other_child_alive"] = bool(other) and other[0].poll() is None
    for proc in other:
        proc.kill()
        proc.wait()
    result["children_left"] = _live_children()
    result["env_left"] = sorted(k for k in os.environ if k.startswith("KVPLANE_"))
    if mode == "refused":
        import sglang as sgl

        engine = sgl.Engine(model_path=model, **COMMON)
        result["stock_after"] = _generate(engine, prompts[:1], new_tokens)[0]
        engine.shutdown()
    return result


def main() -> None:
    mode, model, prompts, new_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    result: dict = {}
    if mode.startswith("refused"):
        print("RESULT " + json.dumps(_refused(mode, model, prompts, new_tokens)), flush=True)
        return
    if mode == "stock":
        import sglang as sgl

        engine = sgl.Engine(model_path=model, **COMMON)
        result["clean"] = [_generate(engine, [p], new_tokens)[0] for p in prompts]
    else:
        from sglang_ext.offline_engine import layered_engine

        engine = layered_engine(model_path=model, enable_layered_kv=True, kv_gpu_budget_tokens=49, **COMMON)
        result["env_restored"] = "KVPLANE_LAYERED_KV_ARGS" not in os.environ
        result["launch_command"] = engine.server_args.launch_command
        info = json.loads(json.dumps(engine.get_server_info()))  # JSON, as a stock engine's
        result["server_info"] = {"launch_command": info["launch_command"],
                                 "custom_sigquit_handler": info["custom_sigquit_handler"]}
        args = engine.server_args
        result["args"] = {"radix_cache_backend": args.radix_cache_backend,
                          "disable_overlap_schedule": args.disable_overlap_schedule,
                          "attention_backend": args.attention_backend}
        result["clean"] = [_generate(engine, [p], new_tokens)[0] for p in prompts]
        flag = Path(os.environ["KVPLANE_TEST_CORRUPT_FILE"])
        flag.touch()
        try:
            engine.flush_cache()
            result["armed"] = [_generate(engine, [p], new_tokens)[0] for p in prompts]
        finally:
            flag.unlink()
        engine.shutdown()  # kvplane's options in this process go with it: a stock engine after it
        import sglang as sgl  # has no kvplane request checks (a bad SLO override is SGLang's to ignore)

        engine = sgl.Engine(model_path=model, **COMMON)
        try:
            engine.generate(prompts[0], {"max_new_tokens": 2, "custom_params": {"kvplane_slo_tbt_ms": -5}})
            result["stock_after"] = "accepted"
        except ValueError as exc:
            result["stock_after"] = f"ValueError: {exc}"
    engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
