"""SGLang with --enable-layered-kv --attention-backend triton: prefill runs kvplane's Triton
paged-extend kernel and decode its paged-decode kernel (under the Triton interpreter on this CPU
host: the same kernel code a GPU compiles) over the layered tables, with most layer-KV on host,
and matches vanilla.

Scenario: one module-scoped server, ``TRITON_INTERPRET=1``, the offload test's tiny budget
(``--kv-gpu-budget-tokens 49 --max-total-tokens 48``: staged host pages every step) and chunked
prefill of 16 tokens; the session's vanilla server (torch_native) is the reference.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    LOGPROB_ATOL,
    PROMPTS,
    fault_armed,
    fault_inject_path,
    flag_file,
    greedy,
    running_servers,
    token_logprobs,
    warmup_forward,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

NEW_TOKENS = 6
KERNEL_LOGPROB_ATOL = LOGPROB_ATOL
"""The test servers serve the tiny checkpoint in float32 (``conftest.TEST_DTYPE_ARGS``): vanilla's
torch SDPA and the paged kernel (fp32 dots under the interpreter on fp32 caches) then differ by
summation order only, so the kernel is held to the pool's own tolerance -- where one corrupted
page moves logprobs by >= 1.4e-3. (In SGLang's fp16 ``auto`` dtype the two differed by fp16
rounding, up to 9.8e-4, and this was 5e-3: a corrupted page could hide under it.) The kernel's
exactness itself is tested against its fp32 reference and on the served core
(tests/kernels/test_paged_decode.py); this test proves SGLang serves through it."""


IDENTITY_FLAGS = ["--enable-layered-kv", "--attention-backend", "triton", "--page-size", "4"]
"""No --kv-gpu-budget-tokens: the identity layout (nothing offloaded), read through page tables as
on CUDA by default; pages of 4 tokens, so that steady steps open pages."""


@pytest.fixture(scope="module")
def triton_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple]:
    """The layered Triton server and the nothing-offloaded one (started side by side), each with
    its pool stats file."""
    root = tmp_path_factory.mktemp("layered-triton")
    stats = root / "pool_stats.jsonl"
    # chunks of 16 tokens: a longer prompt's second chunk extends the first from the layered pool
    flags = ["--enable-layered-kv", "--attention-backend", "triton", "--kv-gpu-budget-tokens", "49",
             "--max-total-tokens", "48", "--chunked-prefill-size", "16"]
    # the test-only injector perturbs nothing until a control creates its flag file (the extend
    # test's shifted lengths, the stale staged advance)
    env = {"TRITON_INTERPRET": "1", POOL_STATS_FILE_ENV: str(stats), "PYTHONPATH": fault_inject_path(),
           "KVPLANE_TEST_SHIFT_EXTEND_FILE": str(root / "shift_extend"),
           "KVPLANE_TEST_STALE_ADVANCE_FILE": str(root / "stale_advance"),
           "KVPLANE_TEST_WARMUP_DUMMY_FILE": str(root / "warmup.jsonl"), "KVPLANE_TEST_WARMUP_DUMMY_SEQ_LEN": "0"}
    identity_root = tmp_path_factory.mktemp("identity-triton")
    identity_stats = identity_root / "pool_stats.jsonl"
    identity_env = {"TRITON_INTERPRET": "1", POOL_STATS_FILE_ENV: str(identity_stats)}
    with running_servers(tiny_model_dir, [(root, flags, env),
                                          (identity_root, IDENTITY_FLAGS, identity_env)], zygote=launch_zygote) as (server, identity):
        yield server, stats, identity, identity_stats


@pytest.fixture(scope="module")
def triton_server(triton_servers) -> tuple[SGLangServer, object]:
    return triton_servers[0], triton_servers[1]


def assert_kernel_matches_vanilla(server: SGLangServer, vanilla: SGLangServer, prompts) -> None:  # noqa: ANN001
    """Vanilla's greedy tokens, logprobs within :data:`KERNEL_LOGPROB_ATOL`, for every prompt."""
    for prompt in prompts:
        got = greedy(server, prompt, NEW_TOKENS, logprobs=True)
        want = greedy(vanilla, prompt, NEW_TOKENS, logprobs=True)
        assert got["output_ids"] == want["output_ids"], prompt
        worst = max(abs(a - b) for a, b in zip(token_logprobs(got), token_logprobs(want), strict=True))
        assert worst <= KERNEL_LOGPROB_ATOL, (prompt, worst)


