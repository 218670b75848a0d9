"""`kvplane gpu-check` on hardware nobody ran it on: a phase that raises costs its own figures
only (the copy engines' phases, the overlap and recompute phases), never the whole run's."""

from __future__ import annotations

import pytest

from kvplane.cli import main
from sglang_ext.tools.gpu_check_report import FAIL, PASS
from tests.dataplane.test_gpu_check import (
    EXTEND_KEYS,
    FIGURE_KEYS,
    NOT_ON_CPU,
    TURNOVER_KEYS,
    _result,
)


@pytest.mark.parametrize("phase", ["transfer", "placed", "half-offloaded", "hidden"])
def test_a_copy_engine_phase_that_raises_loses_only_the_dma_figures(tmp_path, monkeypatch, capsys, phase):
    """The copy engines' phases run for the first time on whatever GPU the check is lent: one
    that raises (here every copy while the engine is on ``dma``) is reported in the dma figures'
    notes, with its traceback, and every other figure is still measured and written. ``phase``:
    which one raises first (the earlier ones stood aside); the placed phase, which runs on what
    serves by default, then runs again on the kernels. Negative control: without the phases'
    handlers the exception ends the core check (the transfer check's and the placed phase's: one
    ``core_check`` figure) or the overlap phase (the placements': one ``overlap_check`` figure)."""
    from sglang_ext.tools import gpu_check_overlap, gpu_check_placed, gpu_check_transfer

    def faulty(engine) -> None:  # noqa: ANN001
        raise RuntimeError("driver fault (test)")

    _copy_engines_on_cpu(monkeypatch, faulty)
    if phase != "transfer":  # the transfer check's copy engines stand aside, measuring nothing
        monkeypatch.setattr(gpu_check_transfer, "CopyEnginePhase", _StandAside)
    if phase in ("half-offloaded", "hidden"):  # the placed phase stays on the kernels
        monkeypatch.setattr(gpu_check_placed, "CopyEnginePhase", _StandAside)
    if phase == "hidden":
        monkeypatch.setattr(gpu_check_overlap.OverlapCheck, "_placed_on_copy_engines", lambda self, engine: None)
    argv = ["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", "1", "--out-dir", str(tmp_path)]
    main(argv)
    _, body = _result(tmp_path)
    figures = {f["key"]: f for f in body["figures"]}
    assert set(figures) == FIGURE_KEYS, set(figures) ^ FIGURE_KEYS
    what = {"transfer": "check", "placed": "phase"}.get(phase, "placement")
    raised = f"the {phase} {what} on the copy engines raised " \
             "RuntimeError: driver fault (test)"
    for key in NOT_ON_CPU:
        assert figures[key]["value"] is None and raised in figures[key]["note"], (key, figures[key]["note"])
    assert figures["attention_max_abs_err.torch"]["status"] == PASS and figures["step_ms.placed"]["value"] > 0
    assert figures["overlap.hidden_step_rel"]["value"] is not None
    assert "driver fault (test)" in capsys.readouterr().err  # the traceback
    assert body["details"]["placed_engine"] == "triton"  # the placed phase: the kernels measured it
    hidden = body["details"]["kvplane_cpu_ms_per_step"]["hidden"]  # the hidden placement's host time: on
    assert hidden["ms"] > 0 and hidden["engine"] == "triton"  # the kernels, which serve after the fault
    # control: the phases without the handler (CopyEnginePhase's report-and-absorb re-raises)
    monkeypatch.setattr(gpu_check_transfer, "dma_phase_failed",
                        lambda phase, exc, batch: (_ for _ in ()).throw(exc))
    assert main(argv) == 1
    _, body = _result(tmp_path)
    keys = [f["key"] for f in body["figures"]]
    if phase in ("transfer", "placed"):  # the core check's own part: it ends there (the extend phase runs apart)
        assert keys == ["core_check", *EXTEND_KEYS], keys
    else:  # inside the overlap phase: its figures give way to one failed figure
        assert "overlap_check" in keys and "overlap.hidden_step_rel" not in keys and "stall_rel_err" in keys, keys


