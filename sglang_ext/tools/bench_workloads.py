"""Workloads and model presets of `kvplane bench sglang` (``--workload``, ``--model``)."""

from __future__ import annotations

from typing import Any

WORKLOADS = ("throughput", "mixed")
"""``--workload``: ``throughput`` (one batched ``/generate`` of 8 prompts, 96 tokens each: the 8
arrive together, so every run decodes the same batch and a run measures steady-state step
cost) or ``mixed`` (the demo's staggered 6 requests over the OpenAI API: batching varies with
arrival timing, so runs are noisier)."""
THROUGHPUT_PROMPT_WORDS = (16, 300, 40, 120, 200, 24, 80, 160)
THROUGHPUT_NEW_TOKENS = 96
MODELS = ("tiny", "small")
"""``--model`` presets: ``tiny`` is the tests' model (a decode step is a few ms of compute, so
the plugin's fixed per-step Python cost is the worst case); ``small`` (512 wide, 8 layers) puts
more compute in every step, so the same fixed cost is a smaller share."""


def run_throughput(server: Any) -> tuple[int, int]:
    """One batched ``/generate`` of the throughput workload: (output tokens, failed prompts)."""
    from sglang_ext.tools.workload import prompt_of

    words = THROUGHPUT_PROMPT_WORDS
    payload = {
        "text": [prompt_of(w, seed=i) for i, w in enumerate(words)],
        "sampling_params": {"max_new_tokens": THROUGHPUT_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
    }
    try:
        outs = server.post("/generate", payload, timeout_s=300.0)
    except Exception as exc:  # noqa: BLE001 - counted as failed, reported by the caller
        print(f"[bench sglang] batched /generate failed: {exc}", flush=True)
        return 0, len(words)
    tokens = [int(o["meta_info"]["completion_tokens"]) for o in outs]
    return sum(tokens), sum(t != THROUGHPUT_NEW_TOKENS for t in tokens) + len(words) - len(tokens)


def run_once(server: Any, workload: str) -> tuple[int, int]:
    """One workload run against ``server``: (output tokens, failed requests)."""
    from sglang_ext.tools.workload import mixed_workload, run_workload

    if workload == "throughput":
        return run_throughput(server)
    if workload == "mixed":
        results = run_workload(server.base_url, mixed_workload(), timeout_s=300.0)
        return sum(r.completion_tokens for r in results), sum(not r.ok for r in results)
    raise ValueError(f"--workload={workload!r}: allowed {list(WORKLOADS)}")


def workload_text(workload: str) -> str:
    """One line describing a ``--workload`` choice (for the results)."""
    from sglang_ext.tools.workload import mixed_workload

    if workload == "throughput":
        words = THROUGHPUT_PROMPT_WORDS
        return (
            f"throughput: one batched /generate of {len(words)} prompts ({min(words)}-{max(words)} "
            f"words), {THROUGHPUT_NEW_TOKENS} output tokens each"
        )
    specs = mixed_workload()
    return (
        f"mixed: {len(specs)} staggered OpenAI requests, {sum(s.max_tokens for s in specs)} output "
        f"tokens ({sum(s.stream for s in specs)} streaming)"
    )


def model_spec(name: str) -> Any:
    """The :class:`TinyModelSpec` of a ``--model`` preset."""
    from sglang_ext.testing.tiny_model import TinyModelSpec

    if name == "tiny":
        return TinyModelSpec()
    if name == "small":
        return TinyModelSpec(
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1536,
        )
    raise ValueError(f"--model={name!r}: allowed {list(MODELS)}")
