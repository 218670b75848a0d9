"""The ``--enable-layered-kv`` flag family's command line: :func:`add_arguments` (values only;
:meth:`sglang_ext.args.LayeredKVArgs.from_namespace` validates them).

Pure Python: no torch / SGLang import here (the launcher imports it before parsing).
"""

from __future__ import annotations

import argparse

from sglang_ext.args import (
    DEFAULT_TIMING_INTERVAL,
    DEFAULTS,
    MAX_COPY_PROGRAMS,
    MAX_GPU_BUDGET_TOKENS,
    MAX_HOST_POOL_GB,
    MAX_REPORT_INTERVAL,
    MAX_TIMING_INTERVAL,
    SCHEDULERS,
)


def add_arguments(parser: argparse.ArgumentParser) -> bool:
    """Add the flag family to ``parser`` (idempotent); return whether it was added.

    Values are only parsed here; cross-field validation happens when
    :meth:`LayeredKVArgs.from_namespace` builds the dataclass.
    """
    if any("--enable-layered-kv" in action.option_strings for action in parser._actions):
        return False
    group = parser.add_argument_group("kvplane layered KV (plugin)")
    group.add_argument(
        "--enable-layered-kv",
        action="store_true",
        default=DEFAULTS.enable_layered_kv,
        help="Govern KV placement per request and per layer with kvplane "
        "(implies --radix-cache-backend layered).",
    )
    group.add_argument(
        "--kv-control-plane",
        type=str,
        default=DEFAULTS.kv_control_plane,
        help="'embedded' (default) or grpc://HOST:PORT of a kvplane control-plane service.",
    )
    group.add_argument("--kv-policy", type=str, default=None, help="kvplane policy file.")
    group.add_argument(
        "--kv-host-pool-gb",
        type=float,
        default=DEFAULTS.kv_host_pool_gb,
        help=f"Cap on the host KV pool in GB, (0, {MAX_HOST_POOL_GB}]; default: what the pool "
        "needs (every layer of --max-total-tokens; none when all of it is on the GPU), checked against the "
        "host's available memory; the launcher assumes --max-total-tokens is beyond the GPU.",
    )
    group.add_argument(
        "--kv-scheduler",
        type=str,
        default=DEFAULTS.kv_scheduler,
        help=f"kvplane scheduler: {', '.join(SCHEDULERS)}.",
    )
    group.add_argument(
        "--kv-pacing",
        type=str,
        default=DEFAULTS.kv_pacing,
        help="Token-deposit pacing of streamed output: on = one token per TBT-SLO interval while "
        "tokens are held, the rest at the finish (hides pauses, delays fast streams' text); "
        "off (default) = tokens as generated.",
    )
    group.add_argument(
        "--kv-overlap-schedule",
        type=str,
        default=DEFAULTS.kv_overlap_schedule,
        help="SGLang's overlap scheduler with the layered pool: off (default) implies "
        "--disable-overlap-schedule; on keeps SGLang's choice (CPU-tested, not yet GPU-validated).",
    )
    group.add_argument(
        "--kv-cuda-graphs",
        type=str,
        default=DEFAULTS.kv_cuda_graphs,
        help="SGLang's decode CUDA graphs with the layered pool: off (default); on keeps them for "
        "the layered triton and flashinfer decodes (decode steps replay, staged ones with their fetches in the graph; a step "
        "the graph buffers cannot take runs eagerly; CPU-tested on an emulated graph, not yet GPU-validated).",
    )
    group.add_argument("--kv-tls-ca", type=str, default=None, help="CA bundle (remote control plane).")
    group.add_argument("--kv-tls-cert", type=str, default=None, help="Client certificate (mTLS).")
    group.add_argument("--kv-tls-key", type=str, default=None, help="Client key (mTLS).")
    group.add_argument(
        "--kv-policy-token-file", type=str, default=None, help="Bearer token file (remote control plane)."
    )
    group.add_argument(
        "--kv-gpu-budget-tokens",
        type=int,
        default=None,
        help="Device KV budget across all layers, in token-layers (default: SGLang's pool size, "
        f"no forced offload); [1, {MAX_GPU_BUDGET_TOKENS}].",
    )
    group.add_argument(
        "--kv-report-interval",
        type=int,
        default=DEFAULTS.kv_report_interval,
        help="Steady decode steps per report to the control plane (changes are reported at "
        "once); 1 = every step (and --kv-report-quiet-interval 1 in quiet stretches); "
        f"[1, {MAX_REPORT_INTERVAL}].",
    )
    group.add_argument(
        "--kv-report-quiet-interval",
        type=int,
        default=None,
        help="Steady decode steps per report while nothing is offloaded and the step time is "
        "steady (default: 4 x --kv-report-interval); equal to --kv-report-interval turns the "
        f"quiet cadence off; [--kv-report-interval, {MAX_REPORT_INTERVAL}].",
    )
    group.add_argument(
        "--kv-profile",
        type=str,
        default=None,
        help="`kvplane profile` file (per-layer compute, H2D/D2H GB/s) seeding the controller's "
        "profile (default: learnt from the first steps).",
    )
    group.add_argument(
        "--kv-recompute-ratio",
        type=float,
        default=DEFAULTS.kv_recompute_ratio,
        help="eLLM uncached ratio forced on every request, [0, 1): the first r x prompt tokens "
        "are recomputed each decode step instead of cached (default 0: none).",
    )
    group.add_argument(
        "--kv-recompute-layers",
        type=int,
        default=None,
        help="Layers recomputed under --kv-recompute-ratio, the prefix fetched above (default: all).",
    )
    group.add_argument(
        "--kv-copy-engine",
        type=str,
        default="dma",
        help="How KV moves between host and GPU on CUDA: dma (default: the copy engines via 2-D copies and "
        "cuMemcpyBatchAsync, CUDA 12.8+ driver, no SM taken; probed at start, falls back to triton with a "
        "warning) or triton (copy kernels on a few SMs).",
    )
    group.add_argument(
        "--kv-copy-programs",
        type=int,
        default=None,
        help=f"Programs of each Triton host<->device KV copy launch on CUDA, [1, {MAX_COPY_PROGRAMS}] "
        "(default 8: few, so the layers a fetch overlaps keep the SMs; see kvplane gpu-check).",
    )
    group.add_argument(
        "--kv-timing-interval",
        type=int,
        default=DEFAULT_TIMING_INTERVAL,
        help=f"Time the CUDA KV copies and stalls (events) on about one step in N, [1, {MAX_TIMING_INTERVAL}] "
        f"(default {DEFAULT_TIMING_INTERVAL}; 1: every step; the copy-seconds totals are then estimates).",
    )
    group.add_argument(
        "--kv-policy-listen",
        type=str,
        default=None,
        help="HOST:PORT on which to serve the embedded control plane's live policy API "
        "(kvplane.v1.PolicyService: get/update/watch; `kvplane policy`); default off.",
    )
    group.add_argument(
        "--kv-policy-listen-token-file",
        type=str,
        default=None,
        help="Bearer token required for policy updates on --kv-policy-listen.",
    )
    group.add_argument(
        "--kv-policy-listen-allow-unauthenticated",
        action="store_true",
        default=DEFAULTS.kv_policy_listen_allow_unauthenticated,
        help="Serve policy updates on --kv-policy-listen without a token (refused otherwise).",
    )
    group.add_argument("--kv-policy-listen-tls-cert", type=str, default=None,
                       help="Server certificate (PEM) for --kv-policy-listen (TLS).")
    group.add_argument("--kv-policy-listen-tls-key", type=str, default=None,
                       help="Server private key (PEM) for --kv-policy-listen.")
    group.add_argument("--kv-policy-listen-tls-ca", type=str, default=None,
                       help="CA of client certificates: --kv-policy-listen requires them (mutual TLS).")
    return True
