"""Bad inputs answered where they enter, against a real layered server with --kv-pacing off (issue 17).

Scenario: one layered server, pacing off, launched with a valid ``--kv-policy`` file and
``--kv-host-pool-gb`` exactly at the floor the launcher computes for the tiny model
(:class:`~sglang_ext.host_pool_floor.HostPoolFloor`). Before the fix, a bad
``custom_params.kvplane_slo_tbt_ms`` was rejected only on streaming requests with pacing on; here
every request kind answers 400 naming the field and the value, and a valid override is served.
The launch itself is the negative control of the launcher's refusals
(``test_launch_validation.py``): a valid policy passes, and a cap at the floor is accepted by the
launcher and by the scheduler's own check of the pool it builds (the floor is not too high).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from sglang_ext.host_pool_floor import HostPoolFloor
from sglang_ext.request_slo import SLO_PARAM
from sglang_ext.testing.server import SGLangServer
from sglang_ext.tools.workload import SHARED_HOST_ARGS
from tests.sglang.conftest import running_server
from tests.sglang.request_kinds import (
    KINDS,
    assert_slo_checked_on_every_kind,
    request_body,
    send,
    served_tokens,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # a server start-up on a loaded host

TINY_FLOOR = HostPoolFloor(layers=4, kv_heads=2, head_dim=16, dtype_bytes=4, page_size=1, max_total_tokens=4096)
"""The tiny model (TinyModelSpec: 4 layers, 2 KV heads x 16, served in float32 by every test
server: ``conftest.TEST_DTYPE_ARGS``) under the CPU recipe (``--max-total-tokens 4096``, page size 1)."""


@pytest.fixture(scope="module")
def unpaced_server(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[SGLangServer]:
    """A layered server with pacing off, a valid policy file and the host pool capped at the floor
    (a budget of half the slot space's layer-pages: without one every layer is on the device and
    no host pool is built, ``SlotStoreConfig.host_tier``)."""
    root = tmp_path_factory.mktemp("slo-unpaced")
    policy = root / "policy.yaml"
    policy.write_text("slo_tbt_ms: 200\nwindow_min: 4\nwindow_max: 32\n")
    flags = [
        *SHARED_HOST_ARGS, "--enable-layered-kv", "--kv-pacing", "off", "--kv-policy", str(policy),
        "--kv-host-pool-gb", f"{TINY_FLOOR.min_gb}", "--kv-gpu-budget-tokens", "8192",
    ]
    with running_server(tiny_model_dir, root, flags, zygote=launch_zygote) as server:
        yield server


def test_bad_slo_is_a_400_on_every_request_kind_with_pacing_off(unpaced_server: SGLangServer) -> None:
    """/generate, /v1/completions, /v1/chat/completions, streaming or not: each bad SLO value is a
    400 naming the field and the value; 150 ms is served on each."""
    assert_slo_checked_on_every_kind(unpaced_server)


def test_host_pool_cap_at_the_floor_is_what_the_pool_needs(unpaced_server: SGLangServer) -> None:
    """The scheduler built the pool the launcher's floor describes: same pages, and its bytes fit
    the cap (the floor is neither below the real need nor above it)."""
    text = unpaced_server.log_path.read_text(errors="replace")
    match = re.search(r"layered_kv_pool_created.*?host_tier=True.*?logical_pages=(\d+).*?page_size=(\d+)", text)
    assert match, unpaced_server.log_tail()
    pages, page_size = int(match.group(1)), int(match.group(2))
    assert (pages, page_size) == (TINY_FLOOR.min_pages, TINY_FLOOR.page_size)
    assert TINY_FLOOR.min_bytes <= TINY_FLOOR.min_gb * 1e9 < TINY_FLOOR.min_bytes + 1000


def test_flag_off_leaves_custom_params_to_sglang(vanilla_server: SGLangServer) -> None:
    """Negative control: without --enable-layered-kv the same bad value is served (200) on every
    kind, so the 400s above are kvplane's check, not SGLang's."""
    for path, stream in KINDS:
        status, text = send(vanilla_server, path, request_body(path, stream, "fast"))
        assert status == 200 and served_tokens(path, stream, text), (path, stream, status, text[:300])


def test_a_custom_params_that_is_not_an_object_is_a_400_on_generate(unpaced_server: SGLangServer) -> None:
    """/generate served a ``custom_params`` written as a string or a list (the override inside it
    dropped silently, HTTP 200); it is a 400 naming the field now, streaming or not, as on
    /v1/responses. Control: the same request with the object form is served."""
    for stream in (False, True):
        for custom in (f"{SLO_PARAM}=-1", [{SLO_PARAM: -1}]):
            body = request_body("/generate", stream, 150)
            body["sampling_params"]["custom_params"] = custom
            status, text = send(unpaced_server, "/generate", body)
            assert status == 400 and "custom_params=" in text and "allowed: an object" in text, (stream, status, text[:300])
        status, text = send(unpaced_server, "/generate", request_body("/generate", stream, 150))
        assert status == 200 and served_tokens("/generate", stream, text), (stream, status, text[:300])


def test_a_rid_past_the_id_limit_is_a_400(unpaced_server: SGLangServer) -> None:
    """A caller-chosen ``rid`` past 240 characters (the control plane's 256 less room for SGLang's
    ``_N`` suffix): the gRPC control plane refused a step report naming a long id, so it kept its
    worker in fallback while it ran; it is a 400 naming the limit on /generate (streaming or not)
    and the OpenAI endpoints. Control: 240 characters are served."""
    for path, stream in KINDS:
        for length, want in ((241, 400), (240, 200)):
            body = request_body(path, stream, 150)
            body["rid"] = f"{path.strip('/').replace('/', '-')}-{int(stream)}-".ljust(length, "r")
            status, text = send(unpaced_server, path, body)
            assert status == want, (path, stream, length, status, text[:300])
            if want == 400:
                assert f"rid has {length} characters (allowed at most 240" in text, (path, stream, text[:300])
            else:
                assert served_tokens(path, stream, text), (path, stream, text[:300])


def test_a_beam_search_is_a_400_and_the_server_keeps_serving(unpaced_server: SGLangServer) -> None:
    """SGLang 0.5.23 accepts ``beam_width`` 2 at page size 1 (this recipe's); under the layered
    pool its first decode step killed the scheduler (every later request: connection refused).
    It is a 400 naming the field, streaming or not, and the next request is served."""
    for stream in (False, True):
        body = request_body("/generate", stream, 150)
        body["sampling_params"]["beam_width"] = 2
        status, text = send(unpaced_server, "/generate", body)
        assert status == 400 and "sampling_params.beam_width=2 is not served" in text, (stream, status, text[:300])
        status, text = send(unpaced_server, "/generate", request_body("/generate", stream, 150))
        assert status == 200 and served_tokens("/generate", stream, text), (stream, status, text[:300])
