"""``LaunchDecision``: what ``--enable-layered-kv`` implies for SGLang's other launch options, or
a refusal naming the option it cannot serve with (issue 14, "GPU serving readiness").

Decided in the launcher, from the parsed command line, before any process starts
(:meth:`sglang_ext.plugin.KvplanePlugin.around_from_cli_args`), so a configuration the layered
data plane cannot serve fails at once with a message that names the flag, instead of a scheduler
crash on the first decode -- or worse, a backend that silently reads the flat KV buffers the
layered pool does not have. SGLang-free: ``values`` is any mapping of SGLang's option names
(``vars(namespace)``); tests build it by hand.

Rules (each one names what would break):

* **Attention backends.** The layered pool keeps KV in per-layer page tables, so only backends
  that read them work: ``torch_native`` (CPU and CUDA), ``flashinfer`` (CUDA) and ``triton``
  (kvplane's Triton paged decode: CUDA, or CPU under ``TRITON_INTERPRET=1``), the last two
  decoding through the step's per-layer page tables. With no ``--attention-backend`` SGLang would choose one
  itself (``fa3`` on Hopper, which reads the flat buffers): kvplane chooses ``flashinfer`` on
  CUDA, ``torch_native`` on CPU, and says so. A named unsupported backend (``--attention-backend``,
  ``--decode-attention-backend`` or ``--prefill-attention-backend``) is refused. On ROCm (a
  ``cuda`` device of a ROCm torch build) FlashInfer does not exist: kvplane chooses ``triton``
  there and refuses ``flashinfer`` by name (:data:`ROCM_BACKENDS`; the Triton kernels' launches
  are compiled offline for AMD CDNA 3 and 4 in ``tests/kernels/test_shared_memory.py``, and have
  not run on an AMD GPU).
* **CUDA graphs.** A captured decode replays fixed metadata, but the layered tables, staging slots
  and fetch launches change every step: capture is turned off (``--cuda-graph-backend-decode``
  and ``--cuda-graph-backend-prefill disabled``, said in one line); an explicit request for a
  capturing backend, or a ``--cuda-graph-config``, is refused. ``--enable-torch-compile``, which
  SGLang applies inside its graph runners only, then does nothing: said at launch.
  ``--kv-cuda-graphs on`` keeps SGLang's decode graphs for the layered Triton and FlashInfer
  decodes instead (``docs/cuda-graphs.md``: decode steps replay over persistent tables, staged
  ones with their fetches in the graph; with no ``--attention-backend``, kvplane's choice: FlashInfer
  on CUDA); it refuses ``torch_native`` (decode or prefill), ``--disable-cuda-graph``, a non-``full`` decode graph
  backend, ``--enable-torch-compile`` and ``SGLANG_ENABLE_METADATA_GLUE_GRAPH`` (a replayed copy
  of the per-replay preparation would skip kvplane's admission check), and keeps prefill graphs
  off. With ``--tp-size`` > 1 the ranks agree on every replay (``GraphTpAgreement``); under
  ``--kv-overlap-schedule on`` the layer timer's sampled steps run eagerly (session 90).
* **KV cache dtype.** Quantized KV caches (fp8, fp4, mxfp8) need scales the layered pool does not
  keep: refused (``auto`` / ``bf16`` only).
* **Speculative decoding, pipeline parallelism, HiCache, disaggregation, DP attention, two-batch
  overlap**, the options in :data:`_REFUSED_SWITCHES` and :data:`_REFUSED_SIZES`, ``--kv-canary``
  and ``--radix-eviction-policy tlru`` (other KV tiers, SGLang's own radix-cache features, the
  memory saver, PD multiplexing, context parallelism, multi-item scoring, deterministic
  inference, front ends where kvplane's tokenizer hooks do not run: more than one tokenizer
  worker, the SMG gRPC mode, ``SGLANG_RUST_SERVER``): refused. The first six need what is not implemented (the pool's KV
  copy for draft tokens, per-stage layer ranges, a second tier of its own, transfer of the flat
  buffers, per-rank batches inside one TP group, padded half-batches); each table entry's
  message says why for its option.
  ``--dp-size`` replicas are served: each replica's scheduler is a worker of its own (worker id
  ``ID-dpD``, per-replica output files).
* **Overlap scheduler.** ``--enable-layered-kv`` implies ``--disable-overlap-schedule`` unless
  ``--kv-overlap-schedule on`` keeps SGLang's overlap loop (there the boundary of step k+1 --
  plan install, pauses, the pool's step preparation -- runs while step k computes, and step k's
  results are processed after step k+1 is launched; ``docs/overlap-schedule.md``). Said in the
  same line either way.
* **Page size (CUDA).** KV moves between host and device in pages (one copy segment is one
  layer of one page's K or V). SGLang's default page of one token would make every segment
  ``kv_heads x head_dim`` elements (2 KiB at Llama-3-8B shapes, far below what a PCIe copy
  needs to run at speed) and open a page -- and so rebuild the step's tables -- at every decode
  step. Without ``--page-size`` kvplane sets :data:`CUDA_PAGE_SIZE` on CUDA (what ``kvplane
  gpu-check`` measures) and says so; an explicit ``--page-size`` is kept, and so is SGLang's
  choice when ``--chunked-prefill-size`` is not a multiple of it (SGLang requires chunks of
  whole pages). On CPU SGLang's default stays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

LAYERED_BACKENDS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "cuda": ("flashinfer", "triton", "torch_native"),
    "cpu": ("torch_native", "triton"),
})
"""Attention backends that read the layered tables, per device."""

DEFAULT_BACKEND: Mapping[str, str] = MappingProxyType({"cuda": "flashinfer", "cpu": "torch_native"})
"""What kvplane picks when ``--attention-backend`` is not given."""

GRAPH_BACKENDS = ("triton", "flashinfer")
"""The layered backends ``--kv-cuda-graphs on`` serves decode graphs with (``LayeredGraphDecode``)."""

ROCM_BACKENDS = ("triton", "torch_native")
"""The layered backends on ROCm (``--device cuda`` with a ROCm torch build), the first the default:
FlashInfer is built for NVIDIA GPUs only."""

CUDA_PAGE_SIZE = 16
"""``--page-size`` kvplane sets on CUDA when none is given (module docstring, "Page size")."""

UNQUANTIZED_KV_DTYPES = ("auto", "bf16", "bfloat16")
"""``--kv-cache-dtype`` values the layered pool stores (the model's dtype or bf16)."""

DP_ATTENTION_REFUSED = (
    "--enable-dp-attention / --attn-dp-size > 1: attention data-parallel ranks schedule batches of "
    "their own, while kvplane installs one plan across the TP group; not supported with "
    "--enable-layered-kv (--dp-size replicas are)"
)
"""The refusal of SGLang's DP attention, at launch and again at scheduler start."""

ROCM_OVERLAP_REFUSED = (
    "--kv-overlap-schedule on: not supported on ROCm (the step boundary's KV copies run on SGLang's "
    "schedule stream, ordered behind the in-flight forward only by SGLang's WAR barrier, which "
    "SGLang enables on CUDA only); use --kv-overlap-schedule off"
)
"""The refusal of the overlap loop on ROCm (at launch, and again at scheduler start)."""

TORCH_COMPILE_NOTE = (
    "--enable-torch-compile has no effect: SGLang compiles the model inside its graph runners, "
    "and --enable-layered-kv runs without them (the model runs eagerly)"
)
"""Said at launch when ``--enable-torch-compile`` is given: SGLang 0.5.23 applies ``torch.compile``
in its decode graph runners only (``DecodeCudaGraphRunner``; on a CPU, ``CPUGraphRunner``), and
with the layered pool no graph is captured (measured on the CPU: ``cpu graph: False`` in every
batch line, output equal to the run without the flag)."""

_BACKEND_FLAGS = (
    ("attention_backend", "--attention-backend"),
    ("decode_attention_backend", "--decode-attention-backend"),
    ("prefill_attention_backend", "--prefill-attention-backend"),
)
_GRAPH_FLAGS = (
    ("cuda_graph_backend_decode", "--cuda-graph-backend-decode"),
    ("cuda_graph_backend_prefill", "--cuda-graph-backend-prefill"),
)


_FRONT_END = ("the SMG gRPC front end serves requests without SGLang's TokenizerManager, so kvplane's "
              "request checks (custom_params.kvplane_slo_tbt_ms), placement replies and --kv-pacing would "
              "be skipped")

_REFUSED_SWITCHES: tuple[tuple[str, str, str], ...] = (
    ("enable_hierarchical_cache", "--enable-hierarchical-cache", "HiCache is a second KV tier of its own"),
    ("enable_two_batch_overlap", "--enable-two-batch-overlap",
     "two-batch overlap splits and pads each batch (ForwardBatch._pad_inputs_to_size), which the "
     "layered step tables do not follow"),
    ("enable_lmcache", "--enable-lmcache",
     "LMCache is a second KV tier with a radix cache of its own (SGLang's scheduler then calls "
     "its tier's events on kvplane's radix cache and stops at the first step)"),
    ("enable_flexkv", "--enable-flexkv",
     "FlexKV is a second KV tier with a radix cache of its own (SGLang's scheduler then calls "
     "its tier's events on kvplane's radix cache and stops at the first step)"),
    ("enable_unified_cache_external_linker", "--enable-unified-cache-external-linker",
     "the external cache linker is a second KV tier on SGLang's UnifiedRadixCache"),
    ("enable_session_radix_cache", "--enable-session-radix-cache",
     "session radix caching needs SGLang's UnifiedRadixCache; --enable-layered-kv serves its own radix cache"),
    ("enable_streaming_session", "--enable-streaming-session",
     "streaming sessions need SGLang's UnifiedRadixCache; --enable-layered-kv serves its own radix cache"),
    ("enable_memory_saver", "--enable-memory-saver",
     "the layered KV pool's device pages are not allocated through torch_memory_saver, so "
     "/release_memory_occupation would leave them in place"),
    ("enable_pdmux", "--enable-pdmux",
     "PD multiplexing runs prefill and decode batches on streams of their own in a loop that never "
     "calls Scheduler.get_next_batch_to_run, where kvplane's step boundary runs"),
    ("enable_prefill_cp", "--enable-prefill-cp",
     "context parallelism splits each request's KV over ranks, which the layered page tables do not follow"),
    ("enable_mis", "--enable-mis",
     "multi-item scoring needs custom attention masks, which the layered attention backends do not take"),
    ("enable_deterministic_inference", "--enable-deterministic-inference",
     "the layered decode backends do not apply SGLang's fixed split sizes, so batch-invariant "
     "output is not guaranteed"),
    ("rl_on_policy_target", "--rl-on-policy-target",
     "it turns on deterministic inference, whose fixed split sizes the layered decode backends do not apply"),
    ("dllm_algorithm", "--dllm-algorithm",
     "diffusion-LM inference denoises blocks of tokens in a forward mode (DLLM_EXTEND) and CUDA graphs of "
     "its own, which the layered step tables and decode graphs do not follow"),
    ("smg_grpc_mode", "--smg-grpc-mode", _FRONT_END),
    ("grpc_mode", "--grpc-mode", _FRONT_END),
)
"""SGLang options ``--enable-layered-kv`` cannot serve with once they are set (true, or a value
where the default is None): (option, flag, why)."""

_REFUSED_SIZES: tuple[tuple[str, str, str], ...] = (
    ("dcp_size", "--dcp-size",
     "decode context parallelism stripes each request's KV over ranks, which the layered page tables do not follow"),
    ("attn_cp_size", "--attn-cp-size",
     "context parallelism splits each request's KV over ranks, which the layered page tables do not follow"),
    ("tokenizer_worker_num", "--tokenizer-worker-num",
     "SGLang loads no plugins in its extra tokenizer worker processes, so kvplane's request checks "
     "(custom_params.kvplane_slo_tbt_ms), placement replies and --kv-pacing would be skipped there"),
)
"""Sizes above one that ``--enable-layered-kv`` cannot serve with: (option, flag, why)."""


RUST_SERVER_REFUSED = (
    "SGLANG_RUST_SERVER=1: SGLang's Rust server replaces the API server, TokenizerManager and "
    "detokenizer, so kvplane's request checks (custom_params.kvplane_slo_tbt_ms), placement replies "
    "and --kv-pacing would be skipped; not supported with --enable-layered-kv (unset it)"
)
"""The refusal of SGLang's Rust server (an environment flag, read by the launcher's caller)."""

GLUE_GRAPH_REFUSED = (
    "--kv-cuda-graphs on with SGLANG_ENABLE_METADATA_GLUE_GRAPH=1: SGLang would replay a captured copy of "
    "the attention backend's per-replay preparation instead of calling it, skipping kvplane's check that "
    "it admitted each replayed step; not supported (unset it)"
)
"""The refusal of SGLang's metadata glue graph under decode graphs (an environment flag)."""

BUSY_MEM_CHECK_REFUSED = (
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY: SGLang's busy-time KV leak check counts the KV rows "
    "of the running batch only, so a request kvplane paused (it keeps its KV) reads as a leak and the "
    "check stops the scheduler; not supported with --enable-layered-kv (unset it; the idle-time check "
    "stays on)"
)
"""The refusal of SGLang's busy-time strict memory check (an environment level)."""


class LaunchRefused(ValueError):
    """``--enable-layered-kv`` cannot serve with these options (the message names the option)."""


@dataclass(frozen=True)
class LaunchDecision:
    """Options ``--enable-layered-kv`` sets on SGLang's namespace, and the line that says so."""

    device: str
    """``cuda`` or ``cpu`` (SGLang's ``--device``; unset means CUDA)."""
    implied: tuple[tuple[str, Any], ...]
    """``(option name, value)`` pairs to set on the namespace, in order."""
    notes: tuple[str, ...]
    """One sentence per implied option (logged at launch)."""

    @classmethod
    def decide(cls, values: Mapping[str, Any], *, rocm: bool = False, rust_server: bool = False,
               glue_graph: bool = False, busy_mem_check: bool = False) -> LaunchDecision:
        """The decision for SGLang's parsed options ``values`` (``rocm``: the torch build is
        ROCm's; ``rust_server`` / ``glue_graph`` / ``busy_mem_check``: SGLang's
        ``SGLANG_RUST_SERVER`` / ``SGLANG_ENABLE_METADATA_GLUE_GRAPH`` /
        ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY`` is on); raises :class:`LaunchRefused`."""
        if rust_server:
            raise LaunchRefused(RUST_SERVER_REFUSED)
        if busy_mem_check:
            raise LaunchRefused(BUSY_MEM_CHECK_REFUSED)
        given = str(values.get("device") or "cuda")
        device = given.split(":")[0]  # SGLang takes cuda:N as cuda
        if device not in LAYERED_BACKENDS:
            raise LaunchRefused(
                f"--enable-layered-kv supports --device cuda or cpu, got --device {given}"
            )
        implied: list[tuple[str, Any]] = []
        notes: list[str] = []
        rocm = rocm and device == "cuda"
        supported = ROCM_BACKENDS if rocm else LAYERED_BACKENDS[device]
        platform = "ROCm" if rocm else device
        for name, flag in _BACKEND_FLAGS:
            chosen = values.get(name)
            if rocm and chosen == "flashinfer":
                raise LaunchRefused(
                    f"{flag} flashinfer: FlashInfer runs on NVIDIA GPUs only and this torch is a ROCm build; "
                    f"on ROCm use {' or '.join(supported)} (or leave it unset: kvplane picks {supported[0]})"
                )
            if chosen is not None and chosen not in supported:
                raise LaunchRefused(
                    f"{flag} {chosen} reads SGLang's flat KV buffers, which the layered KV pool does "
                    f"not have; on {platform} use {' or '.join(supported)} (or leave it unset)"
                )
        default = supported[0] if rocm else DEFAULT_BACKEND[device]
        cls._refuse_split(values, values.get("attention_backend") or default)
        if values.get("attention_backend") is None:
            implied.append(("attention_backend", default))
            notes.append(
                f"--attention-backend {default} (layered{'; FlashInfer is NVIDIA-only' if rocm else ''}): "
                "SGLang's own choice would read the flat KV buffers"
            )
        if values.get("cuda_graph_config") is not None:
            raise LaunchRefused(
                "--cuda-graph-config: not supported with --enable-layered-kv (kvplane decides the graph "
                "backends: off, or decode graphs with --kv-cuda-graphs on); remove the option"
            )
        if values.get("kv_cuda_graphs", "off") == "on":
            if glue_graph:
                raise LaunchRefused(GLUE_GRAPH_REFUSED)
            cls._keep_decode_graphs(values, default, device, implied, notes)
        else:
            cls._graphs_off(values, implied, notes)
        dtype = str(values.get("kv_cache_dtype") or "auto")
        if dtype not in UNQUANTIZED_KV_DTYPES:
            raise LaunchRefused(
                f"--kv-cache-dtype {dtype}: quantized KV caches are not supported with "
                f"--enable-layered-kv (use {' or '.join(UNQUANTIZED_KV_DTYPES)})"
            )
        cls._refuse_features(values)
        chunk = values.get("chunked_prefill_size")
        if device == "cuda" and values.get("page_size") is None:
            if chunk is not None and int(chunk) > 0 and int(chunk) % CUDA_PAGE_SIZE:
                notes.append(f"page size left to SGLang: --chunked-prefill-size {chunk} is not a multiple of "
                             f"{CUDA_PAGE_SIZE} (set both for whole-page KV copies)")
            else:
                implied.append(("page_size", CUDA_PAGE_SIZE))
                notes.append(f"--page-size {CUDA_PAGE_SIZE}: KV moves between host and device in whole pages "
                             "(one-token pages make every copy segment a few KiB)")
        if values.get("kv_overlap_schedule", "off") == "on":
            if rocm and not values.get("disable_overlap_schedule"):
                raise LaunchRefused(ROCM_OVERLAP_REFUSED)
            if not values.get("disable_overlap_schedule"):
                notes.append("SGLang's overlap scheduler kept (--kv-overlap-schedule on)"
                             + (": not yet validated on a GPU" if device == "cuda" else ""))
        elif not values.get("disable_overlap_schedule"):
            implied.append(("disable_overlap_schedule", True))
            notes.append("--disable-overlap-schedule: plans are installed at step boundaries "
                         "(--kv-overlap-schedule on keeps SGLang's overlap scheduler)")
        return cls(device=device, implied=tuple(implied), notes=tuple(notes))

    @staticmethod
    def _refuse_split(values: Mapping[str, Any], backend: str) -> None:
        """A prefill backend other than the decode one makes SGLang wrap both in its
        ``HybridAttnBackend`` (``attention_backend_setup.py``), which kvplane's hooks (fused KV
        writes, recompute rows, layer timing) do not see through, and a torch-native half of it
        reads token tables the paged half's steps do not build."""
        prefill = values.get("prefill_attention_backend") or backend
        decode = values.get("decode_attention_backend") or backend
        if prefill != decode:
            raise LaunchRefused(
                f"--prefill-attention-backend {prefill} with --decode-attention-backend {decode}: "
                "--enable-layered-kv serves one attention backend for both phases; set --attention-backend "
                f"{decode} (or {prefill}) and drop the other two"
            )

    @staticmethod
    def _graphs_off(values: Mapping[str, Any], implied: list[tuple[str, Any]], notes: list[str]) -> None:
        graphs_off = bool(values.get("disable_cuda_graph"))  # the deprecated --disable-cuda-graph
        for name, flag in _GRAPH_FLAGS:
            chosen = values.get(name)
            if chosen is None:
                if not graphs_off:
                    implied.append((name, "disabled"))
            elif chosen != "disabled":
                raise LaunchRefused(
                    f"{flag} {chosen}: CUDA graph capture is not supported with --enable-layered-kv "
                    f"(the per-layer tables and fetches change every step); use {flag} disabled "
                    "(or --kv-cuda-graphs on for decode graphs)"
                )
        if any(name.startswith("cuda_graph_backend") for name, _ in implied):
            notes.append("CUDA graphs off (--cuda-graph-backend-decode/prefill disabled): the "
                         "layered tables change every step (--kv-cuda-graphs on keeps decode graphs)")
        if values.get("enable_torch_compile"):
            notes.append(TORCH_COMPILE_NOTE)

    @staticmethod
    def _keep_decode_graphs(values: Mapping[str, Any], default: str, device: str, implied: list[tuple[str, Any]],
                            notes: list[str]) -> None:
        """``--kv-cuda-graphs on``: SGLang's decode graphs kept for the layered Triton or FlashInfer
        decode (``docs/cuda-graphs.md``); prefill graphs stay off. ``default``: kvplane's
        attention backend where none is given."""
        serving = values.get("attention_backend") or default
        for name, flag in _BACKEND_FLAGS:  # (a split of decode and prefill backends is refused before)
            chosen = values.get(name)
            given = chosen is not None
            if name == "attention_backend" and not given:
                chosen = default
            if chosen is not None and chosen not in GRAPH_BACKENDS:
                why = "" if given else f" (kvplane's choice on {device}: none given)"
                raise LaunchRefused(
                    f"--kv-cuda-graphs on with {flag} {chosen}{why}: only the layered paged decodes "
                    f"({' and '.join(GRAPH_BACKENDS)}) read their tables from persistent buffers a graph "
                    f"replays; use --attention-backend {' or '.join(GRAPH_BACKENDS)}"
                )
        why_not = (
            ("disable_cuda_graph", "--disable-cuda-graph", "turns decode graphs off"),
            ("enable_torch_compile", "--enable-torch-compile", "would compile kvplane's layer code into the graphs"),
        )
        for name, flag, why in why_not:
            if values.get(name):
                raise LaunchRefused(f"--kv-cuda-graphs on with {flag}: it {why}; not supported")
        decode, prefill = (values.get(name) for name, _ in _GRAPH_FLAGS)
        if decode not in (None, "full"):
            why = "turns decode graphs off" if decode == "disabled" else "the layered decode is captured whole"
            raise LaunchRefused(f"--kv-cuda-graphs on with --cuda-graph-backend-decode {decode}: {why} (use full, "
                                "or leave it unset)")
        if prefill is None:
            implied.append(("cuda_graph_backend_prefill", "disabled"))
        elif prefill != "disabled":
            raise LaunchRefused(f"--cuda-graph-backend-prefill {prefill}: prefill graphs are not supported with "
                                "--enable-layered-kv; use --cuda-graph-backend-prefill disabled")
        tp = int(values.get("tp_size") or 1)
        overlap = values.get("kv_overlap_schedule") == "on" and not values.get("disable_overlap_schedule")
        notes.append(f"decode CUDA graphs kept (--kv-cuda-graphs on, {serving}): decode steps "
                     "replay, staged ones with their "
                     "fetches in the graph (recompute steps run eagerly); prefill graphs off"
                     + (f"; the {tp} TP ranks replay a step only when all of them admit it" if tp > 1 else "")
                     + ("; under the overlap loop the layer timer's sampled steps run eagerly" if overlap else "")
                     + ("; not yet validated on a GPU" if device == "cuda" else
                        "; SGLang captures no graphs on a CPU, so it has no effect here"))

    @staticmethod
    def _refuse_features(values: Mapping[str, Any]) -> None:
        if values.get("speculative_algorithm"):
            raise LaunchRefused(
                f"--speculative-algorithm {values['speculative_algorithm']}: speculative decoding is "
                "not supported with --enable-layered-kv"
            )
        if int(values.get("pp_size") or 1) > 1:
            raise LaunchRefused("--pp-size > 1: pipeline parallelism is not supported with --enable-layered-kv")
        if values.get("enable_dp_attention") or int(values.get("attn_dp_size") or 1) > 1:
            raise LaunchRefused(DP_ATTENTION_REFUSED)
        mode = values.get("disaggregation_mode")
        if mode not in (None, "null"):
            raise LaunchRefused(
                f"--disaggregation-mode {mode}: prefill/decode disaggregation is not supported with "
                "--enable-layered-kv"
            )
        for name, flag, why in _REFUSED_SWITCHES:
            if values.get(name):
                raise LaunchRefused(f"{flag}: {why}; not supported with --enable-layered-kv")
        for name, flag, why in _REFUSED_SIZES:
            if int(values.get(name) or 1) > 1:
                raise LaunchRefused(f"{flag} > 1: {why}; not supported with --enable-layered-kv")
        if values.get("radix_eviction_policy") == "tlru":
            raise LaunchRefused(
                "--radix-eviction-policy tlru: T-LRU needs SGLang's UnifiedRadixCache; --enable-layered-kv "
                "serves its own radix cache (use lru or another policy)"
            )
        canary = values.get("kv_canary")
        if canary not in (None, "none"):
            raise LaunchRefused(
                f"--kv-canary {canary}: SGLang's KV canary checks the flat KV buffers, which the layered KV "
                "pool does not have; not supported with --enable-layered-kv (use --kv-canary none)"
            )

    def apply(self, namespace: Any) -> None:
        """Set the implied options on SGLang's namespace."""
        for name, value in self.implied:
            setattr(namespace, name, value)
