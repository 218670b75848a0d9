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
would refuse (``stock_after``: SGLang's answer, not kvplane's).
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


def main() -> None:
    mode, model, prompts, new_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    result: dict = {}
    if mode == "stock":
        import sglang as sgl

        engine = sgl.Engine(model_path=model, **COMMON)
        result["clean"] = [_generate(engine, [p], new_tokens)[0] for p in prompts]
    else:
        from sglang_ext.offline_engine import layered_engine

        engine = layered_engine(model_path=model, enable_layered_kv=True, kv_gpu_budget_tokens=49, **COMMON)
        result["env_restored"] = "KVPLANE_LAYERED_KV_ARGS" not in os.environ
        result["launch_command"] = engine.server_args.launch_command
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
