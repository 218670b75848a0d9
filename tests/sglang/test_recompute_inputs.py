"""eLLM's recompute rows rebuild a prefix's KV from its token ids and 1-D positions
(``RecomputeForward.augment``); where SGLang's ``ModelConfig`` says those do not rebuild it, the
rows are not offered and ``--kv-recompute-ratio`` is refused at start.

Scenario: a multimodal model (Qwen2-VL) embeds its image tokens from the image, the ids in the
prompt being placeholders, so a recomputed prefix holding an image was wrong KV, silently; an
M-RoPE model rotates by the 3-D ``forward_batch.mrope_positions``, which the rows did not extend.
Requests that asked for recompute there fetch their prefix instead (``recompute_ok`` False: the
plan's and a request's ``kvplane_recompute_ratio`` are not taken).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from sglang_ext.testing.server import ServerError
from tests.sglang.conftest import OFFLOAD_LAYERED, running_servers

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "intermediate_size": 64, "torch_dtype": "bfloat16"}
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}
CONFIGS = {
    "qwen2_vl": {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
                 "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                 "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
                 "image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252},
    "llama_mrope": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_scaling": MROPE},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
}


def _config(root: Path, name: str, extra: dict[str, Any] | None = None, **kwargs) -> Any:
    """SGLang's ``ModelConfig`` of a checkpoint with ``CONFIGS[name]`` (and ``extra``) written under ``root``."""
    from sglang.srt.configs.model_config import ModelConfig

    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**BASE, **CONFIGS[name], **(extra or {})}))
    return ModelConfig(str(path), **kwargs)


def _reason(root: Path, name: str, **kwargs) -> str | None:
    from sglang_ext.recompute_forward import RecomputeForward

    return RecomputeForward.inputs_reason(_config(root, name, **kwargs))


def test_multimodal_and_mrope_models_take_no_recompute_rows(tmp_path):
    """SGLang's own ``ModelConfig`` of a Qwen2-VL checkpoint is multimodal (and M-RoPE): no
    recompute rows, naming why; a text model with M-RoPE positions neither. Controls: a Llama, and
    Qwen2-VL served text-only (``--language-model-only``: SGLang then embeds no media and computes
    no M-RoPE positions), take them."""
    assert "multimodal model" in _reason(tmp_path, "qwen2_vl")
    assert "M-RoPE" in _reason(tmp_path, "llama_mrope")
    assert _reason(tmp_path, "llama") is None
    assert _reason(tmp_path, "qwen2_vl", language_model_only=True) is None


def test_no_recompute_rows_with_lora_adapters(tmp_path):
    """With LoRA adapters served, SGLang maps the batch's rows to their adapters before the rows
    are appended, which then rebuilt an adapter's prefix KV with the base weights (wrong tokens,
    session 85): no rows, and ``--kv-recompute-ratio`` refused at the parse, naming ``--enable-lora``
    (``--lora-paths`` alone counts, as SGLang reads it). Controls: the same launch without LoRA,
    ``--enable-lora`` false, and a ratio of 0."""
    from types import SimpleNamespace

    from sglang_ext.recompute_forward import RecomputeForward

    config = _config(tmp_path, "llama")
    assert RecomputeForward.inputs_reason(config) is None
    assert "--enable-lora" in RecomputeForward.inputs_reason(config, lora=True)
    for on in (SimpleNamespace(enable_lora=True, lora_paths=None), SimpleNamespace(enable_lora=None, lora_paths=["A=/a"])):
        refusal = RecomputeForward.launch_refusal(config, 0.5, on)
        assert refusal is not None and refusal.startswith("--kv-recompute-ratio=0.5: ") and "--enable-lora" in refusal
        assert RecomputeForward.launch_refusal(config, 0.0, on) is None
    for off in (None, SimpleNamespace(enable_lora=False, lora_paths=["A=/a"]), SimpleNamespace(enable_lora=None, lora_paths=None)):
        assert RecomputeForward.launch_refusal(config, 0.5, off) is None



