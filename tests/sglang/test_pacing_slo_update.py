"""A live change of the default TBT SLO reaches the pacer (``PacingSloPublisher`` ->
``PacingSloUpdate`` -> ``PluginContext``) without a server: the real embedded control plane's
policy store on the scheduler side, SGLang's own scheduler -> tokenizer pieces (``SenderWrapper``
over a real zmq PUSH/PULL pair, ``wrap_as_pickle`` / ``sock_recv``, ``TypeBasedDispatcher``) in
between, and the real pacing hook on the main-process side. The server-level check (gaps measured
by an HTTP client) is ``tests/sglang/test_pacing_e2e.py``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from controlplane.embedded import EmbeddedControlPlane
from sglang_ext import args as kv_args
from sglang_ext.context import PluginContext
from sglang_ext.pacing import SLO_PARAM, around_stream_one_response
from sglang_ext.pacing_slo_publisher import PacingSloPublisher
from sglang_ext.pacing_slo_update import PacingSloUpdate
from sglang_ext.plugin import KvplanePlugin
from tests.sglang.test_pacing import chunk, collect, fake_source, run_virtual

LAUNCH_MS = 200.0
LIVE_MS = 50.0


def _ctx(pacing: str = "on") -> PluginContext:
    ctx = PluginContext()
    ctx.layered = kv_args.LayeredKVArgs(enable_layered_kv=True, kv_pacing=pacing)
    return ctx


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, 1e8, True, "50"])
def test_an_update_refuses_an_slo_out_of_range(bad: Any) -> None:
    """The message carries only SLOs the policy itself accepts: (0, 1e7] ms, a number."""
    with pytest.raises(ValueError, match="slo_tbt_ms=.* is out of range"):
        PacingSloUpdate(slo_tbt_ms=bad, policy_version=2)
    with pytest.raises(ValueError, match="policy_version=0 is out of range"):
        PacingSloUpdate(slo_tbt_ms=LIVE_MS, policy_version=0)
    assert PacingSloUpdate(slo_tbt_ms=1e7, policy_version=1).slo_tbt_ms == 1e7  # negative control


def test_applying_an_update_sets_the_default_and_ignores_older_versions() -> None:
    """Before any update the launch default paces; an update replaces it; an older version than the
    one applied changes nothing; a newer one does."""
    ctx = _ctx()
    settings = ctx.pacing_settings()
    assert settings is not None and ctx.pacing_default_slo_tbt_ms(settings) == LAUNCH_MS
    assert PacingSloUpdate(LIVE_MS, 3).apply(ctx) is True
    assert ctx.pacing_default_slo_tbt_ms(settings) == LIVE_MS
    assert PacingSloUpdate(80.0, 2).apply(ctx) is False and ctx.live_slo_tbt_ms == LIVE_MS
    assert PacingSloUpdate(80.0, 4).apply(ctx) is True and ctx.pacing_default_slo_tbt_ms(settings) == 80.0
    assert settings.default_slo_tbt_ms == LAUNCH_MS  # the launch settings themselves are not changed


def test_the_publisher_sends_only_a_changed_slo() -> None:
    """Scenario: polls without an update send nothing; an alpha change sends nothing (the pacer
    does not use it); an SLO change sends one update with its version, once; a send that fails is
    logged and the scheduler carries on."""
    cp = EmbeddedControlPlane()
    sent: list[PacingSloUpdate] = []
    publisher = PacingSloPublisher(cp, sent.append)
    assert publisher.sent_slo_tbt_ms == LAUNCH_MS
    assert not publisher.poll() and not publisher.poll() and sent == []
    cp.update_policy({"alpha": 0.5})
    assert not publisher.poll() and sent == []
    version = cp.update_policy({"slo_tbt_ms": LIVE_MS}).version
    assert publisher.poll() and sent == [PacingSloUpdate(LIVE_MS, version)]
    assert not publisher.poll() and len(sent) == 1 and publisher.sent == 1

    def broken(update: Any) -> None:
        raise OSError("socket closed")

    failing = PacingSloPublisher(cp, broken)
    cp.update_policy({"slo_tbt_ms": 70.0})
    assert failing.poll() is False and failing.sent_slo_tbt_ms == LIVE_MS


@pytest.mark.sglang  # the publisher sends through SGLang's wrap_as_pickle
def test_the_publisher_is_built_only_where_the_policy_can_change_and_one_tokenizer_paces() -> None:
    """No endpoint, pacing off, or several tokenizer workers: no publisher."""
    cp = EmbeddedControlPlane()
    channels = SimpleNamespace(send_to_tokenizer=SimpleNamespace(send_output=lambda obj: None))

    def scheduler(workers: int) -> Any:
        return SimpleNamespace(server_args=SimpleNamespace(tokenizer_worker_num=workers), ipc_channels=channels)

    on, off = _ctx("on").layered, _ctx("off").layered
    assert on is not None and off is not None
    endpoint = object()
    assert PacingSloPublisher.for_scheduler(scheduler(1), on, endpoint, cp) is not None  # negative control
    assert PacingSloPublisher.for_scheduler(scheduler(1), on, None, cp) is None
    assert PacingSloPublisher.for_scheduler(scheduler(1), off, endpoint, cp) is None
    assert PacingSloPublisher.for_scheduler(scheduler(2), on, endpoint, cp) is None


@pytest.mark.sglang
@pytest.mark.parametrize("pickle_ipc", [True, False])
def test_an_update_crosses_sglangs_scheduler_to_tokenizer_channel(monkeypatch, tmp_path, pickle_ipc: bool) -> None:
    """Scenario: the publisher sends through SGLang's ``SenderWrapper`` on a real zmq PUSH socket
    (pickle IPC, SGLang's default, and msgpack IPC); the main process receives it with SGLang's
    ``sock_recv`` and dispatches it with the ``TypeBasedDispatcher`` the plugin extended: the
    context's default SLO changes. Without the plugin's dispatcher entry (flag off) SGLang refuses
    the object (negative control)."""
    import zmq
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    from sglang.utils import TypeBasedDispatcher

    monkeypatch.setattr(io_struct, "_USE_PICKLE_IPC", pickle_ipc)
    context = zmq.Context()
    address = f"ipc://{tmp_path}/tokenizer"
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        pull.bind(address)
        push.connect(address)
        cp = EmbeddedControlPlane()
        channels = SimpleNamespace(send_to_tokenizer=SenderWrapper(push))
        scheduler = SimpleNamespace(server_args=SimpleNamespace(tokenizer_worker_num=1), ipc_channels=channels)
        main = _ctx()
        publisher = PacingSloPublisher.for_scheduler(scheduler, main.layered, object(), cp)  # type: ignore[arg-type]
        assert publisher is not None
        tokenizer_manager = SimpleNamespace(_result_dispatcher=TypeBasedDispatcher([]))
        KvplanePlugin(main).after_init_request_dispatcher(None, tokenizer_manager)
        cp.update_policy({"slo_tbt_ms": LIVE_MS})
        assert publisher.poll()
        assert pull.poll(5000), "nothing arrived"
        received = io_struct.sock_recv(pull)
        assert isinstance(received, PacingSloUpdate)
        tokenizer_manager._result_dispatcher(received)
        assert main.live_slo_tbt_ms == LIVE_MS and main.live_slo_version == 2

        plain = SimpleNamespace(_result_dispatcher=TypeBasedDispatcher([]))
        KvplanePlugin(PluginContext()).after_init_request_dispatcher(None, plain)  # flag off: nothing added
        with pytest.raises(ValueError, match="Invalid object"):
            plain._result_dispatcher(received)
    finally:
        push.close(0)
        pull.close(0)
        context.term()


def _second_release_ms(ctx: PluginContext, sampling_params: dict) -> float:
    """When the pacing hook releases a stream's second chunk (three chunks produced at once, the
    stream ending at 1 s; virtual time): one SLO after the first."""
    schedule = [(0.0, chunk(1, "a")), (0.001, chunk(2, "b")), (0.002, chunk(3, "c")), (1.0, chunk(4, "d"))]

    async def original(self: Any, obj: Any, state: Any, request: Any = None) -> Any:
        async for item in fake_source(schedule):
            yield item

    obj = SimpleNamespace(stream=True, rid="r", sampling_params=sampling_params)

    async def main() -> list[tuple[float, dict]]:
        return await collect(around_stream_one_response(ctx, original, object(), obj=obj, state=None, request=None))

    out = run_virtual(main)
    return out[1][0] - out[0][0]


def test_a_new_stream_is_paced_at_the_live_default_and_an_own_slo_wins() -> None:
    """Through the real pacing hook: at the launch default a stream's second chunk leaves 200 ms
    after its first; after an update to 50 ms, 50 ms after; a stream with its own 120 ms keeps 120 ms."""
    ctx = _ctx()
    assert _second_release_ms(ctx, {}) == pytest.approx(LAUNCH_MS, abs=1e-6)
    PacingSloUpdate(LIVE_MS, 2).apply(ctx)
    assert _second_release_ms(ctx, {}) == pytest.approx(LIVE_MS, abs=1e-6)
    assert _second_release_ms(ctx, {"custom_params": {SLO_PARAM: 120}}) == pytest.approx(120.0, abs=1e-6)
