"""A soft-capped model (Gemma-2) served with --enable-layered-kv decodes as the model does.

SGLang's torch-native attention has no logit soft cap, and every layered backend takes its
extend (prefill) path, so before ``sglang_ext/capped_attention.py`` a Gemma-2 prompt was attended
uncapped under --enable-layered-kv. The reference here is transformers' own Gemma-2 (eager
attention, which applies ``attn_logit_softcapping``) on the same fp32 weights: the layered server's
prompt logprobs, its output tokens' top-5 logprobs (the decode path) and a request that extends
a cached prefix (the extend path with a prefix) must equal it within :data:`TOL`; so must a
server prefilling and decoding with kvplane's Triton paged-extend and paged-decode kernels (under
the Triton interpreter), with prompts longer than the model's sliding window (8 tokens, on its
first layer).

Also under decode graphs (``--kv-cuda-graphs on``, SGLang's runner on the test injector's emulated
graph) on the layered FlashInfer backend over the stand-in of FlashInfer's wrapper
(``KVPLANE_TEST_FLASHINFER_STAND_IN``): two parameter sets (sliding-window and global layers),
each with its own graph wrappers planned before every replay.

Negative control: vanilla SGLang (the same flags without --enable-layered-kv) serves the same
model uncapped on the CPU, and the same comparison finds it off by whole units.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_ext.testing.tiny_gemma2 import build_tiny_gemma2
from tests.sglang.conftest import fault_inject_path, running_servers

pytestmark = pytest.mark.sglang

TOL = 1e-4
"""fp32 on both sides: measured 1e-6 on prompt logprobs (the uncapped server: 2.6)."""
PROMPTS = ("the quick brown fox jumps over the lazy dog and then", "a serving engine keeps the cache")
FLAGS = ("--dtype", "float32")
TRITON_FLAGS = ("--enable-layered-kv", "--attention-backend", "triton", "--page-size", "4")
"""kvplane's Triton paged extend and paged decode (cap and window in the kernels) over the
identity layout's tables (steady decode: ``IdentityDecodeStep``), pages of 4 tokens."""
GRAPH_FLAGS = ("--kv-cuda-graphs", "on", "--cuda-graph-backend-decode", "full", "--cuda-graph-bs-decode", "1", "2")