def test_no_recompute_rows_where_sglang_sets_per_row_moe_state(tmp_path):
    """SGLang's MoE top-k capture (``--enable-return-routed-experts``, ``--enable-return-indexer-topk``)
    writes every forward row's choice into a buffer sized for its own batches: the recompute rows
    overran it and the scheduler raised, dropping every request (session 85's review, on a tiny
    Mixtral); expert parallelism masks the experts of rows past SGLang's own. Each is a reason
    (no rows; the flag refused at the parse, naming the flag). Controls: each off, or ``ep_size`` 1."""
    from types import SimpleNamespace

    from sglang_ext.recompute_forward import RecomputeForward

    config = _config(tmp_path, "llama")
    assert RecomputeForward.inputs_reason(config) is None
    off = {"enable_lora": False, "enable_return_routed_experts": False, "enable_return_indexer_topk": False,
           "ep_size": 1}
    assert RecomputeForward.launch_refusal(config, 0.5, SimpleNamespace(**off)) is None
    for field, value, named in (("enable_return_routed_experts", True, "--enable-return-routed-experts"),
                                ("enable_return_indexer_topk", True, "--enable-return-indexer-topk"),
                                ("ep_size", 2, "--ep-size")):
        args = SimpleNamespace(**{**off, field: value})
        assert named in RecomputeForward.inputs_reason(config, args)
        refusal = RecomputeForward.launch_refusal(config, 0.5, args)
        assert refusal is not None and refusal.startswith("--kv-recompute-ratio=0.5: ") and named in refusal


def test_no_recompute_rows_where_the_embedding_hashes_per_request_history(tmp_path):
    """LongCat's n-gram embedding (``use_ngram_embedding``) and Engram layers (``engram_layer_ids``)
    hash each token's n-gram history per request, over SGLang's own rows only (``NgramEmbedding``
    loops over ``ngram_embedding_info``'s requests; the Engram hasher indexes ``req_pool_indices``):
    a recompute row's embedding would be stale (session 86, from the code: neither model runs on
    this host). SGLang's own ``ModelConfig`` of a checkpoint with either key is a reason, and the
    flag is refused at the parse. Control: the same checkpoint with the key off."""
    from sglang_ext.recompute_forward import RecomputeForward

    for name, on, off in (("ngram", {"use_ngram_embedding": True, "ngram_embedding_n": 3}, {"use_ngram_embedding": False}),
                          ("engram", {"engram_layer_ids": [1]}, {"engram_layer_ids": []})):
        config = _config(tmp_path / name, "llama", on)
        assert "n-gram history per request" in (RecomputeForward.inputs_reason(config) or ""), name
        refusal = RecomputeForward.launch_refusal(config, 0.5)
        assert refusal is not None and refusal.startswith("--kv-recompute-ratio=0.5: ") and "n-gram" in refusal
        assert RecomputeForward.launch_refusal(config, 0.0) is None
        assert RecomputeForward.inputs_reason(_config(tmp_path / f"{name}-off", "llama", off)) is None


def test_an_mrope_server_refuses_the_recompute_flag_at_start(tiny_model_dir, launch_zygote, tmp_path):
    """The tiny Llama with M-RoPE positions in its config (SGLang computes ``mrope_positions`` for
    it) and ``--kv-recompute-ratio``: the launcher refuses it at its parse (no scheduler started),
    its one line naming the flag, the reason and the way out. The same flag on the plain tiny Llama is served
    (``test_recompute_server.py``, the control)."""
    model = tmp_path / "mrope-llama"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": MROPE}))
    spec = (tmp_path, [*OFFLOAD_LAYERED, "--kv-recompute-ratio", "0.5"], None)
    with pytest.raises(ServerError), running_servers(model, [spec], zygote=launch_zygote):
        pass
    log = (tmp_path / "server.log").read_text()
    assert ("kvplane: --kv-recompute-ratio=0.5: eLLM's recompute cannot run in LlamaForCausalLM's forward (its "
            "rotary embedding reads M-RoPE's 3-D positions") in log, log[-3000:]
    assert "drop the flag" in log
    assert "Scheduler hit an exception" not in log  # refused by the launcher's parse, before any weight loads
