"""LaunchDecision: what --enable-layered-kv implies for SGLang's options, or the refusal naming one.

SGLang-free (the values are SGLang's option names as ``vars(namespace)`` holds them);
``test_launch_validation.py`` runs the real launcher on a few of these."""

from __future__ import annotations

import argparse

import pytest

from sglang_ext.launch_decision import TORCH_COMPILE_NOTE, LaunchDecision, LaunchRefused

STOCK = {
    "device": None, "attention_backend": None, "decode_attention_backend": None,
    "prefill_attention_backend": None, "cuda_graph_config": None, "cuda_graph_backend_decode": None,
    "cuda_graph_backend_prefill": None, "kv_cache_dtype": "auto", "speculative_algorithm": None,
    "pp_size": 1, "enable_hierarchical_cache": False, "disaggregation_mode": "null",
    "disable_overlap_schedule": False, "disable_cuda_graph": False, "page_size": None,
    "chunked_prefill_size": None, "enable_dp_attention": False, "attn_dp_size": 1, "dp_size": 1,
    "enable_two_batch_overlap": False, "enable_lmcache": False, "enable_flexkv": False,
    "enable_unified_cache_external_linker": False, "enable_session_radix_cache": False,
    "enable_streaming_session": False, "enable_memory_saver": False, "enable_pdmux": False,
    "enable_prefill_cp": False, "enable_mis": False, "enable_deterministic_inference": False,
    "dcp_size": 1, "attn_cp_size": 1, "kv_canary": "none", "tokenizer_worker_num": 1,
    "rl_on_policy_target": None, "smg_grpc_mode": False, "grpc_mode": False, "radix_eviction_policy": "lru",
    "enable_torch_compile": False, "tp_size": 1, "dllm_algorithm": None,
}
"""SGLang 0.5.23's parsed defaults for these options (checked against the real parser in
``test_stock_values_are_sglang_defaults``)."""


KVPLANE_STOCK = {"kv_cuda_graphs": "off", "kv_overlap_schedule": "off"}
"""kvplane's own options the decision reads (``LayeredKVArgs``' defaults)."""


def _decide(**changes):
    return LaunchDecision.decide({**STOCK, **KVPLANE_STOCK, **changes})


def test_stock_values_are_sglang_defaults():
    from sglang_ext import compat

    parser = argparse.ArgumentParser()
    compat.resolve(compat.SERVER_ARGS.path).add_cli_args(parser)
    parsed = vars(parser.parse_args(["--model-path", "m"]))
    assert {k: parsed[k] for k in STOCK} == STOCK


def test_sglang_defaults_on_a_gpu_get_the_layered_flashinfer_backend_and_no_graphs():
    """With SGLang's defaults on CUDA (where it would pick fa3 on Hopper) the server starts on the
    layered FlashInfer decode, capture off, overlap loop off -- said in the notes."""
    d = _decide()
    assert d.device == "cuda"
    assert dict(d.implied) == {
        "attention_backend": "flashinfer", "cuda_graph_backend_decode": "disabled",
        "cuda_graph_backend_prefill": "disabled", "page_size": 16, "disable_overlap_schedule": True,
    }
    assert len(d.notes) == 4 and "flashinfer" in d.notes[0] and "--page-size 16" in d.notes[2]
    ns = argparse.Namespace(**STOCK)
    d.apply(ns)
    assert ns.attention_backend == "flashinfer" and ns.cuda_graph_backend_decode == "disabled"
    assert ns.page_size == 16


def test_an_explicit_page_size_is_kept_and_cpu_keeps_sglangs_default():
    assert "page_size" not in dict(_decide(page_size=1).implied)  # an explicit 1 too
    assert "page_size" not in dict(_decide(page_size=64).implied)
    assert "page_size" not in dict(_decide(device="cpu").implied)
    assert dict(_decide(page_size=None).implied)["page_size"] == 16  # control: unset on CUDA
    # SGLang asserts chunked_prefill_size % page_size == 0: a chunk that is not whole pages of 16
    # keeps SGLang's page size (said), one that is gets 16
    d = _decide(chunked_prefill_size=1000)
    assert "page_size" not in dict(d.implied) and any("--chunked-prefill-size 1000" in n for n in d.notes)
    assert dict(_decide(chunked_prefill_size=8192).implied)["page_size"] == 16


