"""Bad kvplane launch options stop `python -m sglang.launch_server` with a message naming the flag.

Every refusal is one ``kvplane:`` line on stderr and exit status 2, before any subprocess starts
(no scheduler, no model loaded). The file contents and the host-pool floor have their own unit
tests (``test_launch_files.py``, ``test_host_pool_floor.py``); here the real launcher answers one
case of each, and ``test_request_slo_server.py`` launches with a valid policy and a cap at the
floor (their negative control).

Each refusal is a launcher process that spends ~25 s of CPU importing SGLang before it refuses;
one after another they took ~6 minutes of the suite. So the cases are forks of the session's
launch zygote (``tests/sglang/conftest.py:launch_zygote``: SGLang imported once; each fork runs
the code ``python -m sglang.launch_server`` runs, with the case's argv and environment), all
started at once. The cases the zygote cannot reproduce (an ``SGLANG_*`` variable, read by
SGLang at import) launch fresh processes, as does one flag case: a test checks that its fresh
launch and its fork print the same line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.testing.early_starts import EarlyStarts
from sglang_ext.testing.launch_zygote import LaunchZygote
from tests.conftest import uses_fixture
from tests.service.certs import ThrowawayCA
from tests.sglang.conftest import sglang_missing, tiny_model
from tests.sglang.test_model_support import model_dir

pytestmark = pytest.mark.sglang

REMOTE = ["--kv-control-plane", "grpc://127.0.0.1:50051"]


def launcher_argv(model_dir: Path, *extra: str) -> list[str]:
    """The launcher's flags: --enable-layered-kv on the CPU recipe's device, then ``extra``."""
    return ["--model-path", str(model_dir), "--device", "cpu", "--max-total-tokens", "4096",
            "--enable-layered-kv", *extra]


def launch(model_dir: Path, *extra: str, env: dict[str, str] | None = None,
           base_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the launcher with --enable-layered-kv on the CPU recipe's device (``env`` added to
    ``base_env``, default ``os.environ``); it must exit by itself."""
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *launcher_argv(model_dir, *extra)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**(os.environ if base_env is None else base_env), **(env or {})},
    )


CONCURRENT_LAUNCHES = 4
"""Launcher processes at once (each is one mostly single-threaded import; 24 GiB hold four)."""


def launch_all(
    model_dir: Path, cases: Mapping[str, tuple[Sequence[str], Mapping[str, str] | None]]
) -> dict[str, subprocess.CompletedProcess[str]]:
    """:func:`launch` of every case (name -> extra flags, environment), run concurrently."""
    with ThreadPoolExecutor(max_workers=CONCURRENT_LAUNCHES) as pool:
        futures = {
            name: pool.submit(launch, model_dir, *extra, env=dict(env or {})) for name, (extra, env) in cases.items()
        }
        return {name: future.result() for name, future in futures.items()}


def forkable(zygote: LaunchZygote | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher with ``env`` added to ``os.environ`` can be a fork of ``zygote``
    (:meth:`LaunchZygote.why_not`)."""
    return zygote is not None and zygote.why_not({**os.environ, **(env or {})}, sys.executable) is None


def launch_forked(
    zygote: LaunchZygote, model_dir: Path, cases: Mapping[str, tuple[Sequence[str], Mapping[str, str] | None]],
    work: Path,
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case (name -> extra flags, environment) forked from ``zygote``, all at once; each
    result as :func:`launch` would return it (exit status; stdout and stderr together, as
    ``stderr``: the fork writes both to one file)."""
    started = {}
    for name, (extra, env) in cases.items():
        argv = launcher_argv(model_dir, *extra)
        started[name] = (argv, zygote.launch(argv, {**os.environ, **(env or {})}, work / f"{name}.log", os.getcwd()))
    results = {}
    deadline = time.monotonic() + CASE_TIMEOUT_S
    for name, (argv, proc) in started.items():
        try:
            returncode = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:  # not refused: it went on to start a server
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait(timeout=60)
        results[name] = subprocess.CompletedProcess(argv, returncode, "", (work / f"{name}.log").read_text())
    return results


CASE_TIMEOUT_S = 180.0
"""A forked case still running this long after the forks started was not refused (it is killed,
with its process group, and fails its test on the status)."""


def kvplane_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("kvplane:")]


