"""Test-only fault injection for the negative control of the layered servers' equality checks.

On the server's PYTHONPATH (never installed), this runs at start-up in every SGLang process. Every
fault is behind a flag file: it acts only while that file exists, so a module's layered server
is its own negative control (a test creates the file, runs the control's requests, removes it
and flushes the prefix cache: :func:`tests.sglang.conftest.fault_armed`) instead of starting a
twin server with the fault always on.

With ``KVPLANE_TEST_CORRUPT_LAYER=L`` and ``KVPLANE_TEST_CORRUPT_FILE=PATH``, when
``sglang_ext.dataplane.layer_pipeline`` is imported ``LayerPipeline.end_layer`` is wrapped so
that, while ``PATH`` exists, after layer ``L``'s write-back of staged new tokens reached host
memory the host copy of the first page it wrote is perturbed (K += 0.5). The next step fetches
that corrupted page into staging, so the served attention reads wrong KV for one offloaded
layer-page -- what a lost or misplaced write-back would do.

With ``KVPLANE_TEST_CORRUPT_RECOMPUTE_FILE=PATH``, while ``PATH`` exists the recomputed prefix
K/V (``LayeredKVCore.write_recompute``) is perturbed (K += 0.5) on its way into the transient
pages -- what a wrong recomputation would do (the recompute server's negative control toggles
it per request by creating the file). With ``KVPLANE_TEST_CORRUPT_RANK=R`` as well, only the
process of ``torch.distributed`` rank R (TP rank R of a ``--tp`` server) perturbs it: the TP
server's negative control corrupts one rank's KV shard.

With ``KVPLANE_TEST_AUDIT_FILE=PATH`` nothing is perturbed: the served Triton paged decode's
per-layer calls run under :class:`sglang_ext.testing.op_audit.OpAudit` (kvplane's part of each
layer: the layer's begin, KV write and end; the attention kernel itself is not recorded) and
``PATH`` is rewritten after every layer with each decode step's ops per layer, its batch size,
any host-sync op (the GPU-discipline audit, in the process SGLang serves from), whether the
backend took the step as idle and the pool's ``enter_layer`` / ``exit_layer`` calls it made.
Extend steps are recorded too (``"extend": true``, ``"kernel"``: whether the paged-extend kernel
served it; its launch is not recorded, as decode's). While the file
``KVPLANE_TEST_AUDIT_TORCH_EXTEND_FILE`` exists, extends take SGLang's torch-native path instead
(the audit's negative control: that path reads lengths from the device inside every layer).

With ``KVPLANE_TEST_SHIFT_EXTEND_FILE=PATH``, while ``PATH`` exists the paged-extend kernel is
handed ``kv_lens - 1``: every new token attends one position short (it misses itself) -- what a
wrong extend table would do (the extend test's negative control toggles it per request).

With ``KVPLANE_TEST_STALE_ADVANCE_FILE=PATH``, while ``PATH`` exists an advanced paged step keeps
the last step's new-token rows (``PagedStepTables.advanced`` without its ``rows + 1``, ``advanced_staged`` with the last
step's rows): each advanced step's new K/V overwrite the previous token's -- what a stale
advance would do.

With ``KVPLANE_TEST_MIXED_FILE=PATH`` nothing is perturbed: SGLang's
``ScheduleBatch.mix_with_running`` appends a line to ``PATH`` each time the scheduler runs a
prefill chunk and the running decodes as one batch (the mixed-chunk test's evidence: SGLang's log
lines cannot tell that apart from a prefill beside running decodes, and its model runner hands
the attention backend a mixed batch as ``EXTEND``).

With ``KVPLANE_TEST_TAPE_GRAPHS=PATH``, SGLang captures and replays decode graphs on the CPU:
its platform declares the capability, the runner's CUDA stream plumbing around capture becomes a
no-op, and its graph backend is :class:`sglang_ext.testing.tape_graph_backend.TapeGraphBackend`
(each capture and replay appended to ``PATH``). With ``KVPLANE_TEST_STALE_GRAPH_FILE=PATH`` as well,
while ``PATH`` exists an admitted step does not load its tables into the graph buffers: the replay
reads the last loaded step's -- what a replay over stale tables would do (the negative control).
With ``KVPLANE_TEST_EMPTY_GRAPH_FETCHES_FILE=PATH``, while ``PATH`` exists a staged step's graph
lists are emptied after they load: the replay's fetches copy nothing (the staged replays' control).

With ``KVPLANE_TEST_STALE_TURNOVER_FILE=PATH``, while ``PATH`` exists a decode step whose batch
changed (a turnover, ``DecodeContinuity.continued``) continues a wrong page list: each request
of two pages or more that opens no page reads its second page in place of its first -- what a
stale record of a request's pages would do (the turnover test's negative control toggles it).

With ``KVPLANE_TEST_WARMUP_DUMMY_FILE=PATH``, the model runners' first warm-up runs SGLang's own
warm-up forward on the CPU as FlashInfer's autotune runs it on CUDA (``BaseRunner._dummy_run`` on
the runner's autotune buffers, as SGLang allocates them; ``_warmup`` returns before it off CUDA);
with ``KVPLANE_TEST_WARMUP_DUMMY_SEQ_LEN=N`` as well, their ``seq_lens`` are N (0: what a decode
graph runner's buffers may hold when it warms up first, SGLang says). One JSON line per warm-up
goes to ``PATH``.

With ``KVPLANE_TEST_FORCE_OVERFLOW_FILE=PATH``, while ``PATH`` exists the staging room has no room:
every step that stages is served at rest (the overflow path). With ``KVPLANE_TEST_GRAPH_DECLINE_FILE``
one TP rank's decode graph refuses every step while it exists (``kvplane_graph_decline.py``).

With ``KVPLANE_TEST_UNPATCHED_HOOK=TARGET``, SGLang's ``HookRegistry`` fails to patch ``TARGET``
(logged, the other targets patched): a partial install (``kvplane_unpatched_hook.py``).

With ``KVPLANE_TEST_KV_PROFILE_BYTES=N``, SGLang's memory profile finds at most N bytes for the KV
cache (``KVCacheConfigurator._profile_available_bytes``): a GPU whose memory, after the weights,
holds fewer tokens than ``--max-total-tokens`` (on the CPU: the host's free memory; ``kvplane_kv_profile.py``).

With ``KVPLANE_TEST_FLASHINFER_STAND_IN=1``, ``--attention-backend triton`` builds the layered
FlashInfer backend over a stand-in of FlashInfer's decode wrapper (``kvplane_flashinfer_stand_in.py``;
``KVPLANE_TEST_UNPLANNED_REPLAY_FILE``: while it exists, decode graphs replay unplanned).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "sglang_ext.dataplane.layer_pipeline"
EXTEND_TARGET = "sglang_ext.layered_paged_decode"
RECOMPUTE_TARGET = "sglang_ext.dataplane.layered_kv_core"


def _patch_recompute(module) -> None:  # noqa: ANN001
    flag = os.environ["KVPLANE_TEST_CORRUPT_RECOMPUTE_FILE"]
    only_rank = os.environ.get("KVPLANE_TEST_CORRUPT_RANK")
    real = module.LayeredKVCore.write_recompute
    from kvplane_rank import this_rank

    def write_recompute(self, layer, k, v):  # noqa: ANN001, ANN202
        if os.path.exists(flag) and (only_rank is None or this_rank() == int(only_rank)):
            k = k + 0.5
        return real(self, layer, k, v)

    module.LayeredKVCore.write_recompute = write_recompute


def _patch(module) -> None:  # noqa: ANN001
    layer = int(os.environ["KVPLANE_TEST_CORRUPT_LAYER"])
    flag = os.environ["KVPLANE_TEST_CORRUPT_FILE"]
    real = module.LayerPipeline.end_layer

    def end_layer(self, index):  # noqa: ANN001
        if index != layer or not os.path.exists(flag):
            return real(self, index)
        tables = self.tables
        launch = tables.writebacks[index] if tables is not None else None
        parked = tables.token_writeback if tables is not None else None
        if parked is not None and parked.launch.layer != index:
            parked = None
        real(self, index)
        if launch is not None:
            self.engine.quiesce()
            host_seg = int(tables.launch_indices(launch)[2][1][0])  # first destination: a K segment
            self.engine.host[host_seg] += 0.5
        if parked is not None:  # a decode step's token rows: the first K row of ``layer``
            c = self.store.config
            dst = tables.launch_indices(parked.launch)[2][1][: parked.pairs]
            at_layer = dst[(dst // c.page_size // 2) % c.layers == layer]
            if at_layer.size:
                self.engine.quiesce()
                self.store.host_rows[int(at_layer[0])] += 0.5

    module.LayerPipeline.end_layer = end_layer


ADVANCE_TARGET = "sglang_ext.dataplane.paged_step_tables"


def _patch_advance(module) -> None:  # noqa: ANN001
    flag = os.environ["KVPLANE_TEST_STALE_ADVANCE_FILE"]
    real, real_staged = module.PagedStepTables.advanced, module.PagedStepTables.advanced_staged

    def advanced(self, *args):  # noqa: ANN001, ANN002, ANN202
        nxt = real(self, *args)
        if nxt is not None and os.path.exists(flag):
            nxt.rows = self.rows
        return nxt

    def advanced_staged(self, *args):  # noqa: ANN001, ANN002, ANN202
        nxt = real_staged(self, *args)
        if nxt is not None and os.path.exists(flag):
            nxt.rows = self.rows
        return nxt

    module.PagedStepTables.advanced = advanced
    module.PagedStepTables.advanced_staged = advanced_staged


AUDIT_TARGET = "sglang_ext.layered_triton_decode"


def _patch_audit(module) -> None:  # noqa: ANN001
    import json
    from collections import Counter

    from sglang_ext.testing.op_audit import OpAudit

    path = os.environ["KVPLANE_TEST_AUDIT_FILE"]
    audit = OpAudit()
    steps: list[dict] = []
    cls = module.LayeredTritonDecode
    real_forward, real_kernel = cls.forward_decode, cls.decode_layer
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    inside: list[dict] = []
    """The audited decode step whose layer is running (empty outside a paged decode layer)."""

    def counting(name: str, real):  # noqa: ANN001, ANN202
        def call(self, layer_id):  # noqa: ANN001, ANN202
            if inside:  # the pool's per-layer calls of each audited decode step, in order
                inside[0].setdefault("pool_calls", []).append([name, int(layer_id)])
            return real(self, layer_id)
        return call

    for name in ("enter_layer", "exit_layer"):
        setattr(LayeredTokenToKVPool, name, counting(name, getattr(LayeredTokenToKVPool, name)))

    # host reads (a device tensor's tolist, numpy, cpu, item) are flagged by OpAudit itself

    real_extend, real_extend_layer = cls.forward_extend, cls.extend_layer
    real_metadata = cls.init_forward_metadata
    torch_extend_flag = os.environ.get("KVPLANE_TEST_AUDIT_TORCH_EXTEND_FILE", "")

    def init_forward_metadata(self, forward_batch):  # noqa: ANN001, ANN202
        kernel = self.extend_kernel
        self.extend_kernel = kernel and not (torch_extend_flag and os.path.exists(torch_extend_flag))
        try:
            return real_metadata(self, forward_batch)
        finally:
            self.extend_kernel = kernel

    def audited(real, extend: bool):  # noqa: ANN001, ANN202
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN202
            if layer.layer_id == self.pool.start_layer:
                core = self.pool.core
                steps.append({"batch": int(forward_batch.batch_size), "paged": bool(self._paged), "layers": {},
                              "advanced_total": core.advanced_decode_steps, "idle": bool(self.idle),
                              "extend": extend, "kernel": bool(self._extend_paged) if extend else None})
            audit.ops.clear()
            inside.append(steps[-1])
            try:
                with audit, audit.scope(layer.layer_id):
                    out = real(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            finally:
                inside.clear()
            return _record(out, layer)
        return forward

    def _record(out, layer):  # noqa: ANN001, ANN202
        steps[-1]["layers"][str(layer.layer_id)] = dict(Counter(audit.ops[layer.layer_id]))
        steps[-1]["violations"] = steps[-1].get("violations", []) + [list(x) for x in audit.violations]
        audit.violations.clear()
        with open(path + ".tmp", "w") as f:
            json.dump(steps, f)
        os.replace(path + ".tmp", path)  # a reader sees a whole document, the old or the new one
        return out

    def decode_layer(self, q, layer, index):  # noqa: ANN001, ANN202
        with audit.scope(None):  # the attention kernel is not kvplane's per-layer work
            return real_kernel(self, q, layer, index)

    def extend_layer(self, q, layer, index, forward_batch):  # noqa: ANN001, ANN202
        with audit.scope(None):
            return real_extend_layer(self, q, layer, index, forward_batch)

    cls.forward_decode, cls.decode_layer = audited(real_forward, False), decode_layer
    cls.forward_extend, cls.extend_layer = audited(real_extend, True), extend_layer
    cls.init_forward_metadata = init_forward_metadata


def _patch_extend_shift(module) -> None:  # noqa: ANN001
    flag = os.environ["KVPLANE_TEST_SHIFT_EXTEND_FILE"]
    real = module.paged_extend

    def shifted(q, k_cache, v_cache, q_start, q_lens, kv_indptr, kv_indices, kv_lens, *args, **kwargs):  # noqa: ANN001, ANN202
        if os.path.exists(flag):
            kv_lens = kv_lens - 1
        return real(q, k_cache, v_cache, q_start, q_lens, kv_indptr, kv_indices, kv_lens, *args, **kwargs)

    module.paged_extend = shifted


CONTINUITY_TARGET = "sglang_ext.dataplane.decode_continuity"


def _patch_turnover(module) -> None:  # noqa: ANN001
    flag = os.environ["KVPLANE_TEST_STALE_TURNOVER_FILE"]
    real = module.DecodeContinuity.continued

    def continued(self, rids, seq_lens, slots, lists):  # noqa: ANN001, ANN202
        got = real(self, rids, seq_lens, slots, lists)
        if got is None or got[1] is None or self._last == list(rids) or not os.path.exists(flag):
            return got
        opens, out = got
        for i, pages in enumerate(out):
            if i not in opens and pages.size >= 2:
                out[i] = pages.copy()
                out[i][0] = pages[1]
        return opens, out

    module.DecodeContinuity.continued = continued


MIXED_TARGET = "sglang.srt.managers.schedule_batch"


def _patch_mixed(module) -> None:  # noqa: ANN001
    path = os.environ["KVPLANE_TEST_MIXED_FILE"]
    real = module.ScheduleBatch.mix_with_running

    def mix_with_running(self, running_batch):  # noqa: ANN001, ANN202
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"mixed {running_batch.batch_size()} running\n")
        return real(self, running_batch)

    module.ScheduleBatch.mix_with_running = mix_with_running


PLATFORM_TARGET = "sglang.srt.platforms.interface"
GRAPH_RUNNER_TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
GRAPH_SETUP_TARGET = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup"


def _patch_platform(module) -> None:  # noqa: ANN001
    """The CPU may capture, with SGLang's CUDA decode graph runner (not its torch.compile CPU one)."""
    module.SRTPlatform.capabilities = module.PlatformCapabilities(graph_capture=True)

    def get_graph_runner_cls(self):  # noqa: ANN001, ANN202
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

        return DecodeCudaGraphRunner

    module.SRTPlatform.get_graph_runner_cls = get_graph_runner_cls