def test_cpu_gets_torch_native_and_explicit_choices_are_kept():
    assert dict(_decide(device="cpu").implied)["attention_backend"] == "torch_native"
    d = _decide(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                disable_overlap_schedule=True)
    assert d.implied == () and d.notes == ()  # negative control: nothing to imply, nothing said
    d = _decide(attention_backend="torch_native", cuda_graph_backend_decode="disabled", page_size=16)
    assert dict(d.implied) == {"cuda_graph_backend_prefill": "disabled", "disable_overlap_schedule": True}


def test_torch_compile_is_said_to_do_nothing_without_graph_runners():
    """SGLang compiles inside its graph runners only; the layered pool runs without them, so the
    flag is served (nothing breaks) and the launch says it has no effect -- on CUDA and on a CPU,
    also where the caller turned graphs off already."""
    for changes in ({}, {"device": "cpu"}, {"device": "cpu", "disable_cuda_graph": True,
                                             "attention_backend": "torch_native"}):
        d = _decide(enable_torch_compile=True, **changes)
        assert TORCH_COMPILE_NOTE in d.notes, changes
        assert "enable_torch_compile" not in dict(d.implied)
        assert TORCH_COMPILE_NOTE not in _decide(**changes).notes  # control: not given, not said
    assert "--enable-torch-compile" in TORCH_COMPILE_NOTE and "no effect" in TORCH_COMPILE_NOTE


GRAPHS_ON = {"kv_cuda_graphs": "on", "attention_backend": "triton"}


def test_kv_cuda_graphs_on_keeps_decode_graphs_for_the_triton_decode():
    """--kv-cuda-graphs on: SGLang's decode graphs stay (nothing implied for them), prefill graphs
    off, said in the line; with graphs off (the control) both are turned off."""
    d = _decide(**GRAPHS_ON)
    assert "cuda_graph_backend_decode" not in dict(d.implied)
    assert dict(d.implied)["cuda_graph_backend_prefill"] == "disabled"
    assert any("decode CUDA graphs kept" in n and "not yet validated on a GPU" in n for n in d.notes)
    assert _decide(**GRAPHS_ON, cuda_graph_backend_decode="full").implied == d.implied  # SGLang's full: kept
    assert any("no effect here" in n for n in _decide(**GRAPHS_ON, device="cpu").notes)
    off = _decide(attention_backend="triton")
    assert dict(off.implied)["cuda_graph_backend_decode"] == "disabled"
    assert not any("kept" in n for n in off.notes)


def test_kv_cuda_graphs_on_serves_the_layered_flashinfer_decode_kvplanes_choice_on_cuda():
    """On CUDA with no ``--attention-backend`` kvplane picks the layered FlashInfer decode, and
    ``--kv-cuda-graphs on`` keeps decode graphs for it (``test_graph_server.py``'s FlashInfer
    server), the line naming it; so for ``--attention-backend flashinfer`` named. Control: Triton
    named, the line names Triton."""
    for given in (None, "flashinfer"):
        d = _decide(kv_cuda_graphs="on", attention_backend=given)
        assert dict(d.implied).get("attention_backend") == (None if given else "flashinfer")
        assert "cuda_graph_backend_decode" not in dict(d.implied)
        assert any("decode CUDA graphs kept (--kv-cuda-graphs on, flashinfer)" in n for n in d.notes), d.notes
    assert any("(--kv-cuda-graphs on, triton)" in n for n in _decide(**GRAPHS_ON).notes)


def test_kv_cuda_graphs_on_with_the_overlap_loop_forced_off_is_served():
    _decide(**GRAPHS_ON, kv_overlap_schedule="on", disable_overlap_schedule=True)