def prompt_logprobs(server: SGLangServer, prompt: str, start: int = 0) -> tuple[list[float], list[int], int]:
    """The logprobs of the prompt's tokens after position ``start`` (SGLang's
    ``logprob_start_len``; every one is computed by the prefill's extend), the greedy token after them (one: the tiny random model's next logits can tie within
    fp16 rounding, e.g. -5.2011 vs -5.2001 after this module's extend prompt) and how many prompt
    tokens came from the prefix cache (at most ``start``: SGLang recomputes the positions whose
    logprobs it returns)."""
    got = server.post("/generate", {"text": prompt, "return_logprob": True, "logprob_start_len": start,
                                    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    entries = got["meta_info"]["input_token_logprobs"]
    # the first position reported has no logprob (SGLang's, also when ``start > 0``)
    assert len(entries) >= 2 and entries[0][0] is None and all(e[0] is not None for e in entries[1:])
    values = [float(e[0]) for e in entries[1:]]
    return values, got["output_ids"], int(got["meta_info"]["cached_tokens"])


EXTEND_PROMPT = "Colors: red orange yellow green blue indigo violet, then the"
"""A prompt of more new tokens than one interpreter block of the extend kernel (16), short enough
for the server's 48-token pool with its continuation."""


def test_triton_paged_decode_matches_vanilla_with_kv_on_host(triton_server, vanilla_server):
    server, stats_path = triton_server
    assert_kernel_matches_vanilla(server, vanilla_server, PROMPTS[:4])
    log = server.log_path.read_text()
    assert "layered_triton_decode_active" in log and "impl=triton" in log  # the kernel, not the reference
    steps = read_jsonl(stats_path)
    assert steps[-1]["overflow_steps_total"] == 0
    assert steps[-1]["fetched_layer_pages_total"] > 0  # host pages were staged for the kernel to read
    assert max(s["host_fraction"] for s in steps) >= 0.5
    # steady steps of the placed batch ran on the last step's tables, staging again (no build)
    assert steps[-1]["staged_advances_total"] > 0, steps[-1]


def test_sglangs_warm_up_forward_with_empty_rows_ran_through_the_layered_pool(triton_server):
    """SGLang's warm-up forward (``BaseRunner._dummy_run``: FlashInfer's autotune on CUDA sm90+
    for FP8 / FP4 GEMMs or FlashInfer MoE; run here on the CPU by the test injector) with
    ``seq_lens`` of 0 -- what a decode graph runner's buffers may hold when it warms up first --
    reached kvplane's Triton backend: anonymous rows shorter than the token each writes, given
    the slots they write (``layered_attention._warmup_rows``); the server started and serves (the
    other tests of this module). Without that, the paged layout's start failed on those rows
    (the core refuses them by name: ``tests/sglang/test_warmup_rows.py``). The rows as SGLang's
    eager runner allocates them: ``test_layered_offload_server.py``."""
    forward = warmup_forward(triton_server[1].parent / "warmup.jsonl")
    assert forward == {"backend": "LayeredTritonDecode", "rows": forward["rows"], "seq_lens": [0], "rids": None}


def test_negative_control_a_stale_staged_advance_fails_the_comparison(triton_server, vanilla_server):
    """Control: staged steps advanced with the last step's new-token rows (each new K/V overwrite
    the previous token's, on the device or in staging and written back so) are caught by the same
    comparison, for every prompt (the fault armed on the layered server, which did advance staged
    steps meanwhile); disarmed, the server matches again."""
    server, stats_path = triton_server
    before = read_jsonl(stats_path)[-1]["staged_advances_total"]
    failures = 0
    with fault_armed(server, stats_path.parent / "stale_advance"):
        for prompt in PROMPTS[:2]:
            got = greedy(server, prompt, NEW_TOKENS, logprobs=True)
            want = greedy(vanilla_server, prompt, NEW_TOKENS, logprobs=True)
            worst = max(abs(a - b) for a, b in zip(token_logprobs(got), token_logprobs(want), strict=True))
            failures += got["output_ids"] != want["output_ids"] or worst > KERNEL_LOGPROB_ATOL
        assert read_jsonl(stats_path)[-1]["staged_advances_total"] > before
    assert failures == 2, f"only {failures} of 2 stale staged-advance generations were detected"
    assert_kernel_matches_vanilla(server, vanilla_server, PROMPTS[:1])


def test_recompute_rows_run_on_the_paged_kernel(triton_server, vanilla_server):
    """eLLM recompute (docs/recompute.md) on the paged decode: the decode rows read the recomputed
    prefix through ``tab[l]`` in the Triton kernel; vanilla's tokens, logprobs within the kernel's
    tolerance (in fp32: recomputed fp16 GEMMs would add ~1e-3, tests/sglang/test_recompute_server.py)."""
    server, stats_path = triton_server
    before = len(read_jsonl(stats_path))
    prompt = PROMPTS[5]
    payload = {"text": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "custom_params": {"kvplane_recompute_ratio": 0.5}}}
    got = server.post("/generate", payload)
    want = greedy(vanilla_server, prompt, NEW_TOKENS, logprobs=True)
    assert got["output_ids"] == want["output_ids"]
    worst = max(abs(a - b) for a, b in zip(token_logprobs(got), token_logprobs(want), strict=True))
    assert worst <= KERNEL_LOGPROB_ATOL, worst
    steps = read_jsonl(stats_path, before)
    assert sum(1 for s in steps if s["recompute_tokens"]) >= NEW_TOKENS - 1


def test_nothing_offloaded_steady_steps_take_the_fast_path_and_match_vanilla(triton_servers, vanilla_server):
    """The CUDA default's shape (paged decode, no budget: the identity layout): steady decode steps
    are journalled and read tables grown from the last step's page lists
    (``IdentityDecodeStep``; before, every decode step read every request's slots and rebuilt its
    tables), and the generations equal vanilla's. The tables' exactness has its negative control
    on the core (``tests/dataplane/test_identity_decode.py``)."""
    server, stats_path = triton_servers[2], triton_servers[3]
    assert_kernel_matches_vanilla(server, vanilla_server, PROMPTS[:3])
    assert "impl=triton" in server.log_path.read_text()
    last = read_jsonl(stats_path)[-1]
    assert last["host_fraction"] == 0 and last["overflow_steps_total"] == 0
    assert last["journalled_decode_steps_total"] >= 3 * (NEW_TOKENS - 2), last


def test_prefill_runs_the_paged_extend_kernel_and_matches_vanilla(triton_servers, vanilla_server):
    """Prefill on the paged backends reads the layered page tables through kvplane's Triton
    paged-extend kernel (``kernels/paged_extend.py``; before, SGLang's torch-native per-request
    loop, which reads lengths from the device at every layer): every prompt token's logprob
    equals vanilla's within the kernel tolerance -- with most layer-KV on host (the budget of 49
    tokens), in chunks of 16 tokens (the prompt's second chunk extends its first from the pool),
    and for a prompt whose extend reads a cached prefix of 20 tokens. Negative control: the same
    server handing the kernel ``kv_lens - 1`` (tests/sglang/fault_inject: each new token misses
    itself) fails."""
    server, stats_path = triton_servers[0], triton_servers[1]
    flag = stats_path.parent / "shift_extend"
    before = len(read_jsonl(stats_path))
    cached = []
    for prompt, start in ((EXTEND_PROMPT, 0), (EXTEND_PROMPT + " quick fox", 20)):  # the second: a prefix hit
        got, got_ids, hit = prompt_logprobs(server, prompt, start)
        want, want_ids, _ = prompt_logprobs(vanilla_server, prompt, start)
        assert len(got) == len(want) > 8 and got_ids == want_ids, prompt
        worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
        assert worst <= KERNEL_LOGPROB_ATOL, (prompt, worst)
        cached.append(hit)
    assert cached[0] == 0 and cached[1] == 20, cached
    steps = read_jsonl(stats_path, before)
    assert 16 in [s["new_tokens"] for s in steps], [s["new_tokens"] for s in steps]  # a chunk of the first
    assert steps[-1]["overflow_steps_total"] == 0
    log = server.log_path.read_text().splitlines()
    assert any("layered_extend_path" in line and "paged-extend kernel" in line for line in log)
    assert any("layered_paged_extend_active" in line and "impl=triton" in line for line in log)
    control = "A cache keeps recent data close, and time to first token measures"
    with flag_file(flag):
        shifted, _, _ = prompt_logprobs(server, control)
    want, _, _ = prompt_logprobs(vanilla_server, control)
    worst = max(abs(a - b) for a, b in zip(shifted, want, strict=True))
    assert worst > KERNEL_LOGPROB_ATOL, f"a shifted extend table went unnoticed (worst {worst:.2e})"