def _patch_graph_runner(module) -> None:  # noqa: ANN001
    from contextlib import contextmanager
    from types import SimpleNamespace

    import torch

    from sglang_ext.testing.tape_graph_backend import TapeGraphBackend

    log = os.environ["KVPLANE_TEST_TAPE_GRAPHS"]

    @contextmanager
    def graph_capture(stream=None):  # noqa: ANN001, ANN202
        yield SimpleNamespace(stream=stream)

    module.graph_capture = graph_capture
    module.get_or_create_global_graph_capture_stream = lambda *args, **kwargs: None
    module.resolve_decode_backend = lambda runner: TapeGraphBackend(runner, log)
    if not hasattr(torch.cpu, "is_current_stream_capturing"):
        torch.cpu.is_current_stream_capturing = lambda: False
    real_init = module.DecodeCudaGraphRunner.__init__

    def init(self, *args, **kwargs):  # noqa: ANN001, ANN202
        from sglang.srt.runtime_context import get_flags

        get_flags().capture.enable_torch_compile = False  # set only to pass the CPU check below
        return real_init(self, *args, **kwargs)

    module.DecodeCudaGraphRunner.__init__ = init


def _patch_graph_setup(module) -> None:  # noqa: ANN001
    """SGLang captures on a CPU only under --enable-torch-compile (its CPU graph runner compiles);
    the flag is raised for that check alone (the runner above lowers it: nothing compiles)."""
    real = module.capture_decode_graph

    def capture_decode_graph(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        from sglang.srt.runtime_context import get_flags

        get_flags().capture.enable_torch_compile = True
        return real(*args, **kwargs)

    module.capture_decode_graph = capture_decode_graph


def _patch_stale_graph(module) -> None:  # noqa: ANN001
    flag = os.environ["KVPLANE_TEST_STALE_GRAPH_FILE"]
    real = module.GraphStepBuffers.load

    def load(self, tables, padded_to=None, slots=None):  # noqa: ANN001, ANN202
        if os.path.exists(flag) and self.loads:
            self.loads += 1  # the step's tables never reach the buffers (only its padded size is noted)
            self.batch = self.batch if padded_to is None else padded_to
            return None
        return real(self, tables, padded_to, slots)

    module.GraphStepBuffers.load = load


def _patch_empty_fetches(module) -> None:  # noqa: ANN001
    flag = os.environ["KVPLANE_TEST_EMPTY_GRAPH_FETCHES_FILE"]
    real = module.GraphStaging.load

    def load(self, tables, size, host):  # noqa: ANN001, ANN202
        real(self, tables, size, host)
        if os.path.exists(flag):  # every list's length: the replay's fetch launches copy nothing
            host["staging_ctl"][self._zero_from: self._zero_from + 4 * self.layers] = 0

    module.GraphStaging.load = load


WARMUP_TARGET = "sglang.srt.model_executor.runner.base_runner"


def _patch_warmup_dummy(module) -> None:  # noqa: ANN001
    import json

    path = os.environ["KVPLANE_TEST_WARMUP_DUMMY_FILE"]
    real = module.BaseRunner._warmup

    def _warmup(self):  # noqa: ANN001, ANN202
        first = not getattr(self.model_runner, "_kernel_warmed_up", False)
        real(self)
        if not first:
            return
        buffers, batch_size = self._autotune_buffers()
        record: dict = {"runner": type(self).__name__, "batch_size": batch_size, "forwards": []}
        if buffers is not None:
            seq_len = os.environ.get("KVPLANE_TEST_WARMUP_DUMMY_SEQ_LEN")
            if seq_len is not None:
                buffers.seq_lens.fill_(int(seq_len))
                buffers.seq_lens_cpu.fill_(int(seq_len))
            backend = self.model_runner.attn_backend
            real_init = backend.init_forward_metadata

            def init_forward_metadata(forward_batch):  # noqa: ANN001, ANN202
                lens = forward_batch.seq_lens_cpu
                record["forwards"].append({"backend": type(backend).__name__, "rows": int(forward_batch.batch_size),
                                           "seq_lens": sorted({int(x) for x in lens.tolist()}),
                                           "rids": forward_batch.rids})
                return real_init(forward_batch)

            backend.init_forward_metadata = init_forward_metadata
            try:
                self._dummy_run(batch_size=batch_size, buffers=buffers)
            finally:
                del backend.init_forward_metadata
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")

    module.BaseRunner._warmup = _warmup


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch) -> None:  # noqa: ANN001
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        _patch = self.patch
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):  # noqa: ANN001
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