def test_kv_cuda_graphs_on_with_the_overlap_loop_is_served_and_says_sampled_steps_run_eagerly():
    """``--kv-overlap-schedule on`` with decode graphs (``test_graph_server.py``'s overlap server);
    the launch line says the timer's sampled steps run eagerly. Control: with the loop forced off
    it does not."""
    on = _decide(**GRAPHS_ON, kv_overlap_schedule="on")
    assert any("sampled steps run eagerly" in n for n in on.notes), on.notes
    off = _decide(**GRAPHS_ON, kv_overlap_schedule="on", disable_overlap_schedule=True)
    assert not any("sampled steps run eagerly" in n for n in off.notes)


def test_kv_cuda_graphs_on_with_tensor_parallelism_is_served_and_says_the_ranks_agree():
    """``--tp-size 2`` with decode graphs (``test_tp_graph_server.py`` serves it); the launch line
    says every rank must admit a replay. Control: at TP 1 the line does not."""
    tp2 = _decide(**GRAPHS_ON, tp_size=2)
    assert any("the 2 TP ranks replay a step only when all of them admit it" in n for n in tp2.notes), tp2.notes
    assert not any("TP ranks" in n for n in _decide(**GRAPHS_ON).notes)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"attention_backend": "torch_native"}, "--kv-cuda-graphs on with --attention-backend torch_native: "
                                                "only the layered paged decodes (triton and flashinfer)"),
        ({"attention_backend": None, "device": "cpu"},
         "--kv-cuda-graphs on with --attention-backend torch_native (kvplane's choice on cpu: none given)"),
        ({"decode_attention_backend": "torch_native"}, "with --decode-attention-backend torch_native: "),
        ({"prefill_attention_backend": "torch_native"}, "--prefill-attention-backend torch_native with "),
        ({"disable_cuda_graph": True}, "--kv-cuda-graphs on with --disable-cuda-graph"),
        ({"enable_torch_compile": True}, "--kv-cuda-graphs on with --enable-torch-compile"),
        ({"cuda_graph_backend_decode": "breakable"}, "--cuda-graph-backend-decode breakable"),
        ({"cuda_graph_backend_decode": "disabled"}, "--cuda-graph-backend-decode disabled: turns decode graphs off"),
        ({"cuda_graph_backend_prefill": "breakable"}, "--cuda-graph-backend-prefill breakable"),
    ],
)
def test_kv_cuda_graphs_on_refuses_what_it_cannot_capture(changes, names):
    with pytest.raises(LaunchRefused) as err:
        _decide(**{**GRAPHS_ON, **changes})
    assert names in str(err.value)
    try:  # control: with decode graphs off the same option is served, or refused for another reason
        _decide(**changes)
    except LaunchRefused as other:
        assert str(other) != str(err.value)


