"""RecomputeForward: the uncached prefixes' recomputation inside SGLang's decode forward (eLLM).

eLLM §2.3 / §4.3.1, ``docs/recompute.md``. When a decode step's tables carry recompute tokens
(:class:`~sglang_ext.dataplane.recompute_rows.RecomputeRows`), the same forward runs them:

- :meth:`augment` (the step boundary, ``init_forward_metadata``, before the model reads its
  inputs): the prefix tokens' ids and positions are appended after the batch's decode tokens
  (``forward_batch.input_ids`` / ``positions`` of the step's eager batch copy), in the tables'
  token order. Both came to the device in the tables' one upload.
- :meth:`attend` (each layer, inside the backend's ``forward_decode``): the recompute rows' K/V
  at this layer go to their transient device rows *before* the decode rows' attention reads the
  prefix through the table; each request's prefix attends causally to itself only (SDPA per
  request, from the layer's own K/V: nothing is read back); rows of requests whose ``k`` is
  below this layer are zeroed (their results are never used: the prefix is fetched there).
- the model's ``logits_processor`` sees only the decode rows (:meth:`wrap_logits`): recomputed
  tokens are never sampled. Nothing of them reaches SGLang's radix tree or ``req_to_token``.

- :meth:`wrap_layers` (each decoder layer's entry): the rows of requests whose ``k`` is at or
  below this layer are cut from the forward -- hidden states, positions and SGLang's residual
  stream -- so a request's prefix runs through the projections and MLP of its ``k`` layers only
  (eLLM §4.3.1: the prefix forward runs up to layer ``k``; above it the prefix is fetched). The
  rows to keep are a host int (:attr:`RecomputeRows.active`, tokens ordered by decreasing ``k``),
  so the cut is a view, no sync. Where the residual stream is in a state the cut cannot carry
  (a row transport, a non-additive update) the rows stay and are zeroed in :meth:`attend`.
- :meth:`layers_fit`: the model's decoder layers take SGLang's layer call, which the cut binds.
  Where they do not (SGLang's Transformers backend, OPT, Persimmon, Phi, PhiMoE), recompute is
  not offered and ``--kv-recompute-ratio`` is refused at start (:meth:`refusal`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from sglang_ext.compat import LLAMA_DECODER_LAYER, TRANSFORMERS_BASE


class RecomputeForward:
    """Per-backend state of the current decode step's recompute rows (module docstring)."""

    def __init__(self) -> None:
        self.rows: Any = None
        """The step's :class:`RecomputeRows` (None: no recompute this step)."""
        self.batch = 0
        """Decode rows of the step (they come first)."""
        self.steps = 0
        """Forwards that recomputed something."""
        self.tokens = 0
        """Recomputed tokens in total (each counted once per step)."""
        self.layer_rows = 0
        """Recompute rows that reached a layer's attention, summed over layers and steps: with
        the cut of :meth:`wrap_layers`, ``sum_l active[l]`` per step (``k * u * page_size`` per
        request), without it ``L * m``."""

    def clear(self) -> None:
        self.rows = None

    def augment(self, forward_batch: Any, rows: Any) -> None:
        """Append the recompute tokens (ids and positions, on the device with the step's tables:
        no upload of their own) to the forward's inputs."""
        input_ids = forward_batch.input_ids
        rec_ids = rows.input_ids.to(input_ids.dtype)
        positions = forward_batch.positions
        self.batch = int(input_ids.shape[0])
        forward_batch.input_ids = torch.cat([input_ids, rec_ids])
        forward_batch.positions = torch.cat([positions, rows.positions.to(positions.dtype)])
        self.rows = rows
        self.steps += 1
        self.tokens += rows.m

    def write(self, pool: Any, layer_index: int, k: torch.Tensor, v: torch.Tensor, layer: Any) -> None:
        """The recompute rows' K/V at this layer into their device rows (before any read), as
        ``pool`` (the layered pool) stores new K/V (:meth:`LayeredTokenToKVPool.stored_kv`)."""
        bs = self.batch
        n = k.shape[0] - bs
        self.layer_rows += n
        heads, dim = layer.tp_k_head_num, layer.qk_head_dim
        k_rec, v_rec = pool.stored_kv(k[bs:].reshape(-1, heads, dim), v[bs:].reshape(-1, heads, layer.v_head_dim), n)
        pool.core.write_recompute(layer_index, k_rec, v_rec)

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
               layer: Any) -> None:
        """Causal self-attention of each request's prefix rows (``o`` rows after the batch)."""
        bs, rows = self.batch, self.rows
        hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q_ = q.reshape(-1, hq, d)
        k_ = k.reshape(-1, hk, d)
        v_ = v.reshape(-1, hk, dv)
        o_ = o.view(-1, hq, dv)
        active = rows.active[layer_index]
        if bs + active < o_.shape[0]:
            o_[bs + active:].zero_()
        gqa = hq != hk
        for start, end, k_layers in rows.spans:
            if k_layers <= layer_index:
                break  # spans are ordered by decreasing k: the rest are fetched here
            a, b = bs + start, bs + end
            # [1, H, T, D]: before torch 2.14 PyTorch's fused kernels (flash, memory-efficient) take
            # 4-D inputs only and 3-D ones fall to its math path, which builds the [H, T, T] scores
            # in fp32 (2 GiB at 4K tokens and 32 heads); 2.14 (pinned) adds the batch dim itself
            out = F.scaled_dot_product_attention(
                q_[a:b].transpose(0, 1)[None], k_[a:b].transpose(0, 1)[None], v_[a:b].transpose(0, 1)[None],
                is_causal=True, scale=layer.scaling, enable_gqa=gqa,
            )
            o_[a:b] = out[0].transpose(0, 1).to(o_.dtype)

    def wrap_logits(self, model: Any) -> bool:
        """Make the model's ``logits_processor`` see only the decode rows of a recompute step.
        False (nothing wrapped) when the model has none (recompute is then not offered)."""
        processor = getattr(model, "logits_processor", None)
        if processor is None or getattr(processor, "_kvplane_recompute", None) is self:
            return processor is not None
        original = processor.forward
        state = self

        def forward(input_ids: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            if state.rows is not None and hidden_states.shape[0] > state.batch:
                bs = state.batch
                hidden_states = hidden_states[:bs]
                if input_ids is not None and input_ids.shape[0] > bs:
                    input_ids = input_ids[:bs]
            return original(input_ids, hidden_states, *args, **kwargs)

        processor.forward = forward
        processor._kvplane_recompute = self
        return True

    @staticmethod
    def layers_fit(model: Any) -> bool:
        """Whether ``model``'s decoder layers take SGLang's layer call ``(positions,
        hidden_states, forward_batch, ...)`` -- the one :meth:`wrap_layers`' cut binds: every
        layer of its ``model.model.layers`` (True without such a stack: nothing is wrapped), read
        from the layer's class (an instance's ``forward`` may be another's wrapper: SGLang's weight
        offloaders replace it with ``forward(*args, **kwargs)``). Never on SGLang's Transformers
        backend (``--model-impl transformers``: Hugging Face layers, called as ``(hidden_states,
        attention_mask=..., position_ids=...)``; a wrapped one raised TypeError on the server's
        first forward, flag audit of session 81), nor in the few native models whose layers take
        their arguments otherwise (OPT, Persimmon, Phi, PhiMoE): recompute is not offered there
        (the backend's ``recompute_ok``)."""
        if _transformers_backend(model):
            return False
        layers = getattr(getattr(model, "model", None), "layers", None)
        return not isinstance(layers, torch.nn.ModuleList) or all(_takes_layer_call(layer) for layer in layers)

    @staticmethod
    def inputs_reason(model_config: Any, server_args: Any = None, lora: bool = False) -> str | None:
        """Why a recompute row cannot rebuild this model's prefix KV from the prefix's token ids
        and 1-D positions (what :meth:`augment` appends), or None. SGLang's ``ModelConfig`` says:
        a multimodal model (``is_multimodal``) embeds its image, video and audio tokens from the
        media, the ids in the prompt being placeholders, so a re-embedded prefix is wrong KV; an
        M-RoPE model (``model_is_mrope``: Qwen2-VL's ``mrope_section``) rotates by the 3-D
        ``forward_batch.mrope_positions``, which the rows do not extend. The launch's
        ``server_args`` say where SGLang sets per-row state for its own rows before the rows are
        appended (found in session 85): LoRA adapters (``lora``, the model runner's manager, or
        ``--enable-lora``), mapped to the batch's rows, so the rows rebuilt an adapter's prefix
        with the base weights (wrong tokens); the MoE top-k capture of
        ``--enable-return-routed-experts`` / ``--enable-return-indexer-topk``, into a buffer sized
        for SGLang's batches, which the rows overran (the scheduler raised); expert parallelism
        (``--ep-size``), which masks the expert choice of rows past SGLang's own
        (``num_token_non_padded``: from the code, not run here). N-gram embeddings
        (``use_ngram_embedding``, LongCat) and Engram layers (``use_engram``) hash each token's
        n-gram history per request over SGLang's rows only (``ngram_embedding_info``, the hasher's
        ``req_pool_indices``): the rows' embeddings would be stale (session 86, from the code)."""
        if lora or RecomputeForward.lora_on(server_args):
            return ("LoRA adapters are served (--enable-lora): SGLang maps each batch row to its adapter "
                    "before the recompute rows are appended, which would rebuild an adapter's prefix KV "
                    "with the base model's weights")
        for flag in ("enable_return_routed_experts", "enable_return_indexer_topk"):
            if getattr(server_args, flag, False):
                return (f"--{flag.replace('_', '-')} records each MoE layer's top-k choice for the forward's "
                        "rows into a buffer sized for SGLang's own batches, which the recompute rows overrun")
        if int(getattr(server_args, "ep_size", 1) or 1) > 1:
            return ("expert parallelism (--ep-size > 1) masks the experts of rows past SGLang's own batch "
                    "(num_token_non_padded), which the recompute rows are")
        if getattr(model_config, "is_multimodal", False):
            return ("it is a multimodal model: a recompute row re-embeds the prefix's token ids, and its "
                    "image, video or audio tokens are placeholders embedded from the media")
        if getattr(model_config, "model_is_mrope", False):
            return ("its rotary embedding reads M-RoPE's 3-D positions (mrope_section), which the "
                    "recompute rows do not carry")
        if getattr(model_config, "use_ngram_embedding", False) or getattr(model_config, "use_engram", False):
            return ("its embedding hashes each token's n-gram history per request (LongCat's n-gram "
                    "embedding or Engram layers, over SGLang's own rows), which the recompute rows "
                    "do not have")
        return None

    @staticmethod
    def lora_on(server_args: Any) -> bool:
        """Whether the launch serves LoRA adapters: ``--enable-lora``, or adapters named with it
        unset (as SGLang reads it)."""
        enabled = getattr(server_args, "enable_lora", None)
        return bool(enabled) or (enabled is None and bool(getattr(server_args, "lora_paths", None)))

    @staticmethod
    def refusal(model: Any, ratio: float, capped_or_windowed: bool, inputs_reason: str | None = None) -> str:
        """Why ``--kv-recompute-ratio`` cannot be served for ``model`` (whose forward cannot carry
        recompute rows), naming the flag and the way out: a launch flag that did nothing."""
        if inputs_reason is not None:
            why = inputs_reason
        elif capped_or_windowed:
            why = ("its attention soft-caps or windows its scores, which the recompute rows' plain "
                   "causal attention does not apply")
        elif _transformers_backend(model):
            why = ("it runs on SGLang's Transformers backend (--model-impl transformers), whose Hugging Face "
                   "decoder layers the recompute rows' per-layer cut does not bind")
        elif not RecomputeForward.layers_fit(model):
            why = ("its decoder layers do not take SGLang's layer call (positions, hidden_states, "
                   "forward_batch), where the recompute rows are cut")
        else:
            why = "it has no logits_processor to keep the recomputed rows from being sampled"
        return _refusal_text(type(model).__name__, ratio, why)

    @staticmethod
    def launch_refusal(model_config: Any, ratio: float, server_args: Any = None) -> str | None:
        """:meth:`refusal` for what SGLang's ``ModelConfig`` and ``server_args`` already say
        (:meth:`inputs_reason`), given at the launcher's parse, before any weight loads (the
        scheduler's check, with the model built, covers the rest); None when they give no reason."""
        why = RecomputeForward.inputs_reason(model_config, server_args) if ratio else None
        if why is None:
            return None
        arch = str((getattr(getattr(model_config, "hf_config", None), "architectures", None) or ["?"])[0])
        return _refusal_text(arch, ratio, why)

    def wrap_layers(self, model: Any) -> int:
        """Cut the recompute rows at each decoder layer to those still recomputed there (module
        docstring). Returns the layers wrapped (0: the model has no ``model.layers`` stack; the
        rows then run every layer and are zeroed above ``k``). A layer that does not take
        SGLang's layer call (:meth:`layers_fit`) is left as it is.

        A layer whose instance ``forward`` another wrapper replaced gets the cut as a forward
        pre-hook instead: SGLang's ``--cpu-offload-gb`` offloader (``OffloaderV1``; V2's
        ``--offload-group-size`` wraps DeepSeek-V2's MLPs, not layers) puts its own ``forward``
        back after every call, which dropped a wrapper set over theirs after the first forward
        (the rows then ran every layer, zeroed above ``k``: right, but none of eLLM's saving). Module hooks outlive that; elsewhere the
        plain wrapper stays (no hook on the layer's call: its fast path)."""
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            return 0
        start = int(getattr(inner, "start_layer", 0) or 0)
        wrapped = 0
        for i, layer in enumerate(layers):
            if i <= start or getattr(layer, "_kvplane_recompute", None) is self or not _takes_layer_call(layer):
                continue  # the first layer recomputes every row (k >= 1 for each of them)
            if "forward" in vars(layer):  # replaced on the instance (a weight offloader's wrapper)
                layer.register_forward_pre_hook(self._cut_hook(i - start), with_kwargs=True)
            else:
                layer.forward = self._cutting(layer.forward, i - start)
            layer._kvplane_recompute = self
            wrapped += 1
        return wrapped

    def _cut(self, index: int, positions: torch.Tensor, hidden_states: Any,
             forward_batch: Any) -> tuple[torch.Tensor, Any] | None:
        """``(positions, hidden_states)`` cut to the rows layer ``index`` still runs; None when
        nothing is cut (no recompute this step, nothing above the rows kept, or a residual stream
        the cut cannot carry). Idempotent: a call on rows already cut cuts nothing."""
        rows = self.rows
        if rows is None:
            return None
        keep = self.batch + rows.active[index]
        if positions.shape[0] <= keep:
            return None
        cut = _cut_stream(hidden_states, forward_batch, keep)
        return None if cut is None else (positions[:keep], cut)

    def _cutting(self, original: Any, index: int) -> Any:
        state = self

        def forward(positions: torch.Tensor, hidden_states: Any, forward_batch: Any, *args: Any,
                    **kwargs: Any) -> Any:
            cut = state._cut(index, positions, hidden_states, forward_batch)
            if cut is not None:
                positions, hidden_states = cut
            return original(positions, hidden_states, forward_batch, *args, **kwargs)

        return forward

    def _cut_hook(self, index: int) -> Any:
        """:meth:`_cutting` as a forward pre-hook (``with_kwargs``): SGLang's layer call's first
        three arguments, by position or by name. Under an offloader's wrapper it runs twice per
        layer (the wrapper calls the module again); the second cuts nothing."""
        state, names = self, LLAMA_DECODER_LAYER.args[:3]

        def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            call = dict(zip(names, args, strict=False))
            call.update((name, kwargs[name]) for name in names[len(args):] if name in kwargs)
            if len(call) < len(names):
                return None
            cut = state._cut(index, *(call[name] for name in names))
            if cut is None:
                return None
            new = dict(zip(names[:2], cut, strict=True))
            args = tuple(new.get(name, arg) for name, arg in zip(names, args, strict=False)) + args[len(names):]
            kwargs = {name: new.get(name, value) for name, value in kwargs.items()}
            return args, kwargs

        return hook


def _transformers_backend(model: Any) -> bool:
    """``model`` is a class of SGLang's Transformers backend (it derives from ``TRANSFORMERS_BASE``)."""
    return any(f"{c.__module__}.{c.__qualname__}" == TRANSFORMERS_BASE.path for c in type(model).__mro__)


def _takes_layer_call(layer: Any) -> bool:
    """The ``forward`` of ``layer``'s class starts with SGLang's decoder-layer call
    (``LLAMA_DECODER_LAYER``, after ``self``)."""
    forward = getattr(type(layer), "forward", None)
    if forward is None:
        return False
    try:
        names = tuple(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # a builtin or C-level forward: no names to read
        return False
    call = LLAMA_DECODER_LAYER.args[:3]
    return names[1: 1 + len(call)] == call


def _cut_stream(hidden: Any, forward_batch: Any, keep: int) -> torch.Tensor | None:
    """The first ``keep`` rows of the layer input ``hidden`` and of SGLang's residual stream
    (``forward_batch.residual_stream``: a written residual, or a residual plus the previous
    layer's pending contribution, whose outstanding sum is completed here rather than at the
    next norm). None (nothing changed) when the stream is in a state a row cut cannot carry."""
    stream = getattr(forward_batch, "residual_stream", None)
    if stream is None or stream.transport is not None or stream.residual is None:
        return None
    pending = stream.pending
    if pending is None:
        if hidden is not stream.residual:
            return None
        stream.residual = stream.residual[:keep]
        return stream.residual
    update = pending.update
    if update is None or not getattr(update, "is_plain_add", False) or getattr(update, "applied_at_exit", True):
        return None
    if pending.owed is None:
        if hidden is not pending.value:
            return None
    elif getattr(hidden, "contribution", None) is not pending:
        return None
    value = pending.complete()  # the outstanding sum (TP all-reduce), then the plain value
    if not isinstance(value, torch.Tensor):
        return None
    pending.value = value[:keep]
    stream.residual = stream.residual[:keep]
    return pending.value


def _refusal_text(model_name: str, ratio: float, why: str) -> str:
    return (f"--kv-recompute-ratio={ratio}: eLLM's recompute cannot run in {model_name}'s forward ({why}); "
            "not supported for this launch with --enable-layered-kv: drop the flag (requests then fetch their "
            "offloaded KV)")