def _install(target: str, patch) -> None:  # noqa: ANN001
    """Patch ``target`` when it is imported, or now if it already is: a process forked from the
    test harness's launch zygote (:mod:`sglang_ext.testing.zygote_server`) has SGLang's launcher
    and process entry modules imported before this file runs. Of the targets below the platform
    interface, the decode graph runner and ``schedule_batch`` are among them; their patches
    replace class attributes and module globals the module itself looks up at call time, so
    patching them late equals patching them at import. (The others, kvplane's modules and
    ``cuda_graph_setup``, are imported after this runs either way.)"""
    module = sys.modules.get(target)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _Finder(target, patch))


if os.environ.get("KVPLANE_TEST_CORRUPT_FILE"):
    _install(TARGET, _patch)
if os.environ.get("KVPLANE_TEST_CORRUPT_RECOMPUTE_FILE"):
    _install(RECOMPUTE_TARGET, _patch_recompute)
if os.environ.get("KVPLANE_TEST_STALE_ADVANCE_FILE"):
    _install(ADVANCE_TARGET, _patch_advance)
if os.environ.get("KVPLANE_TEST_AUDIT_FILE"):
    _install(AUDIT_TARGET, _patch_audit)
if os.environ.get("KVPLANE_TEST_STALE_TURNOVER_FILE"):
    _install(CONTINUITY_TARGET, _patch_turnover)