def test_on_rocm_the_default_is_the_layered_triton_backend_and_flashinfer_is_refused_by_name():
    """A ROCm torch build has no FlashInfer: with SGLang's defaults kvplane picks ``triton`` there
    (said in the note), and a FlashInfer backend named by any of the three flags is refused with a
    message naming FlashInfer, ROCm and what to use. Controls: the same options on a CUDA build
    (``rocm=False``) take and accept ``flashinfer``; ``--device cpu`` on a ROCm build is the CPU's."""
    values = {**STOCK, **KVPLANE_STOCK}
    rocm = LaunchDecision.decide(values, rocm=True)
    assert dict(rocm.implied)["attention_backend"] == "triton"
    assert rocm.notes[0].startswith("--attention-backend triton (layered; FlashInfer is NVIDIA-only)")
    assert dict(LaunchDecision.decide(values).implied)["attention_backend"] == "flashinfer"
    for name, flag in (("attention_backend", "--attention-backend"),
                       ("decode_attention_backend", "--decode-attention-backend"),
                       ("prefill_attention_backend", "--prefill-attention-backend")):
        with pytest.raises(LaunchRefused) as refused:
            LaunchDecision.decide({**values, name: "flashinfer"}, rocm=True)
        assert str(refused.value) == (
            f"{flag} flashinfer: FlashInfer runs on NVIDIA GPUs only and this torch is a ROCm build; on ROCm "
            "use triton or torch_native (or leave it unset: kvplane picks triton)")
        LaunchDecision.decide({**values, name: "flashinfer"})  # control: a CUDA build
    assert dict(LaunchDecision.decide({**values, "attention_backend": "torch_native"}, rocm=True).implied).get(
        "attention_backend") is None
    with pytest.raises(LaunchRefused, match="--attention-backend aiter reads SGLang's flat KV buffers.*on ROCm "
                                            "use triton or torch_native"):
        LaunchDecision.decide({**values, "attention_backend": "aiter"}, rocm=True)
    cpu = LaunchDecision.decide({**values, "device": "cpu"}, rocm=True)
    assert dict(cpu.implied)["attention_backend"] == "torch_native"
    graphs = LaunchDecision.decide({**values, "kv_cuda_graphs": "on"}, rocm=True)  # triton by default there
    assert dict(graphs.implied)["attention_backend"] == "triton"
    cuda = LaunchDecision.decide({**values, "kv_cuda_graphs": "on"})  # control: CUDA's default
    assert dict(cuda.implied)["attention_backend"] == "flashinfer"
    with pytest.raises(LaunchRefused, match="with --attention-backend torch_native: only the layered paged"):
        LaunchDecision.decide({**values, "kv_cuda_graphs": "on", "attention_backend": "torch_native"}, rocm=True)