@pytest.fixture(scope="module")
def gemma2(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma2(tmp_path_factory.mktemp("tiny-gemma2"), tiny_model_dir)


@pytest.fixture(scope="module")
def servers(gemma2: Path, launch_zygote, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    graphs = tmp_path_factory.mktemp("gemma2-flashinfer-graphs")
    specs = [(tmp_path_factory.mktemp("gemma2-vanilla"), FLAGS, None),
             (tmp_path_factory.mktemp("gemma2-layered"), (*FLAGS, "--enable-layered-kv"), None),
             (tmp_path_factory.mktemp("gemma2-triton"), (*FLAGS, *TRITON_FLAGS), {"TRITON_INTERPRET": "1"}),
             (graphs, (*FLAGS, *TRITON_FLAGS, *GRAPH_FLAGS),
              {"TRITON_INTERPRET": "1", "PYTHONPATH": fault_inject_path(), "KVPLANE_TEST_FLASHINFER_STAND_IN": "1",
               "KVPLANE_TEST_TAPE_GRAPHS": str(graphs / "tape.log")})]
    with running_servers(gemma2, specs, zygote=launch_zygote) as started:
        yield (*started, graphs)


@pytest.fixture(scope="module")
def reference(gemma2: Path):
    """Log-softmax of transformers' Gemma-2 (eager attention: soft-capped) over a token sequence."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma2, attn_implementation="eager", dtype=torch.float32).eval()

    def logprobs(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logprobs


def generate(server, text: str, *, prompt_logprobs: bool, start: int = 0) -> dict:
    """Five greedy tokens with their top-5 logprobs; ``prompt_logprobs``: the prompt's too, from
    position ``start`` (SGLang's ``logprob_start_len``, which also caps its prefix-cache hit)."""
    payload = {"text": text, "sampling_params": {"max_new_tokens": 5, "temperature": 0},
               "return_logprob": True, "top_logprobs_num": 5}
    if prompt_logprobs:
        payload["logprob_start_len"] = start
    return server.post("/generate", payload)


def worst_error(response: dict, reference, ids: list[int], start: int = 0) -> float:
    """Largest |logprob - reference| over the prompt tokens the response has (from position
    ``start``) and the output positions' top-5 tokens; ``ids``: the prompt's token ids."""
    meta = response["meta_info"]
    out = [e[1] for e in meta["output_token_logprobs"]]
    ref, n, errors = reference(ids + out), len(ids), []
    for i, entry in enumerate(meta.get("input_token_logprobs") or []):
        pos = start + i
        assert entry[1] == ids[pos]
        if entry[0] is None:  # SGLang returns none for the first position it reports
            assert i == 0
            continue
        errors.append(abs(float(entry[0]) - float(ref[pos - 1, ids[pos]])))
    for pos, tops in enumerate(meta["output_top_logprobs"]):
        for logprob, token, *_ in tops:
            errors.append(abs(float(logprob) - float(ref[n - 1 + pos, token])))
    return max(errors)


def prompt_ids(server, text: str) -> list[int]:
    meta = generate(server, text, prompt_logprobs=True)["meta_info"]
    return [int(e[1]) for e in meta["input_token_logprobs"]]


def test_layered_server_equals_the_soft_capped_model(servers, reference) -> None:
    """Prompt logprobs (extend), output top-5 logprobs (decode) and a cached-prefix extend."""
    layered = servers[1]
    for text in PROMPTS:
        ids = prompt_ids(layered, text)
        response = generate(layered, text, prompt_logprobs=True)
        assert worst_error(response, reference, ids) <= TOL, text
    # served once already (its ids), a longer prompt is served again from its cached prefix: an
    # extend whose prefix length is > 0
    longer = PROMPTS[0] + " the cache keeps serving"
    ids = prompt_ids(layered, longer)
    response = generate(layered, longer, prompt_logprobs=False)
    assert response["meta_info"].get("cached_tokens", 0) > 0
    assert worst_error(response, reference, ids) <= TOL


def test_negative_control_the_uncapped_server_is_caught(servers, reference) -> None:
    """Vanilla SGLang's torch-native attention ignores the cap: the same comparison fails."""
    vanilla = servers[0]
    ids = prompt_ids(vanilla, PROMPTS[0])
    assert worst_error(generate(vanilla, PROMPTS[0], prompt_logprobs=True), reference, ids) > 100 * TOL


def test_the_triton_paged_kernels_apply_cap_and_window(servers, reference) -> None:
    """The paged extend (prompt logprobs, a cached-prefix extend) and paged decode kernels (under
    the Triton interpreter) over the identity layout's tables: the same reference, prompts longer
    than the window (8 tokens, layer 0)."""
    triton = servers[2]
    for text in PROMPTS:
        ids = prompt_ids(triton, text)
        assert len(ids) > 8
        assert worst_error(generate(triton, text, prompt_logprobs=True), reference, ids) <= TOL, text
    # a longer prompt extends PROMPTS[1]'s cached prefix by several tokens (its ids from the
    # vanilla server, so that the Triton server caches nothing of it first)
    longer = PROMPTS[1] + " and the prefix is cached"
    prefix, ids = prompt_ids(servers[0], PROMPTS[1]), prompt_ids(servers[0], longer)
    assert ids[: len(prefix)] == prefix
    response = generate(triton, longer, prompt_logprobs=True, start=len(prefix))
    cached = response["meta_info"]["cached_tokens"]
    assert 8 < cached <= len(prefix) and len(ids) - cached > 3, (cached, len(prefix), len(ids))
    assert worst_error(response, reference, ids, len(prefix)) <= TOL
    log = triton.log_path.read_text().splitlines()
    for active in ("layered_paged_extend_active", "layered_triton_decode_active"):
        assert any(active in line and "impl=triton" in line for line in log), active


def test_flashinfer_decode_graphs_apply_cap_and_window(servers, reference) -> None:
    """Decode graphs on the layered FlashInfer backend (the stand-in): every decode step of both
    prompts replays -- each layer attending with its own parameter set's graph wrapper (Gemma-2's
    sliding-window and global layers), planned before the replay -- and the outputs' top-5
    logprobs equal transformers' Gemma-2 (prompts longer than the window)."""
    server, root = servers[3], servers[4]
    for text in PROMPTS:
        before = _replays(root)
        ids = prompt_ids(servers[0], text)
        assert worst_error(generate(server, text, prompt_logprobs=True), reference, ids) <= TOL, text
        assert _replays(root) - before >= 4, text  # 5 tokens: the first from the prefill, 4 decode steps
    log = server.log_path.read_text()
    assert "backend=LayeredFlashInferDecode" in log and "layered_decode_graph_eager" not in log


def _replays(root: Path) -> int:
    path = root / "tape.log"
    return sum(line.startswith("replay") for line in path.read_text().splitlines()) if path.exists() else 0
