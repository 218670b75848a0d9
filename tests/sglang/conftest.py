"""Fixtures for tests against real SGLang 0.5.23 on CPU: the tiny model and a vanilla server.

Servers are expensive on CPU (tens of seconds to start), so the vanilla server is
session-scoped and shared by every module that compares against it.

Without SGLang only what needs it is skipped: a test marked ``sglang`` is skipped at set-up,
and a module importing an SGLang-importing ``sglang_ext`` module (``layered_pool``,
``layered_attention``, ``radix_cache``) at module level has its own
``pytest.importorskip("sglang")``. Everything else here (args, hooks, pacing, admission, the
control client, logs, the overhead meter, the bench's argument handling) runs without SGLang;
this file imports nothing that needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from controlplane.service.ports import free_ports
from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.testing.early_starts import EarlyStarts
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.launch_zygote import LaunchZygote
from sglang_ext.testing.server import SGLangServer
from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model
from tests.conftest import early_starts_of, uses_fixture

PROMPTS: tuple[str, ...] = tuple(
    f"{head} {tail}"
    for head in (
        "The quick brown fox",
        "A cache keeps recent data",
        "Time to first token",
        "Once upon a time there was",
        "Colors: red orange",
    )
    for tail in ("jumps", "is fast", "measures how long", "and then")
)
"""20 greedy prompts used for token-identity checks."""


@functools.cache
def sglang_missing() -> str | None:
    """Why SGLang cannot be used here, or None when it is importable."""
    try:
        found = importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):  # sys.modules["sglang"] is None, or a broken install
        found = False
    return None if found else "needs SGLang (the [sglang] extra), not installed"


@pytest.hookimpl(tryfirst=True)  # before fixtures: no tiny model or server for a skipped test
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip tests marked ``sglang`` when SGLang is missing (the marker means "needs SGLang")."""
    if item.get_closest_marker("sglang") is not None and (reason := sglang_missing()):
        pytest.skip(reason)


STARTUP_TIMEOUT_S = 600.0
"""Server start-up deadline: 30-200 s normally, longer when several servers start at once here."""