if os.environ.get("KVPLANE_TEST_SHIFT_EXTEND_FILE"):
    _install(EXTEND_TARGET, _patch_extend_shift)
if os.environ.get("KVPLANE_TEST_MIXED_FILE"):
    _install(MIXED_TARGET, _patch_mixed)
if os.environ.get("KVPLANE_TEST_TAPE_GRAPHS"):
    _install(PLATFORM_TARGET, _patch_platform)
    _install(GRAPH_RUNNER_TARGET, _patch_graph_runner)
    _install(GRAPH_SETUP_TARGET, _patch_graph_setup)
if os.environ.get("KVPLANE_TEST_WARMUP_DUMMY_FILE"):
    _install(WARMUP_TARGET, _patch_warmup_dummy)
if os.environ.get("KVPLANE_TEST_STALE_GRAPH_FILE"):
    _install("sglang_ext.dataplane.graph_step_buffers", _patch_stale_graph)
if os.environ.get("KVPLANE_TEST_EMPTY_GRAPH_FETCHES_FILE"):
    _install("sglang_ext.dataplane.graph_staging", _patch_empty_fetches)
for _env, _name in (("KVPLANE_TEST_FORCE_OVERFLOW_FILE", "kvplane_force_overflow"),
                    ("KVPLANE_TEST_GRAPH_DECLINE_FILE", "kvplane_graph_decline"),
                    ("KVPLANE_TEST_KV_PROFILE_BYTES", "kvplane_kv_profile"),
                    ("KVPLANE_TEST_UNPATCHED_HOOK", "kvplane_unpatched_hook"),
                    ("KVPLANE_TEST_FLASHINFER_STAND_IN", "kvplane_flashinfer_stand_in"),
                    ("KVPLANE_TEST_CPU_RECAPTURE", "kvplane_cpu_recapture")):
    if os.environ.get(_env):  # an injector module of this directory: its TARGET and patch
        _injector = __import__(_name)
        _install(_injector.TARGET, _injector.patch)
