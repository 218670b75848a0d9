"""A vision-language model (Qwen2-VL) served with --enable-layered-kv generates as vanilla SGLang.

The model is the tiny random-weight Qwen2-VL of :mod:`sglang_ext.testing.tiny_qwen2_vl` (4 decoder
layers, M-RoPE, a 1-block vision tower): SGLang embeds a request's image tokens from the image
(the prompt's ``<|image_pad|>`` ids are placeholders) and rotates by 3-D M-RoPE positions. The
layered server keeps one layer of its 48-token slot space on the device (:data:`OFFLOAD_LAYERED`),
so most of each request's layer-KV -- the image tokens' included -- sits on host and is fetched
per layer. Each request (an image by file path, the same image again with a longer prompt: a
prefix-cache hit over the image tokens, a smaller image as a base64 data URL, a text-only prompt)
must give vanilla's greedy tokens and per-token logprobs within :data:`LOGPROB_ATOL`.

Servers run one at a time (vanilla's outputs are collected first): a VLM server's tokenizer
process loads the image processor and its media workers beside the scheduler.

Negative controls: a different image changes vanilla's output (the image reaches the logits, so
a layered server that lost or misplaced the image tokens' KV would be seen), and the layered
server with the test injector's write-back fault armed (one host page of layer 3 perturbed after
every step) no longer matches.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from sglang_ext.testing.tiny_qwen2_vl import IMAGE_PLACEHOLDER, build_tiny_qwen2_vl
from tests.sglang.conftest import (
    LOGPROB_ATOL,
    OFFLOAD_LAYERED,
    assert_same_generation,
    fault_armed,
    fault_inject_path,
    running_server,
    token_logprobs,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]

NEW_TOKENS = 8
CONCURRENT = ("image-base64", "text-only", "image")
"""Requests sent to the layered server at once (decoded in one batch as far as its 48 slots allow)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("torch", "transformers", "tokenizers", "PIL"):
        pytest.importorskip(module)
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


def _image(path: Path, size: int, seed: int) -> Path:
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def payloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The compared requests (``/generate`` payloads without sampling parameters), in order: the
    second reuses the first's image and prompt head (a prefix-cache hit)."""
    root = tmp_path_factory.mktemp("vlm-images")
    big, small = _image(root / "a112.png", 112, 0), _image(root / "b56.png", 56, 1)  # 16 and 4 image tokens
    small_url = "data:image/png;base64," + base64.b64encode(small.read_bytes()).decode()
    return {
        "image": {"text": f"Describe {IMAGE_PLACEHOLDER} the image.", "image_data": str(big)},
        "image-prefix-hit": {"text": f"Describe {IMAGE_PLACEHOLDER} the image. Then tell me a story",
                             "image_data": str(big)},
        "image-base64": {"text": f"What colors {IMAGE_PLACEHOLDER} are there?", "image_data": small_url},
        "text-only": {"text": "The quick brown fox jumps"},
    }


@pytest.fixture(scope="module")
def other_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(_image(tmp_path_factory.mktemp("vlm-other") / "c112.png", 112, 2))


def generate(server: SGLangServer, payload: dict) -> dict:
    return server.post("/generate", {**payload, "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}})


@pytest.fixture(scope="module")
def vanilla(model: Path, payloads: dict[str, dict], other_image: str, launch_zygote,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Vanilla SGLang's responses to :func:`payloads`, and to the first with ``other_image``."""
    with running_server(model, tmp_path_factory.mktemp("vlm-vanilla"), zygote=launch_zygote) as server:
        out = {name: generate(server, payload) for name, payload in payloads.items()}
        out["other-image"] = generate(server, {**payloads["image"], "image_data": other_image})
    return out


@pytest.fixture(scope="module")
def layered(model: Path, vanilla: dict, launch_zygote,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SGLangServer, Path, Path]]:
    """The :data:`OFFLOAD_LAYERED` server with the test-only fault injector (flag off): ``(server,
    its stats file, its fault flag)``. Started after ``vanilla`` stopped."""
    root = tmp_path_factory.mktemp("vlm-layered")
    stats, flag = root / "pool_stats.jsonl", root / "corrupt"
    env = {POOL_STATS_FILE_ENV: str(stats), "PYTHONPATH": fault_inject_path(),
           "KVPLANE_TEST_CORRUPT_LAYER": "3", "KVPLANE_TEST_CORRUPT_FILE": str(flag)}
    with running_server(model, root, OFFLOAD_LAYERED, env, zygote=launch_zygote) as server:
        yield server, stats, flag


def test_the_image_reaches_vanillas_output(vanilla: dict) -> None:
    """The comparison can see the image: another image, same prompt, other logprobs; the second
    request was served from the first's cached prefix (the image tokens among it)."""
    first, other = vanilla["image"], vanilla["other-image"]
    assert first["meta_info"]["prompt_tokens"] == other["meta_info"]["prompt_tokens"]
    with pytest.raises(AssertionError):
        assert_same_generation(other, first)
    assert vanilla["image-prefix-hit"]["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1


def test_layered_server_generates_as_vanilla_with_kv_on_host(layered, payloads: dict, vanilla: dict) -> None:
    """Every request's greedy tokens and logprobs equal vanilla's, the prefix hit is served from the
    layered radix cache, and at least half of the live layer-KV is on host, fetched per step."""
    server, stats, _ = layered
    before = len(read_jsonl(stats)) if stats.exists() else 0
    for name, payload in payloads.items():
        got = generate(server, payload)
        assert got["meta_info"]["prompt_tokens"] == vanilla[name]["meta_info"]["prompt_tokens"], name
        assert_same_generation(got, vanilla[name], name)
        if name == "image-prefix-hit":
            assert got["meta_info"]["cached_tokens"] == vanilla[name]["meta_info"]["cached_tokens"] > 0
    steps = [s for s in read_jsonl(stats)[before:] if s["live_layer_pages"] > 0]
    assert len(steps) >= len(payloads) * NEW_TOKENS // 2
    assert sum(s["host_layer_pages"] for s in steps) / sum(s["live_layer_pages"] for s in steps) >= 0.5
    assert steps[-1]["fetched_layer_pages_total"] > steps[0]["fetched_layer_pages_total"]


def test_concurrent_image_and_text_requests_generate_as_alone(layered, payloads: dict, vanilla: dict) -> None:
    """Image and text requests sent together (an image's M-RoPE positions beside a text's in one
    decode batch) each generate as vanilla's lone run of it, from an empty prefix cache."""
    server = layered[0]
    server.flush_cache()
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        outs = list(pool.map(lambda name: generate(server, payloads[name]), CONCURRENT))
    for name, got in zip(CONCURRENT, outs, strict=True):
        assert got["meta_info"]["finish_reason"]["type"] == "length", name
        assert_same_generation(got, vanilla[name], name)


def test_negative_control_a_corrupted_host_page_is_seen(layered, payloads: dict, vanilla: dict) -> None:
    """With one host page of layer 3 perturbed after every step, the image request's logprobs
    leave :data:`LOGPROB_ATOL` of vanilla's."""
    server, _, flag = layered
    server.flush_cache()
    with fault_armed(server, flag):
        got = generate(server, payloads["image"])
    worst = max(abs(a - b) for a, b in zip(token_logprobs(got), token_logprobs(vanilla["image"]), strict=True))
    assert worst > LOGPROB_ATOL, worst  # measured 4.2e-3, the greedy tokens unchanged
    # the fault is off again and the cache flushed: the layered server matches once more
    assert_same_generation(generate(server, payloads["image"]), vanilla["image"], "fault disarmed")