def tiny_model(early: EarlyStarts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny random-weight Llama model, built once by whoever asks first (the
    ``tiny_model_dir`` fixture, or an early start: :mod:`sglang_ext.testing.early_starts`)."""
    return early.shared("tiny-model", lambda: build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), TinyModelSpec()))


@pytest.fixture(scope="session")
def tiny_model_dir(early_starts: EarlyStarts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama model, built once per session (needs torch, tokenizers and
    safetensors, which come with the [sglang] extra; SGLang itself is not needed)."""
    for module in ("torch", "tokenizers", "safetensors"):
        pytest.importorskip(module)
    return tiny_model(early_starts, tmp_path_factory)


ZYGOTE = pytest.StashKey[LaunchZygote]()


def _start_zygote(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> LaunchZygote:
    zygote = LaunchZygote(tmp_path_factory.mktemp("zygote")).start()
    config.stash[ZYGOTE] = zygote
    config.add_cleanup(zygote.close)
    return zygote


def _early_start_tiny_model(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Early starts (``tests/conftest.py``) begin by building the tiny model; with the zygote
    started, after its imports (the fresh processes the later jobs start would otherwise import
    SGLang beside it, four importers on two cores)."""
    early = early_starts_of(config)
    zygote = config.stash.get(ZYGOTE, None)

    def job() -> Path:
        if zygote is not None:
            zygote.wait_ready()
        return tiny_model(early, tmp_path_factory)

    early.submit("tiny-model-after-zygote", job)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the launch zygote as soon as the session knows a test will use it: its imports
    (~30 s of CPU, in the zygote and its fork server) run beside the suite's first tests, on the
    core they leave idle, instead of delaying the first server module."""
    config = session.config
    if (sglang_missing() or config.getoption("--sglang-fresh-launch") or ZYGOTE in config.stash
            or config.option.collectonly or session.testsfailed):
        return
    factory = config._tmp_path_factory  # type: ignore[attr-defined] # the tmp_path_factory fixture's
    # `import sglang` setdefaults its third-party cache variables (CUDA_CACHE_PATH, TRITON_CACHE_DIR,
    # ...: sglang.srt.environ.redirect_third_party_caches) in os.environ. Imported here, before the
    # zygote and the early starts take the session's environment, a test that imports SGLang first
    # later (a run of a few modules) cannot make every later launch differ from the zygote's.
    importlib.import_module("sglang")
    if uses_fixture(session.items, "launch_zygote"):
        _start_zygote(config, factory)
    if uses_fixture(session.items, "tiny_model_dir"):
        _early_start_tiny_model(config, factory)


@pytest.fixture(scope="session")
def launch_zygote(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LaunchZygote | None:
    """The session's launch zygote (:mod:`sglang_ext.testing.zygote_server`): SGLang imported
    once, each test server's launcher and SGLang processes forked from it -- ~7 s to a healthy
    tiny-model server on this 2-core host instead of ~49 s (session 47). A server whose launch
    it cannot reproduce starts fresh (``SGLangServer.launched_by`` says why). Started at the end
    of collection (:func:`pytest_collection_finish`), closed when the session ends. None without
    SGLang or under ``--sglang-fresh-launch`` (every server a fresh process, as before)."""
    config = request.config
    if sglang_missing() or config.getoption("--sglang-fresh-launch"):
        return None
    return config.stash.get(ZYGOTE, None) or _start_zygote(config, tmp_path_factory)


@contextmanager
def running_server(
    model_dir: Path, root: Path, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
    *, zygote: LaunchZygote | None = None, base_env: Mapping[str, str] | None = None,
    on_spawn: Callable[[SGLangServer], object] | None = None,
) -> Iterator[SGLangServer]:
    """An SGLang server on a free port, logging to ``root/server.log``, healthy on entry and
    stopped on exit (module fixtures wrap one); forked from ``zygote`` when it can be."""
    with running_servers(model_dir, [(root, extra_args, env)], zygote=zygote, base_env=base_env,
                         on_spawn=on_spawn) as (server,):
        yield server


TEST_DTYPE_ARGS: tuple[str, ...] = ("--dtype", "float32")
"""Every test server serves the tiny fp32 checkpoint in float32 (before the test's own flags, so
an explicit ``--dtype`` wins: ``test_bf16_server``). SGLang's ``auto`` dtype serves it in fp16 on
the CPU, and on CPUs with AVX512-FP16 / AMX (Intel Sapphire Rapids; measured in session 37) an
fp16 GEMM's result depends on the batch's row count (1 ulp, ~1e-4, between 1 and 2, 8 or 54
rows of the same input): a request batched with others then differs from vanilla's lone run
by ~1e-3 in logprobs -- the size of one corrupted page's signal (:data:`LOGPROB_ATOL`) -- in 10
server tests on such a host, whatever the pool did. In float32 the same comparison is ~5e-7 in
the GEMM, ~1e-6 in logprobs, on any CPU (AMD EPYC hosts were batch-invariant in fp16 too)."""

ServerSpec = tuple[Path, Sequence[str], Mapping[str, str] | None]
"""A server's log directory, extra flags and environment additions (:func:`running_servers`)."""


@contextmanager
def running_servers(model_dir: Path, specs: Sequence[ServerSpec], *, zygote: LaunchZygote | None = None,
                    base_env: Mapping[str, str] | None = None,
                    on_spawn: Callable[[SGLangServer], object] | None = None) -> Iterator[tuple[SGLangServer, ...]]:
    """:func:`running_server` for several servers, started side by side: every one is spawned
    before any is waited for (a lone start-up leaves one of this host's two cores idle while the
    launcher imports SGLang; a module's servers together take ~1.3x one instead of 2x). Their
    ports are distinct and below the ephemeral range (:mod:`controlplane.service.ports`).
    ``base_env``: the environment their additions go onto (default ``os.environ``); ``on_spawn``:
    called with each server once spawned, before the wait (an early start registers its stop)."""
    ports = free_ports(len(specs))
    servers = tuple(
        SGLangServer(model_dir, log_path=root / "server.log", extra_args=[*TEST_DTYPE_ARGS, *extra],
                     env=dict(env or {}), base_env=base_env,
                     startup_timeout_s=STARTUP_TIMEOUT_S, port=port, avoid_ports=tuple(ports), zygote=zygote)
        for (root, extra, env), port in zip(specs, ports, strict=True)
    )
    try:
        for server in servers:
            server.spawn()
            if on_spawn is not None:
                on_spawn(server)
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def vanilla_server(tiny_model_dir: Path, launch_zygote: LaunchZygote | None,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """SGLang with kvplane installed (entry point) but --enable-layered-kv off."""
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("vanilla"), zygote=launch_zygote) as server:
        yield server


def greedy(server: SGLangServer, prompt: str, max_new_tokens: int = 6, *, logprobs: bool = False) -> dict:
    """One greedy /generate call; returns the response dict (``logprobs``: with per-token logprobs)."""
    payload: dict = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    if logprobs:
        payload["return_logprob"] = True
    return server.post("/generate", payload)


def batched(server: SGLangServer, prompts: Sequence[str], sampling_params: dict | list[dict], *,
            logprobs: bool = False, timeout_s: float = 600.0) -> list[dict]:
    """``prompts`` as one ``/generate`` call of token ids (one response each, in order). SGLang's
    tokenizer manager forwards a batch without text to the scheduler as one message
    (``TokenizerManager._should_use_batch_tokenization``), so the scheduler receives every request
    at once. Concurrent calls, or a batch of texts (tokenized and sent one by one, an ``await``
    between them), reached a loaded CI host's scheduler a whole generation apart: a test that needs
    requests decoding together sends them with this."""
    ids = server.post("/tokenize", {"prompt": list(prompts)})["tokens"]
    payload: dict = {"input_ids": ids, "sampling_params": sampling_params}
    if logprobs:
        payload["return_logprob"] = True
    got = server.post("/generate", payload, timeout_s=timeout_s)  # the whole batch: a loaded host's pace
    assert [o["meta_info"]["prompt_tokens"] for o in got] == [len(i) for i in ids], got
    return got


LOGPROB_ATOL = 1e-4
"""Per-token logprob tolerance against vanilla (the tiny fp32 checkpoint served in float32,
:data:`TEST_DTYPE_ARGS`; both servers compute attention with the same torch SDPA). Measured on
the tiny model: noise between two forwards is ~1e-6, while zeroing one 16-token page of one layer moved the
logprobs by >= 1.4e-3 every time (and changed the greedy token in 0 of 24 cases): comparing
tokens alone cannot see a corrupted page, comparing logprobs can."""


def warmup_forward(path: Path) -> dict:
    """The one forward of SGLang's warm-up that the test injector ran at a server's start
    (``KVPLANE_TEST_WARMUP_DUMMY_FILE``), from its eager runner: backend, rows, seq_lens, rids."""
    records = read_jsonl(path)
    assert len(records) == 1 and records[0]["runner"] == "EagerRunner", records
    (forward,) = records[0]["forwards"]
    assert forward["rows"] == records[0]["batch_size"] > 1, records
    return forward


def token_logprobs(response: dict) -> list[float]:
    """The output tokens' logprobs of a ``greedy(..., logprobs=True)`` response."""
    return [float(entry[0]) for entry in response["meta_info"]["output_token_logprobs"]]


def assert_same_generation(got: dict, want: dict, context: str = "") -> None:
    """Same greedy tokens and per-token logprobs within :data:`LOGPROB_ATOL` (both responses
    from ``greedy(..., logprobs=True)``)."""
    assert got["output_ids"] == want["output_ids"], context
    got_lp, want_lp = token_logprobs(got), token_logprobs(want)
    assert len(got_lp) == len(want_lp) > 0, context
    worst = max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True))
    assert worst <= LOGPROB_ATOL, f"{context}: logprobs differ by {worst:.3g} > {LOGPROB_ATOL}"


def concurrent_as_vanilla(server: SGLangServer, vanilla: SGLangServer, prompts: Sequence[str],
                          new_tokens: int) -> list[dict]:
    """``prompts`` generated on ``server`` all at once (greedy, with logprobs): every one must end
    by length and match ``vanilla``'s lone run (:func:`assert_same_generation`); the responses."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: greedy(server, p, new_tokens, logprobs=True), prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "length", (prompt, out["meta_info"]["finish_reason"])
        assert_same_generation(out, greedy(vanilla, prompt, new_tokens, logprobs=True), prompt)
    return outs


def undetected(server: SGLangServer, reference: SGLangServer, prompts: Sequence[str], new_tokens: int) -> int:
    """How many of ``prompts`` ``server`` generates as ``reference`` does (greedy tokens and
    per-token logprobs, :func:`assert_same_generation`): a negative control's server must
    have none."""
    same = 0
    for prompt in prompts:
        try:
            assert_same_generation(greedy(server, prompt, new_tokens, logprobs=True),
                                   greedy(reference, prompt, new_tokens, logprobs=True), prompt)
        except AssertionError:
            continue
        same += 1
    return same


def result_line(output: str) -> dict | None:
    """The last ``RESULT {json}`` line a test's helper process printed, parsed (None: none)."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else None


FAULT_INJECT_DIR = Path(__file__).parent / "fault_inject"
"""PYTHONPATH entry of the test-only fault injector (``sitecustomize.py``)."""


def fault_inject_path() -> str:
    """A server's ``PYTHONPATH`` with the fault injector: :data:`FAULT_INJECT_DIR` before this
    session's own entries (a fresh server keeps importing kvplane from where this session does,
    and the launch zygote can fork it: ``LaunchZygote.why_not``)."""
    return os.pathsep.join([str(FAULT_INJECT_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])


@contextmanager
def flag_file(flag: Path) -> Iterator[None]:
    """``flag`` exists while inside: the switch of one of the test-only injector's
    ``KVPLANE_TEST_*_FILE`` behaviours, which act only while their file exists."""
    flag.touch()
    try:
        yield
    finally:
        flag.unlink(missing_ok=True)


@contextmanager
def fault_armed(server: SGLangServer, flag: Path) -> Iterator[None]:
    """The test-only injector's fault behind ``flag`` acting while inside (:func:`flag_file`);
    on exit ``server``'s prefix cache is flushed too, so no later request reads KV the fault wrote
    (a module's layered server is its own negative control, where a twin server with the fault
    always on cost one more SGLang start-up)."""
    try:
        with flag_file(flag):
            yield
    finally:
        server.flush_cache()


OFFLOAD_LAYERED: tuple[str, ...] = ("--enable-layered-kv", "--disable-overlap-schedule", "--kv-gpu-budget-tokens",
                                    "49", "--max-total-tokens", "48")
"""As ``test_layered_offload_server``: one layer of the 48-token slot space plus the padding page
(at least half of a 16-token request's layer-KV on host)."""


@contextmanager
def offload_pair(model_dir: Path, zygote: LaunchZygote | None, roots: tuple[Path, Path],
                 common: Sequence[str]) -> Iterator[tuple[SGLangServer, SGLangServer, Path, Path]]:
    """Vanilla and an :data:`OFFLOAD_LAYERED` server, both with ``common`` flags, side by side:
    ``(vanilla, layered, the layered server's stats file, its fault flag file)``. The layered one
    loads the test-only fault injector, which perturbs one written-back page of layer 3 after
    every step while the flag is armed (:func:`fault_armed`)."""
    stats, flag = roots[1] / "pool_stats.jsonl", roots[1] / "corrupt"
    env = {POOL_STATS_FILE_ENV: str(stats), "PYTHONPATH": fault_inject_path(),
           "KVPLANE_TEST_CORRUPT_LAYER": "3", "KVPLANE_TEST_CORRUPT_FILE": str(flag)}
    specs = [(roots[0], list(common), None), (roots[1], [*common, *OFFLOAD_LAYERED], env)]
    with running_servers(model_dir, specs, zygote=zygote) as (vanilla, layered):
        yield vanilla, layered, stats, flag


def assert_matches_with_kv_on_host(vanilla: SGLangServer, layered: SGLangServer, stats: Path,
                                   prompts: Sequence[str], new_tokens: int) -> list[dict]:
    """Each of ``prompts`` generates on ``layered`` as on ``vanilla`` (greedy tokens and logprobs)
    while at least half of the live layer-KV sits on host and pages are fetched; returns the
    layered server's stats lines of those steps."""
    before = len(read_jsonl(stats)) if stats.exists() else 0
    for prompt in prompts:
        assert_same_generation(greedy(layered, prompt, new_tokens, logprobs=True),
                               greedy(vanilla, prompt, new_tokens, logprobs=True), prompt)
    steps = [s for s in read_jsonl(stats)[before:] if s["live_layer_pages"] > 0]
    assert len(steps) >= len(prompts) * new_tokens // 2
    live = sum(s["live_layer_pages"] for s in steps)
    assert sum(s["host_layer_pages"] for s in steps) / live >= 0.5
    assert steps[-1]["fetched_layer_pages_total"] > steps[0]["fetched_layer_pages_total"]
    return steps