@pytest.mark.parametrize("phase", ["overlap", "recompute", "extend", "turnover"])
def test_a_phase_that_raises_fails_its_own_figure_only(tmp_path, monkeypatch, capsys, phase):
    """The overlap, recompute, batch-change and extend phases run after the core figures are
    measured: one that raises becomes one failed figure naming the exception (``overlap_check`` /
    ``recompute_check`` / ``turnover_check`` / ``extend_check``), its traceback on stderr; the
    core's figures and the other phases' are kept. Negative control: the core check itself
    raising keeps its details so far but only the ``core_check`` figure of its own (the extend
    phase, apart from it, keeps its figures; the batch-change phase, which needs the core check's
    batch whole, does not run)."""
    from sglang_ext.tools import (
        gpu_check_extend,
        gpu_check_overlap,
        gpu_check_recompute,
        gpu_check_turnover,
    )
    from sglang_ext.tools.gpu_check_measure import CoreCheck

    cls = {"overlap": gpu_check_overlap.OverlapCheck, "recompute": gpu_check_recompute.RecomputeCheck,
           "extend": gpu_check_extend.ExtendCheck, "turnover": gpu_check_turnover.TurnoverCheck}[phase]

    def broken(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise RuntimeError(f"{phase} fault (test)")

    monkeypatch.setattr(cls, "run", broken)
    argv = ["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", "1", "--out-dir", str(tmp_path)]
    assert main(argv) == 1
    _, body = _result(tmp_path)
    figures = {f["key"]: f for f in body["figures"]}
    failed = figures.pop(f"{phase}_check")
    assert failed["status"] == FAIL and failed["note"] == f"RuntimeError: {phase} fault (test)"
    mine = {"overlap": {"overlap.hidden_step_rel", "overlap.hidden_step_rel.dma", "duplex_vs_one_direction.dma",
                        "overlap.fetch_launch_ms"},
            "recompute": {"recompute_step_rel_err", "recompute_attention_max_abs_err"},
            "extend": set(EXTEND_KEYS), "turnover": set(TURNOVER_KEYS)}[phase]
    assert set(figures) == FIGURE_KEYS - mine, set(figures) ^ (FIGURE_KEYS - mine)
    assert figures["step_ms.placed"]["value"] > 0 and figures["attention_max_abs_err.torch"]["status"] == PASS
    host = body["details"]["kvplane_cpu_ms_per_step"]
    share, resident_ms = figures["kvplane_cpu_share"]["value"], figures["step_ms.resident"]["value"]
    if phase == "overlap":  # no hidden placement measured: the half-offloaded step's host time grades instead
        assert host["hidden"] is None and "hidden placement: not measured" in figures["kvplane_cpu_share"]["note"]
        assert share == pytest.approx(max(host["resident"], host["placed"]) / resident_ms)
    else:  # control: the hidden placement's host time grades with the all-resident step's
        assert host["hidden"]["ms"] > 0 and "hidden placement: not" not in figures["kvplane_cpu_share"]["note"]
        hidden = host["hidden"]
        assert share == pytest.approx(max(host["resident"] / resident_ms, hidden["ms"] / hidden["resident_step_ms"]))
    assert f"{phase} fault (test)" in capsys.readouterr().err
    monkeypatch.setattr(CoreCheck, "_figures", broken)  # control: a fault in the core check's own part
    assert main(argv) == 1
    _, body = _result(tmp_path)
    extend = ["extend_check"] if phase == "extend" else EXTEND_KEYS
    assert [f["key"] for f in body["figures"]] == ["core_check", *extend]
    assert body["details"]["overlap" if phase == "recompute" else "recompute"]  # measured before the fault
    assert "turnover" not in body["details"]  # the core check did not run through: no batch-change phase


class _StandAside:
    """``CopyEnginePhase`` standing aside: nothing switched, nothing void (``on`` False, no error):
    the phase measures on the kernels and the next phase may still try the copy engines."""

    def __init__(self, phase: str, batch) -> None:  # noqa: ANN001
        self.on, self.error = False, None

    def __enter__(self) -> _StandAside:
        return self

    def __exit__(self, *exc) -> bool:  # noqa: ANN002
        return False


def test_a_refusal_midway_in_the_placed_phase_measures_it_again_on_the_kernels(tmp_path, monkeypatch):
    """The driver can refuse a copy-engine call while serving: the engine turns ``dma`` off and
    the kernels finish (``CudaTransferEngine._dma_copy``), raising nothing. A placed phase begun on
    the copy engines then mixes both; it is measured again on the kernels, and the ``.dma``
    figures say why. Control: without the refusal the phase stays on the copy engines."""
    from sglang_ext.tools import gpu_check_transfer

    refuse_after = {"n": None}

    def refusing(engine) -> None:  # noqa: ANN001
        engine.dma_launches += 1
        if refuse_after["n"] is not None and engine.dma_launches > refuse_after["n"]:
            engine.impl, engine.dma_error = "triton", "cuMemcpyBatchAsync of 2 copies failed: CUresult 1 (test)"

    _copy_engines_on_cpu(monkeypatch, refusing)
    monkeypatch.setattr(gpu_check_transfer, "CopyEnginePhase", _StandAside)  # stands aside
    argv = ["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", "1", "--out-dir", str(tmp_path)]
    main(argv)
    _, body = _result(tmp_path)
    assert body["details"]["placed_engine"] == "dma"  # the control: nothing refused
    assert body["details"]["kvplane_cpu_ms_per_step"]["hidden"]["engine"] == "dma"  # its host time: what serves
    refuse_after["n"] = 3
    main(argv)
    _, body = _result(tmp_path)
    figures = {f["key"]: f for f in body["figures"]}
    assert set(figures) == FIGURE_KEYS, set(figures) ^ FIGURE_KEYS
    assert body["details"]["placed_engine"] == "triton" and figures["step_ms.placed"]["value"] > 0
    for key in NOT_ON_CPU:
        assert "refused a copy-engine call midway" in figures[key]["note"], (key, figures[key]["note"])
    hidden = body["details"]["kvplane_cpu_ms_per_step"]["hidden"]  # the kernels serve from then on
    assert hidden["engine"] == "triton" and hidden["ms"] > 0


@pytest.mark.parametrize("phase", ["placed", "hidden"])
def test_a_fault_inside_a_layer_leaves_the_batch_whole(tmp_path, monkeypatch, capsys, phase):
    """A copy-engine fault inside a layer (the first fetch a layer's exit launches) ends that
    step there: the layers after it never get the step's token. The check writes the batch's
    last token again at every layer (``CheckBatch.rewrite_decoded_token``), so the accuracy
    checks after it (``attention_max_abs_err``, and the recompute phase's, after the overlap
    phase) read what they regenerate and PASS. Negative control: without the rewrite they FAIL
    (the placed phase's fault: the attention check right after; the hidden placement's: the
    recompute phase's, the one after the overlap phase)."""
    import inspect

    from sglang_ext.tools import gpu_check_placed, gpu_check_transfer
    from sglang_ext.tools.gpu_check_batch import CheckBatch

    faults = {"left": 1}

    def inside_a_layer(engine) -> None:  # noqa: ANN001
        if faults["left"] and any(f.function == "end_layer" for f in inspect.stack(0)):
            faults["left"] -= 1
            raise RuntimeError("driver fault inside a layer (test)")

    _copy_engines_on_cpu(monkeypatch, inside_a_layer)
    monkeypatch.setattr(gpu_check_transfer, "CopyEnginePhase", _StandAside)  # stands aside
    if phase == "hidden":  # the placed phase and the half-offloaded placement stay on the kernels
        from sglang_ext.tools import gpu_check_overlap

        monkeypatch.setattr(gpu_check_placed, "CopyEnginePhase", _StandAside)
        monkeypatch.setattr(gpu_check_overlap.OverlapCheck, "_placed_on_copy_engines", lambda self, engine: None)
    accuracy = "attention_max_abs_err.torch" if phase == "placed" else "recompute_attention_max_abs_err"
    argv = ["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", "1", "--out-dir", str(tmp_path)]
    main(argv)
    _, body = _result(tmp_path)
    figures = {f["key"]: f for f in body["figures"]}
    assert faults["left"] == 0 and "driver fault inside a layer (test)" in capsys.readouterr().err
    assert figures[accuracy]["status"] == PASS and figures[accuracy]["value"] < 1e-5, figures[accuracy]
    faults["left"] = 1  # control: the same fault, the batch left as the fault left it
    monkeypatch.setattr(CheckBatch, "rewrite_decoded_token", lambda self: None)
    main(argv)
    _, body = _result(tmp_path)
    figures = {f["key"]: f for f in body["figures"]}
    assert faults["left"] == 0 and figures[accuracy]["value"] > 1e-3, figures[accuracy]


def _copy_engines_on_cpu(monkeypatch: pytest.MonkeyPatch, on_dma_launch) -> None:  # noqa: ANN001
    """The CPU engine stands in for one with copy engines (as a GPU whose driver has them):
    ``set_copy_engine`` only switches ``impl`` (refused once ``dma_error`` is set), each launch
    while on ``dma`` calls ``on_dma_launch(engine)`` first (it may raise, or refuse), the check
    asks for the copy engines, and the test's small segments pass their floor."""
    from sglang_ext.dataplane.transfer_engine import CpuTransferEngine
    from sglang_ext.tools import gpu_check_transfer
    from sglang_ext.tools.gpu_check_measure import CoreCheck

    init, launch, check_init = CpuTransferEngine.__init__, CpuTransferEngine._launch, CoreCheck.__init__

    def tracked(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        init(self, *a, **k)
        self.copy_programs, self.impl, self.dma_error, self.dma_launches = None, "triton", None, 0

    def set_copy_engine(self, name):  # noqa: ANN001, ANN202
        if name == "dma" and self.dma_error is not None:
            return False
        self.impl = name
        return True

    def launched(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self.impl == "dma":
            on_dma_launch(self)
        return launch(self, *a, **k)

    def probed(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        check_init(self, *a, **k)
        self.dma_error = None

    monkeypatch.setattr(CpuTransferEngine, "__init__", tracked)
    monkeypatch.setattr(CpuTransferEngine, "set_copy_engine", set_copy_engine, raising=False)
    monkeypatch.setattr(CpuTransferEngine, "_launch", launched)
    monkeypatch.setattr(CoreCheck, "__init__", probed)
    monkeypatch.setattr(gpu_check_transfer, "DMA_MIN_BYTES", 0)


def test_a_fault_report_closes_the_forward_the_fault_left_open(monkeypatch, capsys):
    """``dma_phase_failed`` after a fault inside a layer (on the simulated CUDA engine): the open
    forward ends -- its staging given back, the compute mark its launches would have cleared
    cleared, so the copies that follow wait on the compute stream's work as it is, the rewrite
    included -- before the batch's last token is written again; the batch then decodes and reads
    exactly. Control: the state the fault leaves (a forward open, a compute mark set)."""
    import dataclasses

    from sglang_ext.tools.gpu_check_config import SMALL
    from sglang_ext.tools.gpu_check_measure import CoreCheck
    from sglang_ext.tools.gpu_check_transfer import dma_phase_failed
    from tests.dataplane import cuda_simulation

    cuda_simulation.install(monkeypatch)
    check = CoreCheck(dataclasses.replace(SMALL, repeat=1), "cpu", "torch")
    b = check.batch
    engine, pipeline = b.core.store.engine, b.core.pipeline
    assert type(engine).__name__ == "CudaTransferEngine"
    b.place([[1, 0] * (check.config.layers // 2) for _ in b.rids])
    check.step()
    fetch = engine.fetch_pages

    def faulty(spec, wait=()):  # noqa: ANN001, ANN202
        engine.mark_compute()  # as end_layer does before a layer's write-back and fetches
        raise RuntimeError("driver fault inside a layer (test)")

    monkeypatch.setattr(engine, "fetch_pages", faulty)
    with pytest.raises(RuntimeError, match="inside a layer"):
        check.step()
    monkeypatch.setattr(engine, "fetch_pages", fetch)
    assert pipeline.active and engine._compute_mark is not None  # the control: what the fault left
    try:
        raise RuntimeError("driver fault inside a layer (test)")
    except RuntimeError as exc:
        why = dma_phase_failed("the test phase", exc, b)
    assert why == "the test phase raised RuntimeError: driver fault inside a layer (test)"
    assert not pipeline.active and engine._compute_mark is None and b.core.store.staging_pages == 0
    check.step()
    assert check.attention_errors()["torch"]["max_abs_err"] == pytest.approx(0.0, abs=1e-5)
    assert "driver fault inside a layer (test)" in capsys.readouterr().err


def test_the_batch_headroom_covers_every_decode_step_a_gpu_run_can_take(tmp_path, monkeypatch):
    """``GpuCheckConfig.decode_steps`` sizes the check batch's slots: a check that decoded past
    it would write beyond its requests' pages. Every decode step the phases take is counted on the
    CPU with the copy engines standing in, in the worst case: they refuse inside the hidden
    placement's host-time measurement, which then runs again on the kernels. Those steps plus the
    CUDA-graph probe's (N/A here: it returns before touching the batch) fit. Control: without the
    refusal fewer steps run, so the worst case is what was counted."""
    from sglang_ext.tools import gpu_check_batch, gpu_check_overlap, gpu_check_turnover
    from sglang_ext.tools.gpu_check_config import SMALL
    from sglang_ext.tools.gpu_check_graph import steps as graph_steps

    _copy_engines_on_cpu(monkeypatch, lambda engine: None)
    refuse, count = {"on": False}, {"steps": 0}
    real_host, real_begin = gpu_check_overlap.OverlapCheck._host_time, gpu_check_batch.CheckBatch.begin_decode
    real_boundary = gpu_check_turnover.TurnoverCheck._timed_boundary

    def host_time(self, engine, resident_ms):  # noqa: ANN001, ANN202
        if engine == "dma" and refuse["on"]:  # the driver refuses a copy: the engine turns the copy engines off
            eng = self.check.batch.core.store.engine
            eng.impl, eng.dma_error = "triton", "cuMemcpyBatchAsync failed: CUresult 1 (test)"
        return real_host(self, engine, resident_ms)

    def begin_decode(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        count["steps"] += 1
        return real_begin(self, *a, **k)

    def timed_boundary(self, general):  # noqa: ANN001, ANN202
        count["steps"] += 1  # the batch-change phase's timed step advances the batch itself
        return real_boundary(self, general)

    monkeypatch.setattr(gpu_check_overlap.OverlapCheck, "_host_time", host_time)
    monkeypatch.setattr(gpu_check_batch.CheckBatch, "begin_decode", begin_decode)
    monkeypatch.setattr(gpu_check_turnover.TurnoverCheck, "_timed_boundary", timed_boundary)
    repeat = 3
    argv = ["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", str(repeat), "--out-dir", str(tmp_path)]
    counted = {}
    for on in (False, True):
        refuse["on"], count["steps"] = on, 0
        main(argv)
        _, body = _result(tmp_path)
        assert body["details"]["kvplane_cpu_ms_per_step"]["hidden"]["engine"] == ("triton" if on else "dma")
        counted[on] = count["steps"]
    assert counted[True] > counted[False], counted
    assert counted[True] + graph_steps(repeat) <= SMALL.with_overrides(repeat=repeat).decode_steps, counted
