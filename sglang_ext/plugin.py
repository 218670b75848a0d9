"""kvplane's SGLang plugin: the ``sglang.srt.plugins`` entry point :func:`register`.

SGLang 0.5.23 calls ``sglang.srt.plugins.load_plugins()`` early in every process it
starts -- the launcher (before the command line is parsed), each scheduler (TP rank)
subprocess, the detokenizer and the DP controller -- runs every entry point of the
group, then ``HookRegistry.apply_hooks()``. ``register`` first checks that the installed SGLang
is the supported release (:func:`sglang_ext.compat.check_version`) and raises otherwise, before
installing anything; every SGLang target it names comes from :mod:`sglang_ext.compat`. It then
builds the process's :class:`~sglang_ext.context.PluginContext` (launch options, ``KVPLANE_*``
variables, overhead meter) and installs the hooks of a :class:`KvplanePlugin` bound to it: no
kvplane state lives at module level. What ``register`` installs:

Always (flag on or off):

- AFTER ``ServerArgs.add_cli_args``: the ``--enable-layered-kv`` flag family joins
  SGLang's parser (:mod:`sglang_ext.args`).
- AROUND ``ServerArgs.from_cli_args``: builds and validates :class:`LayeredKVArgs`
  (a bad value exits the launcher with a message naming the flag), implies
  ``--radix-cache-backend layered`` and exports the options to the subprocesses in
  ``KVPLANE_LAYERED_KV_ARGS``, and SGLang's ``--log-level`` in ``KVPLANE_LOG_LEVEL``
  unless set (:mod:`sglang_ext.logs`); SGLang options the layered pool cannot serve with are
  refused and the ones it needs are set, in one line on stderr
  (:class:`~sglang_ext.launch_decision.LaunchDecision`: attention backend, CUDA graphs,
  ``--disable-overlap-schedule``), and a ``--kv-host-pool-gb`` below what the model's KV needs
  (:class:`~sglang_ext.host_pool_floor.HostPoolFloor`), and a ``--kv-policy-listen`` that cannot be
  served (:class:`~sglang_ext.policy_endpoint_config.PolicyEndpointConfig`: no token, bad TLS
  files, a remote control plane, ``--dp-size > 1``, the port taken). A refusal is one line on stderr and exit
  status 2, before any subprocess starts. With the flag off it only removes the options variable.
- AFTER ``runtime_context.publish``: on ``--device cpu`` switch SGLang's rotary layer to
  its CPU path (``rotary_embedding.base._is_cpu``) in this process.
- AROUND ``TokenizerManager._stream_one_response``: token-deposit pacing of streamed
  output with ``--kv-pacing on`` (:mod:`sglang_ext.pacing`) and a paced stream's deposit in its
  placement info (:mod:`sglang_ext.placement_response`); a pass-through with the flag off.
- The per-request placement info in responses (:class:`~sglang_ext.placement_hooks.PlacementHooks`):
  AROUND ``TokenizerManager.update_request_meta_info`` (``meta_info["kvplane"]``), AFTER the OpenAI
  response builders and AROUND their stream generators (``sglext.kvplane``); pass-throughs with
  the flag off.
- AROUND ``TokenizerManager.generate_request`` and AFTER ``api_contract.generate_contract_error``:
  a bad ``custom_params.kvplane_slo_tbt_ms`` or ``kvplane_return_placement`` is refused with HTTP
  400 on every request kind (:mod:`sglang_ext.request_slo`); a pass-through with the flag off.
- AFTER ``TokenizerManager.init_request_dispatcher``: the scheduler's live default-SLO updates
  (:mod:`sglang_ext.pacing_slo_update`) reach this process's pacer; nothing with the flag off.

Only in processes whose environment says the flag is on (the subprocesses the
launcher spawns after parsing):

- kvplane's structlog events are filtered below ``KVPLANE_LOG_LEVEL`` (debug events are
  per-step telemetry, not for a server's stderr).
- ``register_radix_cache_backend("layered", ...)``: :class:`LayeredRadixCache`.
- AFTER ``mem_cache.allocation.alloc_for_extend`` / ``alloc_for_decode``: attribute new
  KV blocks to requests for the residency hooks.
- AROUND ``models.utils.enable_fused_set_kv_buffer``: False over the layered pool (models that
  fuse the KV write into rotary, e.g. Qwen3-MoE and gpt-oss on CUDA, write through
  ``set_kv_buffer`` instead).

With the flag on, a process serves with all of its hooks or not at all: a layered install that
raises, or a target SGLang's ``apply_hooks`` logged and left unpatched
(:class:`~sglang_ext.hook_install.HookInstall`), stops it with one line and exit status 2.

Without the flag nothing of kvplane is swapped in: SGLang runs its default tree cache,
pool and attention backend (tests/sglang/test_vanilla_server.py checks it).

Loaded in every SGLang process: module-level imports stay light (no torch, no SGLang).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from sglang_ext import args as kv_args
from sglang_ext import compat, layered_kv_cli, logs, settings
from sglang_ext.capacity_hooks import CapacityHooks
from sglang_ext.context import PluginContext
from sglang_ext.hook_install import HookInstall
from sglang_ext.launch_decision import LaunchDecision, LaunchRefused
from sglang_ext.launch_refusal import refuse_launch
from sglang_ext.placement_hooks import PlacementHooks
from sglang_ext.policy_endpoint_config import PolicyEndpointConfig


def switch_rotary_to_cpu() -> None:
    """Send SGLang's rotary layer down its CPU path in this process.

    SGLang decides at import (``is_cpu()``, true only with ``SGLANG_USE_CPU_ENGINE=1``,
    which also needs sgl-kernel's CPU ops); otherwise ``RotaryEmbedding.__init__`` on a
    host without CUDA reaches for ``vllm._custom_ops``. The flag is read in ``__init__``,
    so setting it before the model is built suffices; ``forward_cpu`` then falls back to
    ``forward_native`` when AMX kernels are unavailable.
    """
    compat.resolve(compat.ROTARY_EMBEDDING_BASE.path)._is_cpu = True


# ----- launcher-side hooks ----------------------------------------------------


def _env_flag(name: str) -> bool:
    """One of SGLang's environment flags (``compat.SGLANG_ENVS``), as SGLang reads it (a value it
    cannot parse: False here, SGLang's own error later)."""
    try:
        return bool(getattr(compat.resolve(compat.SGLANG_ENVS.path), name).get())
    except ValueError:
        return False


def _after_add_cli_args(result: Any, *args: Any, **kwargs: Any) -> None:
    if compat.SERVER_ARGS_FROM_CLI_ARGS.path not in compat.patched_hook_targets():
        # the parse would ignore the flag family: SGLang would serve without kvplane, asked for or not
        print("kvplane: SGLang did not apply kvplane's hook on ServerArgs.from_cli_args (its log says why); "
              "--enable-layered-kv is not offered", file=sys.stderr)
        return None
    for candidate in (*args, *kwargs.values()):
        if isinstance(candidate, argparse.ArgumentParser):
            layered_kv_cli.add_arguments(candidate)
            break
    return None


# ----- layered KV pool and attention (flag on; sglang_ext/layered_pool.py) -------------


def _attach_layered_pool(cache: Any, tp_rank: int = 0, dp_rank: int = 0) -> None:
    """Let the layered KV pool (if SGLang built one) follow the tree's frees and releases; its
    stats file is TP rank ``tp_rank``'s of replica ``dp_rank``
    (:func:`sglang_ext.settings.rank_output_file`)."""
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    allocator = getattr(cache, "token_to_kv_pool_allocator", None)
    pool = allocator.get_kvcache() if allocator is not None else None
    if isinstance(pool, LayeredTokenToKVPool):
        pool.attach(cache, tp_rank=tp_rank, dp_rank=dp_rank)


def _around_enable_fused_set_kv_buffer(original: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``models.utils.enable_fused_set_kv_buffer``: never fuse the KV write into rotary
    under a layered attention backend (the fused kernel writes through ``get_key_buffer`` views
    indexed by slot, which the layered pool does not have in its staged layout, and skips its
    dirty tracking); the model then writes through ``set_kv_buffer`` as on every other path.
    Other backends keep SGLang's answer."""
    from sglang_ext.layered_attention import LayeredTorchNativeAttnBackend

    try:  # per layer on fused models: the lazily imported function, not a path lookup each call
        backend = compat.get_attn_backend()
    except Exception:  # no forward context (not inside a forward): SGLang's answer
        backend = None
    if isinstance(backend, LayeredTorchNativeAttnBackend):
        return False
    return original(forward_batch, *args, **kwargs)


def _swap_attention_backends() -> None:
    """Replace ``torch_native`` and ``triton`` (and ``flashinfer`` where importable) with the
    layered variants (the ones :class:`~sglang_ext.launch_decision.LaunchDecision` lets run)."""
    from sglang_ext.dataplane.flashinfer_attention import HAVE_FLASHINFER
    from sglang_ext.layered_attention import (
        create_layered_flashinfer_backend,
        create_layered_torch_native_backend,
        create_layered_triton_backend,
    )

    registry = compat.attention_backends()
    registry["torch_native"] = create_layered_torch_native_backend
    registry["triton"] = create_layered_triton_backend
    if HAVE_FLASHINFER:  # GPU hosts; the backend itself refuses to start without CUDA
        registry["flashinfer"] = create_layered_flashinfer_backend


class KvplanePlugin:
    """The hooks of one process, bound to its :class:`~sglang_ext.context.PluginContext`."""

    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx
        self.hooks: HookInstall | None = None

    def check_hooks_applied(self) -> None:
        """Refuse to serve (:func:`refuse_launch`) when, with the flag on here, SGLang left one of
        this process's registered targets unpatched (sglang_ext/hook_install.py)."""
        if self.hooks is not None and self.ctx.enabled:
            if (refusal := self.hooks.refusal(compat.patched_hook_targets())) is not None:
                refuse_launch(refusal)

    def install(self, sglang_registry: Any, hook_type: Any) -> None:
        """Register the always-on hooks, and the layered ones when the flag is on here (each
        target kept in :attr:`hooks` for :meth:`check_hooks_applied`)."""
        hook_registry = self.hooks = HookInstall(sglang_registry)
        hook_registry.register(compat.SERVER_ARGS_ADD_CLI_ARGS.path, _after_add_cli_args, hook_type.AFTER)
        hook_registry.register(compat.SERVER_ARGS_FROM_CLI_ARGS.path, self.around_from_cli_args, hook_type.AROUND)
        hook_registry.register(compat.RUNTIME_CONTEXT_PUBLISH.path, self.after_publish, hook_type.AFTER)
        hook_registry.register(
            compat.TOKENIZER_STREAM_ONE_RESPONSE.path, self.around_stream_one_response, hook_type.AROUND
        )
        PlacementHooks(self.ctx).install(hook_registry, hook_type)
        hook_registry.register(
            compat.TOKENIZER_GENERATE_REQUEST.path, self.around_generate_request, hook_type.AROUND
        )
        hook_registry.register(
            compat.GENERATE_CONTRACT_ERROR.path, self.after_generate_contract_error, hook_type.AFTER
        )
        hook_registry.register(
            compat.TOKENIZER_INIT_REQUEST_DISPATCHER.path, self.after_init_request_dispatcher, hook_type.AFTER
        )
        if self.ctx.env_error is None and self.ctx.enabled:
            logs.configure(self.ctx.env.log_level or "info")
            try:
                self._register_layered(hook_registry, hook_type)
            except Exception as exc:  # SGLang's plugin loader would log it and serve with part of the hooks
                refuse_launch(f"--enable-layered-kv: kvplane could not install its SGLang hooks "
                              f"({type(exc).__name__}: {exc}); not serving with part of them")

    # ----- launcher-side hooks --------------------------------------------------------

    def around_from_cli_args(self, original: Any, cls: Any, namespace: argparse.Namespace) -> Any:
        """AROUND ``ServerArgs.from_cli_args``: validate the flag family, imply its SGLang
        options, export the options for the subprocesses (see the module docstring)."""
        ctx = self.ctx
        if not hasattr(namespace, "enable_layered_kv"):
            return original(cls, namespace)
        namespace.kvplane_context = (ctx, ctx.layered)  # the offline engine puts it back (offline_engine.py)
        try:
            layered = kv_args.LayeredKVArgs.from_namespace(namespace)
        except ValueError as exc:
            refuse_launch(f"invalid launch option: {exc}")
        if layered.enable_layered_kv:
            chosen = getattr(namespace, "radix_cache_backend", None)
            if chosen is None:
                namespace.radix_cache_backend = kv_args.RADIX_BACKEND_NAME
            elif chosen != kv_args.RADIX_BACKEND_NAME:
                refuse_launch(
                    f"--enable-layered-kv needs --radix-cache-backend "
                    f"{kv_args.RADIX_BACKEND_NAME} (implied), got {chosen!r}"
                )
            if getattr(namespace, "disable_radix_cache", False):
                refuse_launch("--enable-layered-kv cannot be combined with --disable-radix-cache")
            if ctx.env_error is not None:
                refuse_launch(str(ctx.env_error))
            # backends, CUDA graphs, KV dtype, unsupported features; --disable-overlap-schedule
            # unless --kv-overlap-schedule on (docs/overlap-schedule.md; refused on ROCm)
            if getattr(namespace, "device", None) is None:  # as SGLang will resolve it: not always CUDA
                namespace.device = compat.default_device()
            try:
                import torch  # the launcher has it loaded (SGLang's server_args imports it)

                decision = LaunchDecision.decide(vars(namespace), rocm=bool(getattr(torch.version, "hip", None)),
                                                 rust_server=_env_flag("SGLANG_RUST_SERVER"),
                                                 glue_graph=_env_flag("SGLANG_ENABLE_METADATA_GLUE_GRAPH"),
                                                 busy_mem_check=_env_flag("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"))
            except LaunchRefused as exc:
                refuse_launch(str(exc))
            decision.apply(namespace)
            try:  # --kv-policy-listen: token, TLS files, embedded control plane, --dp-size 1, free port
                PolicyEndpointConfig.check_launch(layered, namespace)
            except ValueError as exc:
                refuse_launch(f"invalid launch option: {exc}")
            try:
                logs.configure(settings.export_log_level(getattr(namespace, "log_level", None)))
            except ValueError as exc:
                refuse_launch(str(exc))
        settings.export_layered_kv_args(layered)
        ctx.layered = layered
        self.check_hooks_applied()  # this launcher's: the tokenizer's and the OpenAI server's
        server_args = original(cls, namespace)
        share = self._host_memory_share(server_args) if layered.enable_layered_kv else None
        settings.export_host_memory(share)
        if layered.enable_layered_kv:
            model_config = self._model_config(server_args)
            notes = list(decision.notes)
            if model_config is not None:
                if switched := self._avoid_flashinfer(model_config, server_args, decision):
                    notes = [n for n in notes if not n.startswith("--attention-backend flashinfer")] + switched
                self._check_model(model_config, server_args, layered.kv_recompute_ratio)
                if (why := layered.model_error(int(model_config.num_hidden_layers))) is not None:
                    refuse_launch(f"invalid launch option: {why}")
                self._check_host_pool_floor(model_config, server_args, layered, share)
            if notes:  # said once nothing is refused (a refusal is the only line)
                print("kvplane: with --enable-layered-kv: " + "; ".join(notes), file=sys.stderr)
        return server_args

    @staticmethod
    def _model_config(server_args: Any) -> Any:
        """SGLang's ``ModelConfig`` of the launch, read once (as the scheduler will read it), or
        None when it cannot be read: SGLang then reports that itself, with its reason."""
        try:
            return compat.resolve(compat.MODEL_CONFIG_FROM_SERVER_ARGS.path)(server_args)
        except Exception:
            return None

    @staticmethod
    def _avoid_flashinfer(model_config: Any, server_args: Any, decision: LaunchDecision) -> list[str]:
        """A model SGLang asserts against FlashInfer for (``model_support.NO_FLASHINFER``) is served
        on the layered ``triton`` backend when kvplane chose ``flashinfer``; chosen by the user,
        it is refused naming ``triton``. Returns the launch note."""
        from sglang_ext.model_support import refuses_flashinfer

        if getattr(server_args, "attention_backend", None) != "flashinfer" or not refuses_flashinfer(model_config):
            return []
        arch = str((getattr(model_config.hf_config, "architectures", None) or ["?"])[0])
        if ("attention_backend", "flashinfer") not in decision.implied:
            refuse_launch(f"{arch}: SGLang does not serve this model on --attention-backend flashinfer; "
                          "use --attention-backend triton (layered) under --enable-layered-kv")
        server_args.attention_backend = "triton"
        return [f"--attention-backend triton for {arch} (SGLang does not serve it on flashinfer)"]

    @staticmethod
    def _check_model(model_config: Any, server_args: Any, recompute_ratio: float) -> None:
        """Refuse a model the layered pool cannot serve (MLA, recurrent state, hybrid sliding-window
        memory, attention sinks, a head_dim over 256 for the Triton kernels, a checkpoint-quantized KV), naming
        the feature and the model, before any weight loads (:class:`~sglang_ext.model_support.ModelSupport`);
        and ``--kv-recompute-ratio`` on a multimodal or M-RoPE model, or with LoRA (:meth:`RecomputeForward.launch_refusal`)."""
        from sglang_ext.model_support import ModelSupport, triton_kernel_backend
        from sglang_ext.recompute_forward import RecomputeForward

        refusal = ModelSupport.from_model_config(model_config, server_args.kv_cache_dtype,
                                                 triton_kernel_backend(server_args, os.environ)).refusal()
        if refusal is None:  # eLLM's recompute on a multimodal or M-RoPE model (the scheduler checks the rest)
            refusal = RecomputeForward.launch_refusal(model_config, recompute_ratio, server_args)
        if refusal is not None:
            refuse_launch(refusal)

    @staticmethod
    def _host_memory_share(server_args: Any) -> Any:
        """What this host has available now, before any scheduler starts, and how many scheduler
        processes (each pinning a host KV pool) the launch starts on it."""
        from sglang_ext.dataplane.host_memory_share import HostMemoryShare, available_host_bytes

        return HostMemoryShare.at_launch(
            tp_size=server_args.tp_size, pp_size=server_args.pp_size, dp_size=server_args.dp_size,
            nnodes=server_args.nnodes, available=available_host_bytes())

    @staticmethod
    def _check_host_pool_floor(model_config: Any, server_args: Any, layered: Any, share: Any) -> None:
        """Refuse a ``--kv-host-pool-gb`` below what the model's KV needs, and without one (given
        ``--max-total-tokens``) host pools that the launch's scheduler processes could not pin in
        what this host has available (on CPU with their device pools, host memory there too): the
        scheduler would refuse either, after loading the model. A ``--kv-gpu-budget-tokens`` that
        holds every layer of ``--max-total-tokens`` needs no host pool (:meth:`HostPoolFloor.on_device`)."""
        from sglang_ext.dataplane.host_pool import host_pool_limit
        from sglang_ext.host_pool_floor import HostPoolFloor

        try:
            floor = HostPoolFloor.from_model_config(model_config, server_args)
        except Exception:  # an unreadable model config: SGLang reports it itself, with its reason
            return
        budget, cpu = layered.kv_gpu_budget_tokens, str(server_args.device) == "cpu"
        on_device = floor.on_device(budget)  # no host pool (identity layout)

        def fits_host(tokens: int | None) -> None:  # without a cap: what this host can pin
            here = floor.on_device(tokens)
            host_pool_limit(0 if here else floor.min_bytes, None, share.available_bytes if share else None,
                            share=share, device_in_host_bytes=floor.device_min_bytes(tokens) if cpu else 0,
                            host_tier=not here,
                            what=("no host pool: every layer on the device" if here else
                                  f"every layer of --max-total-tokens {floor.max_total_tokens}"))

        try:
            if layered.kv_host_pool_gb is not None and not on_device:
                floor.check(layered.kv_host_pool_gb)
            elif layered.kv_host_pool_gb is None and floor.max_total_tokens is not None:
                fits_host(budget)
        except ValueError as exc:
            hint = floor.identity_hint(budget)
            if hint and cpu and layered.kv_host_pool_gb is None:  # the device pool is host memory too:
                try:  # name the budget only where its launch passes this check
                    fits_host(floor.on_device_budget)
                except ValueError:
                    hint = ("; on --device cpu the device KV pool is host memory too, and every layer of "
                            f"--max-total-tokens {floor.max_total_tokens} does not fit there either: no "
                            "--kv-gpu-budget-tokens helps, lower --max-total-tokens")
            refuse_launch(f"invalid launch option: {exc}{hint}")

    def around_stream_one_response(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """AROUND ``TokenizerManager._stream_one_response``: with ``--kv-pacing on`` paced streaming
        and a paced stream's deposit in its placement info (sglang_ext/pacing.py,
        placement_response.py).

        Installed in every process (only the main one serves streams); with the flag off it
        returns SGLang's generator untouched without importing anything.
        """
        layered = self.ctx.layered
        if layered is None or not layered.enable_layered_kv:
            return original(*args, **kwargs)
        from sglang_ext.placement_response import around_stream_one_response  # pacing inside

        return around_stream_one_response(self.ctx, original, *args, **kwargs)

    def around_generate_request(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """AROUND ``TokenizerManager.generate_request``: every request kind's entry; a bad
        ``custom_params.kvplane_slo_tbt_ms`` is refused there (sglang_ext/request_slo.py)."""
        layered = self.ctx.layered
        if layered is None or not layered.enable_layered_kv:
            return original(*args, **kwargs)
        from sglang_ext.request_slo import around_generate_request

        return around_generate_request(original, *args, **kwargs)

    def after_generate_contract_error(self, result: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
        """AFTER ``generate_contract_error(body)``: ``/generate``'s bodies (streaming ones too)
        get HTTP 400 for a bad SLO override before any response starts."""
        layered = self.ctx.layered
        if layered is None or not layered.enable_layered_kv:
            return None
        from sglang_ext.request_slo import after_generate_contract_error

        return after_generate_contract_error(result, body)

    def after_init_request_dispatcher(self, result: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER ``TokenizerManager.init_request_dispatcher``: the main process dispatches the
        scheduler's :class:`~sglang_ext.pacing_slo_update.PacingSloUpdate` (a live change of the
        default TBT SLO) to this process's context, where new paced streams read it. Nothing is
        added with the flag off."""
        if not self.ctx.enabled:
            return None
        from sglang_ext.pacing_slo_update import PacingSloUpdate

        tokenizer_manager._result_dispatcher += compat.TypeBasedDispatcher(
            [(PacingSloUpdate, lambda update: update.apply(self.ctx))]
        )
        return None

    def after_publish(self, result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER ``publish``: runs in every SGLang process once its config is known. A bad
        ``KVPLANE_*`` variable seen by ``register()`` is raised here when the flag is on (or when
        the options variable itself was bad); with the flag off kvplane reads none of them."""
        ctx = self.ctx
        if ctx.env_error is not None and (ctx.layered is None or ctx.layered.enable_layered_kv):
            raise RuntimeError(f"kvplane: {ctx.env_error}")
        self.check_hooks_applied()  # every SGLang process, once its options are known
        if getattr(server_args, "device", None) == "cpu":
            switch_rotary_to_cpu()
        return None

    # ----- scheduler-side set-up (flag on) --------------------------------------------

    def radix_cache_factory(self, build_ctx: Any) -> Any:
        """``register_radix_cache_backend`` factory: a :class:`LayeredRadixCache` for SGLang's
        ``TreeCacheBuildContext`` (residency events to ``$KVPLANE_RESIDENCY_EVENTS_FILE`` if set,
        one file per TP rank and data-parallel replica: :func:`sglang_ext.settings.rank_output_file`)."""
        from sglang_ext.hooks import JsonlEventWriter, ResidencyHooks
        from sglang_ext.radix_cache import LayeredRadixCache

        self.check_hooks_applied()  # not a hook itself: runs even if the publish hook was left out
        if build_ctx.is_hybrid_swa or build_ctx.is_hybrid_ssm or build_ctx.enable_hierarchical_cache:
            raise ValueError(
                "kvplane: --radix-cache-backend layered supports full-attention models without "
                f"HiCache (got hybrid_swa={build_ctx.is_hybrid_swa}, hybrid_ssm={build_ctx.is_hybrid_ssm}, "
                f"hierarchical_cache={build_ctx.enable_hierarchical_cache})"
            )
        hooks = ResidencyHooks()
        tp_rank = int(build_ctx.tp_rank)
        dp_rank = compat.replica_rank(int(getattr(build_ctx.server_args, "dp_size", 1) or 1))
        events_file = self.ctx.env.residency_events_file
        if events_file is not None:
            hooks.subscribe(JsonlEventWriter(settings.rank_output_file(events_file, tp_rank, dp_rank)))
        cache = LayeredRadixCache(build_ctx.params, hooks=hooks)
        _attach_layered_pool(cache, tp_rank, dp_rank)
        return cache

    def _register_layered(self, hook_registry: Any, hook_type: Any) -> None:
        if compat.get_radix_cache_factory(kv_args.RADIX_BACKEND_NAME) is None:
            compat.register_radix_cache_backend(kv_args.RADIX_BACKEND_NAME, self.radix_cache_factory)
        from sglang_ext.alloc_hooks import after_alloc_for_decode, after_alloc_for_extend

        hook_registry.register(compat.ALLOC_FOR_EXTEND.path, after_alloc_for_extend, hook_type.AFTER)
        hook_registry.register(compat.ALLOC_FOR_DECODE.path, after_alloc_for_decode, hook_type.AFTER)
        capacity = CapacityHooks()  # the layered pool, over a slot space beyond the device's profile
        for target, hook in ((compat.KV_POOL_CLASS_RESOLVER, capacity.around_resolve_kv_pool_class),
                             (compat.KV_CONFIG_FROM_BUDGET, capacity.around_config_from_budget),
                             (compat.KV_RESOLVE_MAX_NUM_REQS, capacity.around_resolve_max_num_reqs)):
            hook_registry.register(target.path, hook, hook_type.AROUND)
        hook_registry.register(
            compat.ENABLE_FUSED_SET_KV_BUFFER.path, _around_enable_fused_set_kv_buffer, hook_type.AROUND
        )
        _swap_attention_backends()
        from sglang_ext import graph_runner_hooks, scheduler_hooks

        graph_runner_hooks.register(hook_registry, hook_type, compat.DECODE_GRAPH_CAN_RUN.path,
                                    compat.DECODE_GRAPH_EXECUTE.path)

        scheduler_hooks.register(hook_registry, hook_type, self.ctx)


def register() -> KvplanePlugin:
    """Entry point of the ``sglang.srt.plugins`` group (see pyproject.toml); returns the
    installed plugin (SGLang ignores it).

    Raises :class:`~sglang_ext.compat.UnsupportedSGLangVersion` (naming the supported and the
    installed version) before installing anything when SGLang is not the supported release;
    SGLang's ``load_plugins`` logs it and starts without kvplane. A bad ``KVPLANE_*`` variable is
    not raised here (``load_plugins`` swallows exceptions): it is reported at parse (launcher) or
    at publish (every process), and only when the flag is on.
    """
    compat.check_version()
    plugin = KvplanePlugin(PluginContext.from_environ())
    plugin.install(compat.HookRegistry, compat.HookType)
    return plugin