def assert_refused_in_one_line(proc: subprocess.CompletedProcess[str], fragment: str) -> None:
    """Exit status 2, exactly one kvplane line holding ``fragment``, no traceback, no model load."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    lines = kvplane_lines(proc)
    assert len(lines) == 1 and fragment in lines[0], output[-3000:]
    assert "Traceback" not in output and "Load weight" not in output, output[-3000:]


BAD_OPTIONS: list[tuple[list[str], str]] = [
    (["--kv-scheduler", "sjf"], "kvplane: invalid launch option: --kv-scheduler='sjf' is invalid; allowed: fcfs, layerkv, lvf"),
    (["--radix-cache-backend", "foo"], "kvplane: --enable-layered-kv needs --radix-cache-backend layered (implied), got 'foo'"),
    (["--kv-profile", "/nonexistent-kvplane-dir/profile.json"],
     "kvplane: invalid launch option: --kv-profile='/nonexistent-kvplane-dir/profile.json': no such file"),
    (["--attention-backend", "fa3"],
     "kvplane: --attention-backend fa3 reads SGLang's flat KV buffers, which the layered KV pool "
     "does not have; on cpu use torch_native or triton (or leave it unset)"),
    (["--attention-backend", "torch_native", "--kv-cache-dtype", "fp8_e4m3"],
     "kvplane: --kv-cache-dtype fp8_e4m3: quantized KV caches are not supported with --enable-layered-kv"),
    (["--attention-backend", "torch_native", "--cuda-graph-backend-decode", "full"],
     "kvplane: --cuda-graph-backend-decode full: CUDA graph capture is not supported with "
     "--enable-layered-kv"),
    (["--kv-cuda-graphs", "on", "--attention-backend", "torch_native"],
     "kvplane: --kv-cuda-graphs on with --attention-backend torch_native: only the layered paged decodes "
     "(triton and flashinfer) read their tables from persistent buffers a graph replays"),
    (["--kv-cuda-graphs", "yes"], "kvplane: invalid launch option: --kv-cuda-graphs='yes' is invalid; allowed: on, off"),
    (["--enable-lmcache"],
     "kvplane: --enable-lmcache: LMCache is a second KV tier with a radix cache of its own"),
    (["--enable-memory-saver"], "kvplane: --enable-memory-saver: the layered KV pool's device pages"),
    (["--tokenizer-worker-num", "2"], "kvplane: --tokenizer-worker-num > 1: SGLang loads no plugins in its extra "
     "tokenizer worker processes"),
]
"""Bad flags and the line the launcher prints for each (without kvplane's refusal, the three last
start the server: LMCache's scheduler stops at its first step on kvplane's radix cache with a bare
``NotImplementedError``, measured in session 44; the memory saver's would not release the pool;
two tokenizer workers served a request whose ``kvplane_slo_tbt_ms`` is -1, which one answers with
HTTP 400, also measured in session 44)."""

BAD_ENV: list[tuple[dict[str, str], str]] = [
    ({"KVPLANE_LOG_LEVEL": "chatty"},
     "kvplane: KVPLANE_LOG_LEVEL: 'chatty' is not a log level (allowed: debug, info, warning"),
    ({"SGLANG_RUST_SERVER": "1"}, "kvplane: SGLANG_RUST_SERVER=1: SGLang's Rust server replaces the API server"),
    ({"KVPLANE_STATS_FILE": "/nonexistent-kvplane-dir/stats.jsonl"},
     "kvplane: KVPLANE_STATS_FILE='/nonexistent-kvplane-dir/stats.jsonl': directory "
     "'/nonexistent-kvplane-dir' does not exist"),
]
"""Bad ``KVPLANE_*`` variables and the line the launcher prints for each."""


def _file(root: Path, name: str, content: str | bytes) -> str:
    path = root / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


def _worker_pair(root: Path) -> tuple[str, str]:
    worker = ThrowawayCA().issue("worker", server=False)
    return _file(root, "worker.crt", worker.cert_pem), _file(root, "worker.key", worker.key_pem)


def _expired_pair(root: Path) -> list[str]:
    """--kv-tls-cert/--kv-tls-key of a client certificate that expired yesterday."""
    import datetime

    day = datetime.timedelta(days=1)
    worker = ThrowawayCA().issue("worker", server=False, valid=(-90 * day, -day))
    return ["--kv-tls-cert", _file(root, "worker.crt", worker.cert_pem), "--kv-tls-key", _file(root, "worker.key", worker.key_pem)]


BAD_LAUNCH_FILES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "policy-invalid-json": (
        lambda d: ["--kv-policy", _file(d, "policy.json", '{"slo_tbt_ms": 100,')],
        "kvplane: invalid launch option: --kv-policy: policy file '{d}/policy.json': not valid YAML/JSON",
    ),
    "policy-negative-slo": (
        lambda d: ["--kv-policy", _file(d, "policy.yaml", "slo_tbt_ms: -5\n")],
        "--kv-policy: policy file '{d}/policy.yaml': slo_tbt_ms: -5 is out of range",
    ),
    "host-pool-below-floor": (
        lambda d: ["--kv-host-pool-gb", "0.0001"],
        "kvplane: invalid launch option: --kv-host-pool-gb=0.0001 is out of range [0.002098, 65536] (GB)",
    ),
    "host-pools-over-host-memory": (  # one KV head a rank at --tp-size 2; the control: every launch of 4096 tokens
        lambda d: ["--tp-size", "2", "--max-total-tokens", "100000000000"],  # 102 TB: no host holds it
        "kvplane: invalid launch option: the 2 scheduler processes this launch starts on this host "
        "(--tp-size x --pp-size x --dp-size / --nnodes) each pin a host KV pool of every layer of "
        "--max-total-tokens 100000000000 = 25600.000 GB and its device KV pool, host memory on CPU, "
        "25600.000 GB: 102400.000 GB in all, more than 80% of the host's available memory when the server "
        "was launched",
    ),
    "tls-ca-garbage": (
        lambda d: [*REMOTE, "--kv-tls-ca", _file(d, "ca.pem", "-----BEGIN CERTIFICATE-----\ngarbage\n")],
        "--kv-tls-ca='{d}/ca.pem': not a PEM certificate file",
    ),
    "tls-cert-garbage": (
        lambda d: [*REMOTE, "--kv-tls-cert", _file(d, "c.pem", "garbage"), "--kv-tls-key", _worker_pair(d)[1]],
        "--kv-tls-cert='{d}/c.pem': not a PEM certificate file",
    ),
    "tls-key-garbage": (
        lambda d: [*REMOTE, "--kv-tls-cert", _worker_pair(d)[0], "--kv-tls-key", _file(d, "k.pem", "garbage")],
        "--kv-tls-key='{d}/k.pem': not an unencrypted PEM private key",
    ),
    "model-mla": (
        lambda d: ["--model-path", str(model_dir(d, "deepseek_v3"))],
        "kvplane: DeepseekV3ForCausalLM uses MLA attention (one compressed latent KV per token)",
    ),
    "model-sinks": (
        lambda d: ["--model-path", str(model_dir(d, "gpt_oss"))],
        "kvplane: GptOssForCausalLM uses attention sinks",
    ),
    "model-fp8-kv": (
        lambda d: ["--model-path", str(model_dir(d, "llama_fp8_kv"))],
        "kvplane: LlamaForCausalLM's checkpoint quantizes the KV cache (FP8)",
    ),
    "recompute-layers-past-the-model": (  # clamped silently before (plugin review, session 77)
        lambda d: ["--kv-recompute-ratio", "0.5", "--kv-recompute-layers", "5"],
        "kvplane: invalid launch option: --kv-recompute-layers=5 is out of range [0, 4] (the model's layers)",
    ),
    "token-file-empty": (
        lambda d: [*REMOTE, "--kv-policy-token-file", _file(d, "token", "\n")],
        "--kv-policy-token-file: token file '{d}/token': is empty",
    ),
    "token-file-two-lines": (  # `openssl rand -base64 64`: gRPC metadata cannot carry it (accepted before)
        lambda d: [*REMOTE, "--kv-policy-token-file", _file(d, "token", "A" * 64 + "\n" + "B" * 24 + "\n")],
        "--kv-policy-token-file: token file '{d}/token': character 65 of the token is a line break",
    ),
    "tls-cert-expired": (  # every handshake would fail (accepted before)
        lambda d: [*REMOTE, "--kv-tls-ca", _file(d, "ca.crt", ThrowawayCA().cert_pem), *_expired_pair(d)],
        "kvplane: invalid launch option: --kv-tls-cert='{d}/worker.crt': the certificate has expired (notAfter ",
    ),
}
"""Issue 17's bad launch files and cap, and issue 14's unsupported models (config-only model
directories, ``test_model_support.py``; the later ``--model-path`` wins): the flags for a
directory, the line the launcher prints."""


FRESH_CASE = "fresh-option0"
"""The flag case launched as a fresh process on purpose (compared with its fork)."""
EARLY_CASES: dict[str, tuple[Sequence[str], Mapping[str, str] | None]] = {
    FRESH_CASE: (BAD_OPTIONS[0][0], None),
    "env1": ((), BAD_ENV[1][0]),  # SGLANG_RUST_SERVER: read by SGLang at import, so never forked
}
"""The cases that launch fresh processes under a zygote, launched at the end of collection."""
EARLY_NAME = "launch-validation-fresh-cases"


def early_start(early: EarlyStarts, tmp_path_factory: pytest.TempPathFactory, items: list[pytest.Item]) -> None:
    """Launch :data:`EARLY_CASES` at the end of collection (``tests/conftest.py``), one after the
    other: their ~25 s of imports each run beside the suite's first tests; :func:`launched` takes
    the results."""
    if sglang_missing() or not uses_fixture(items, "launched"):
        return
    early.submit(EARLY_NAME, lambda: {
        name: launch(tiny_model(early, tmp_path_factory), *extra, env=dict(env or {}), base_env=early.env)
        for name, (extra, env) in EARLY_CASES.items()})


@pytest.fixture(scope="module")
def launched(
    tiny_model_dir: Path, launch_zygote: LaunchZygote | None, tmp_path_factory: pytest.TempPathFactory,
    early_starts: EarlyStarts,
) -> dict[str, tuple[subprocess.CompletedProcess[str], Path | None]]:
    """Every case of this module launched at once: name -> (the launcher's result, its files'
    directory); :data:`EARLY_CASES` from the end of collection (:func:`early_start`) if they ran there."""
    cases: dict[str, tuple[Sequence[str], Mapping[str, str] | None]] = {}
    dirs: dict[str, Path | None] = {}
    for i, (extra, _) in enumerate(BAD_OPTIONS):
        cases[f"option{i}"], dirs[f"option{i}"] = (extra, None), None
    for i, (env, _) in enumerate(BAD_ENV):
        cases[f"env{i}"], dirs[f"env{i}"] = ((), env), None
    for name, (flags, _) in BAD_LAUNCH_FILES.items():
        d = tmp_path_factory.mktemp(f"launch-{name}")
        cases[f"file-{name}"], dirs[f"file-{name}"] = (flags(d), None), d
    fresh = {FRESH_CASE: cases["option0"]}
    dirs[FRESH_CASE] = None
    forked = {}
    for name, (extra, env) in cases.items():
        (forked if forkable(launch_zygote, env) else fresh)[name] = (extra, env)
    assert launch_zygote is None or set(fresh) == {FRESH_CASE, "env1"}, sorted(fresh)  # SGLANG_RUST_SERVER
    try:
        results = early_starts.take(EARLY_NAME) or {}
    except subprocess.TimeoutExpired:  # launched beside the suite's start on a busy host: launched again
        results = {}  # below, once (a launcher that does not exit by itself then fails its test here)
    fresh = {name: case for name, case in fresh.items() if name not in results}
    forked = {name: case for name, case in forked.items() if name not in results}
    with ThreadPoolExecutor(max_workers=1) as pool:  # the fresh launches run beside the forks
        fresh_results = pool.submit(launch_all, tiny_model_dir, fresh)
        if launch_zygote is not None:
            results.update(launch_forked(launch_zygote, tiny_model_dir, forked, tmp_path_factory.mktemp("launcher-forks")))
        results.update(fresh_results.result())
    return {name: (results[name], dirs[name]) for name in results}


def test_a_forked_launch_refuses_as_a_fresh_launcher_process_does(launched, launch_zygote):
    """The forks run the launcher as a fresh process does: the same exit status and kvplane line
    for the same flags (the other flag and file cases rely on it). Negative control: another
    case's line differs, so the comparison can fail."""
    if launch_zygote is None:
        pytest.skip("no launch zygote in this session (--sglang-fresh-launch): every case is fresh")
    fresh, forked = launched[FRESH_CASE][0], launched["option0"][0]
    assert (fresh.returncode, kvplane_lines(fresh)) == (forked.returncode, kvplane_lines(forked))
    assert kvplane_lines(launched["option1"][0]) != kvplane_lines(fresh)