def test_kv_overlap_schedule_on_keeps_sglangs_overlap_loop_and_says_so():
    """``--kv-overlap-schedule on``: nothing implies ``--disable-overlap-schedule``, the note says
    the loop is kept (and, on CUDA, not yet GPU-validated); ``off`` (the default) implies it."""
    on = _decide(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, kv_overlap_schedule="on")
    assert on.implied == () and on.notes == ("SGLang's overlap scheduler kept (--kv-overlap-schedule on)",)
    gpu = _decide(attention_backend="flashinfer", page_size=16, kv_overlap_schedule="on")
    assert "disable_overlap_schedule" not in dict(gpu.implied)
    assert any("not yet validated on a GPU" in note for note in gpu.notes)
    with pytest.raises(LaunchRefused, match="--kv-overlap-schedule on: not supported on ROCm"):
        LaunchDecision.decide({"attention_backend": "triton", "page_size": 16, "kv_overlap_schedule": "on"},
                              rocm=True)
    assert LaunchDecision.decide({"attention_backend": "triton", "page_size": 16}, rocm=True).implied  # off: fine
    off = _decide(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, kv_overlap_schedule="off")
    assert off.implied == (("disable_overlap_schedule", True),)  # negative control: the default
    assert "--kv-overlap-schedule on keeps" in off.notes[0]


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"attention_backend": "fa3"}, "--attention-backend fa3"),
        ({"attention_backend": "flex_attention"}, "--attention-backend flex_attention"),
        ({"decode_attention_backend": "trtllm_mha"}, "--decode-attention-backend trtllm_mha"),
        ({"prefill_attention_backend": "fa4"}, "--prefill-attention-backend fa4"),
        ({"device": "cpu", "attention_backend": "flashinfer"}, "on cpu use torch_native"),
        ({"device": "cpu", "attention_backend": "intel_amx"}, "--attention-backend intel_amx"),
        ({"device": "xpu"}, "--device xpu"),
        ({"cuda_graph_backend_decode": "full"}, "use --cuda-graph-backend-decode disabled"),
        ({"cuda_graph_backend_prefill": "breakable"}, "use --cuda-graph-backend-prefill disabled"),
        ({"cuda_graph_config": {"decode": {"backend": "full"}}}, "--cuda-graph-config"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype fp8_e4m3"),
        ({"kv_cache_dtype": "nvfp4"}, "--kv-cache-dtype nvfp4"),
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE"),
        ({"pp_size": 2}, "--pp-size"),
        ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
        ({"disaggregation_mode": "decode"}, "--disaggregation-mode decode"),
        ({"enable_dp_attention": True}, "--enable-dp-attention"),
        ({"attn_dp_size": 2}, "--attn-dp-size > 1"),
        ({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
        ({"enable_lmcache": True}, "--enable-lmcache: LMCache is a second KV tier"),
        ({"enable_flexkv": True}, "--enable-flexkv: FlexKV is a second KV tier"),
        ({"enable_unified_cache_external_linker": True}, "--enable-unified-cache-external-linker"),
        ({"enable_session_radix_cache": True}, "--enable-session-radix-cache"),
        ({"enable_streaming_session": True}, "--enable-streaming-session"),
        ({"enable_memory_saver": True}, "--enable-memory-saver: the layered KV pool"),
        ({"enable_pdmux": True}, "--enable-pdmux"),
        ({"enable_prefill_cp": True}, "--enable-prefill-cp"),
        ({"enable_mis": True}, "--enable-mis"),
        ({"enable_deterministic_inference": True}, "--enable-deterministic-inference"),
        ({"dcp_size": 2}, "--dcp-size > 1: decode context parallelism"),
        ({"attn_cp_size": 4}, "--attn-cp-size > 1"),
        ({"kv_canary": "raise"}, "--kv-canary raise: SGLang's KV canary"),
        ({"kv_canary": "log"}, "--kv-canary log"),
        ({"tokenizer_worker_num": 2}, "--tokenizer-worker-num > 1: SGLang loads no plugins"),
        ({"rl_on_policy_target": "fsdp"}, "--rl-on-policy-target: it turns on deterministic inference"),
        ({"smg_grpc_mode": True}, "--smg-grpc-mode: the SMG gRPC front end serves requests without"),
        ({"grpc_mode": True}, "--grpc-mode: the SMG gRPC front end"),
        ({"dllm_algorithm": "LowConfidence"}, "--dllm-algorithm: diffusion-LM inference denoises"),
        ({"radix_eviction_policy": "tlru"}, "--radix-eviction-policy tlru: T-LRU needs"),
        ({"cuda_graph_config": {"decode": {}}}, "--cuda-graph-config: not supported with --enable-layered-kv"),
        ({"cuda_graph_config": {}, "kv_cuda_graphs": "on", "attention_backend": "triton"}, "--cuda-graph-config"),
    ],
)
def test_unservable_options_are_refused_by_name(changes, names):
    with pytest.raises(LaunchRefused) as err:
        _decide(**changes)
    assert names in str(err.value)


def test_sglangs_rust_server_is_refused():
    """``SGLANG_RUST_SERVER`` (an environment flag the plugin reads through SGLang's ``envs``)
    replaces the tokenizer manager; the same options without it pass (the control)."""
    with pytest.raises(LaunchRefused, match="SGLANG_RUST_SERVER=1: SGLang's Rust server replaces"):
        LaunchDecision.decide(STOCK, rust_server=True)
    assert LaunchDecision.decide(STOCK, rust_server=False).device == "cuda"


def test_sglangs_busy_time_memory_check_is_refused():
    """``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY`` counts only the running batch's KV rows: a
    paused request would read as a leak and stop the scheduler (scheduler review, session 54).
    Control: the same options without it pass."""
    with pytest.raises(LaunchRefused, match="SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY: SGLang's busy-time"):
        LaunchDecision.decide(STOCK, busy_mem_check=True)
    assert LaunchDecision.decide(STOCK, busy_mem_check=False).device == "cuda"


def test_sglangs_metadata_glue_graph_is_refused_with_decode_graphs():
    """``SGLANG_ENABLE_METADATA_GLUE_GRAPH`` replays a captured copy of the backend's per-replay
    preparation, skipping kvplane's admission check: refused with ``--kv-cuda-graphs on``;
    controls: the same options without it, and the flag with decode graphs off (SGLang captures
    nothing then), pass."""
    graphs = {**STOCK, **GRAPHS_ON}
    with pytest.raises(LaunchRefused, match="--kv-cuda-graphs on with SGLANG_ENABLE_METADATA_GLUE_GRAPH=1"):
        LaunchDecision.decide(graphs, glue_graph=True)
    assert LaunchDecision.decide(graphs, glue_graph=False).device == "cuda"
    assert LaunchDecision.decide(STOCK, glue_graph=True).device == "cuda"


@pytest.mark.parametrize("name", ["SGLANG_RUST_SERVER", "SGLANG_ENABLE_METADATA_GLUE_GRAPH"])
def test_the_launcher_reads_the_refused_environment_flags_as_sglang_does(name, monkeypatch):
    """The plugin hands ``decide`` these flags as SGLang's ``envs`` reads them (the names exist
    there); unset, or a value SGLang cannot parse (its own error later), reads False."""
    pytest.importorskip("sglang")
    from sglang_ext.plugin import _env_flag

    monkeypatch.setenv(name, "1")
    assert _env_flag(name) is True
    monkeypatch.setenv(name, "maybe")
    assert _env_flag(name) is False
    monkeypatch.delenv(name)
    assert _env_flag(name) is False


@pytest.mark.parametrize("dtype", ["auto", "bf16", "bfloat16"])
def test_unquantized_kv_dtypes_pass(dtype):
    assert _decide(kv_cache_dtype=dtype).device == "cuda"


def test_data_parallel_replicas_are_served():
    """``--dp-size 2`` (replicas, each its own scheduler and worker) passes; DP attention does not
    (the negative control above)."""
    assert _decide(dp_size=2).device == "cuda"


@pytest.mark.parametrize("changes, refused", [
    ({"prefill_attention_backend": "triton"}, "--prefill-attention-backend triton with --decode-attention-backend "
                                              "flashinfer"),
    ({"decode_attention_backend": "torch_native"}, "--prefill-attention-backend flashinfer with "
                                                   "--decode-attention-backend torch_native"),
    ({"attention_backend": "triton", "prefill_attention_backend": "torch_native"},
     "--prefill-attention-backend torch_native with --decode-attention-backend triton"),
    ({"prefill_attention_backend": "triton", "decode_attention_backend": "flashinfer"},
     "--prefill-attention-backend triton with --decode-attention-backend flashinfer"),
])
def test_a_prefill_backend_other_than_the_decode_one_is_refused(changes, refused):
    """SGLang would wrap the two in its HybridAttnBackend, which kvplane's hooks do not see through
    (a fused-KV-write model then asked the pool for flat buffers after its weights loaded)."""
    with pytest.raises(LaunchRefused) as info:
        _decide(**changes)
    assert str(info.value).startswith(refused) and "set --attention-backend" in str(info.value)


@pytest.mark.parametrize("changes", [
    {"prefill_attention_backend": "flashinfer"}, {"decode_attention_backend": "flashinfer"},
    {"attention_backend": "triton", "prefill_attention_backend": "triton", "decode_attention_backend": "triton"},
    {"prefill_attention_backend": "triton", "decode_attention_backend": "triton"},
])
def test_the_same_backend_for_both_phases_is_served(changes):
    """Control: naming the one backend again, per phase or both, is accepted."""
    _decide(**changes)


def test_a_device_with_an_index_is_its_platform():
    """SGLang takes --device cuda:0 as cuda; so does the decision (it was refused). Control: an
    unsupported device is still refused."""
    assert _decide(device="cuda:0").device == "cuda"
    assert dict(_decide(device="cuda:0").implied)["attention_backend"] == "flashinfer"
    with pytest.raises(LaunchRefused, match="--device npu:0"):
        _decide(device="npu:0")
