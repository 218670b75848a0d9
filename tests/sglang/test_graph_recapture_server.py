"""Decode graphs recaptured after a weight update (``/update_weights_from_disk`` with
``recapture_cuda_graph``), under ``--kv-cuda-graphs on``, on this CPU.

SGLang recaptures by building a new decode graph runner, which calls the attention backend's
``init_cuda_graph_state`` again and captures every size again (RL loops update weights this way).
Two servers of ``test_graph_server.py``'s offload kind (most KV on host: staged steps replay), on
the layered Triton decode and on the layered FlashInfer decode over the stand-in wrapper, with
the test injector's tape graphs and its CPU recapture (``KVPLANE_TEST_CPU_RECAPTURE``: SGLang
recaptures on CUDA only; the injector makes the same call here). Each server reloads the same
weights with a recapture: the update succeeds, every size is captured again, the later decode
steps replay, and the outputs equal the ones before the update (the same weights). Controls:
replays over tables that were not loaded (Triton) and replays not planned for their step
(FlashInfer) after the recapture differ.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    LOGPROB_ATOL,
    PROMPTS,
    fault_armed,
    fault_inject_path,
    running_servers,
)
from tests.sglang.test_graph_server import (
    GRAPHS,
    NEW_TOKENS,
    OFFLOAD,
    TRITON,
    _generate,
    _tape,
    _worst,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]

NAMES = ("triton", "flashinfer")


@pytest.fixture(scope="module")
def servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[dict]:
    roots = {name: tmp_path_factory.mktemp(f"recapture-{name}") for name in NAMES}

    def env(name: str) -> dict[str, str]:
        root = roots[name]
        return {"TRITON_INTERPRET": "1", "PYTHONPATH": fault_inject_path(), "KVPLANE_TEST_CPU_RECAPTURE": "1",
                "KVPLANE_TEST_TAPE_GRAPHS": str(root / "tape.log"),
                "KVPLANE_TEST_STALE_GRAPH_FILE": str(root / "stale"),
                **({"KVPLANE_TEST_FLASHINFER_STAND_IN": "1", "KVPLANE_TEST_UNPLANNED_REPLAY_FILE": str(root / "unplanned")}
                   if name == "flashinfer" else {})}

    specs = [(roots[name], [*TRITON, *GRAPHS, *OFFLOAD], env(name)) for name in NAMES]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as started:
        yield {**dict(zip(NAMES, started, strict=True)), "roots": roots, "model": tiny_model_dir}


def _one_at_a_time(server: SGLangServer) -> list[dict]:
    server.flush_cache()
    out = [r for prompt in PROMPTS[:3] for r in _generate(server, [prompt])]
    server.flush_cache()
    return out


@pytest.mark.parametrize("name", NAMES)
def test_a_recapture_after_a_weight_update_replays_and_decodes_as_before(servers, name):
    server, root = servers[name], servers["roots"][name]
    before = _one_at_a_time(server)
    tape = _tape(root)
    got = server.post("/update_weights_from_disk", {"model_path": str(servers["model"]),
                                                    "recapture_cuda_graph": True})
    assert got.get("success") is True, got
    recaptured = _tape(root) - tape
    assert {size for kind, size in recaptured if kind == "capture"} == {"1", "2", "4"}, recaptured
    assert "layered_decode_graphs_recapture" in server.log_path.read_text()  # the same buffers, captured again
    tape = _tape(root)
    after = _one_at_a_time(server)
    replays = sum(n for (kind, _), n in (_tape(root) - tape).items() if kind == "replay")
    assert replays >= len(after) * (NEW_TOKENS - 2), replays
    assert _worst(after, before) <= LOGPROB_ATOL
    flag = root / ("unplanned" if name == "flashinfer" else "stale")  # control: the comparison can fail
    with fault_armed(server, flag):
        broken = _one_at_a_time(server)
    assert _worst(broken, before) > 100 * LOGPROB_ATOL