@pytest.mark.parametrize("i", range(len(BAD_OPTIONS)), ids=[m[:60] for _, m in BAD_OPTIONS])
def test_launcher_rejects_bad_options(launched, i):
    """The launcher exits non-zero before starting any subprocess and prints the reason."""
    assert_refused_in_one_line(launched[f"option{i}"][0], BAD_OPTIONS[i][1])


@pytest.mark.parametrize("i", range(len(BAD_ENV)), ids=[next(iter(e)) for e, _ in BAD_ENV])
def test_launcher_rejects_bad_kvplane_env(launched, i):
    """A bad KVPLANE_* variable stops the launcher with the variable, its value and what is allowed."""
    assert_refused_in_one_line(launched[f"env{i}"][0], BAD_ENV[i][1])


@pytest.mark.parametrize("case", list(BAD_LAUNCH_FILES))
def test_launcher_refuses_bad_files_and_cap_in_one_line(launched, case):
    """A bad --kv-policy / --kv-tls-* / --kv-policy-token-file content, or a --kv-host-pool-gb below
    what the model's KV needs, stops the launcher with one line naming the flag, the file or value
    and the problem, exit status 2, before anything is loaded."""
    proc, d = launched[f"file-{case}"]
    assert_refused_in_one_line(proc, BAD_LAUNCH_FILES[case][1].format(d=d))
