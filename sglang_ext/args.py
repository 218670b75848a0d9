"""The ``--enable-layered-kv`` flag family: one frozen dataclass and its transport (its command line: ``layered_kv_cli.py``).

SGLang 0.5.23's ``ServerArgs`` is a sealed msgspec Struct that keeps only its own
fields (``ServerArgs.from_cli_args`` drops every other namespace attribute), so a
plugin's flags cannot ride on it. As in SGLang's own out-of-tree plugins (smg's
``--servicer-impl``), the parsed values travel to the scheduler, tokenizer and
detokenizer processes in an environment variable (:data:`ENV_VAR`, a JSON
object) that the launcher sets before it spawns them (read and written by
:mod:`sglang_ext.settings`, which owns every ``KVPLANE_*`` variable).

Pure Python: no torch / SGLang import here (the launcher imports it before parsing).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from sglang_ext import settings

ENV_VAR = settings.LAYERED_KV_ARGS_ENV
"""Environment variable carrying :class:`LayeredKVArgs` as JSON to SGLang's subprocesses."""

SCHEDULERS = ("fcfs", "layerkv", "lvf")
PACING_CHOICES = ("on", "off")
OVERLAP_CHOICES = ("on", "off")
RADIX_BACKEND_NAME = "layered"
"""Name under which the residency-hook radix cache is registered (``--radix-cache-backend``)."""
MAX_HOST_POOL_GB = 1 << 16
MAX_GPU_BUDGET_TOKENS = 1 << 40
MAX_REPORT_INTERVAL = 1024
QUIET_REPORT_FACTOR = 4
"""``--kv-report-quiet-interval``'s default, in ``--kv-report-interval``s."""
MAX_COPY_PROGRAMS = 4096
DEFAULT_TIMING_INTERVAL = 8
"""``--kv-timing-interval``'s default: the CUDA copies and waits of about one step in 8 are timed."""
MAX_TIMING_INTERVAL = 1 << 16
COPY_ENGINES = ("triton", "dma")
"""``--kv-copy-engine`` values (``SlotStoreConfig.copy_engine``)."""

_GRPC_TARGET = re.compile(r"^grpc://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-_]+):(?P<port>\d{1,5})$")


@dataclass(frozen=True)
class LayeredKVArgs:
    """Validated kvplane launch options (``--enable-layered-kv`` and friends)."""

    enable_layered_kv: bool = False
    """Master switch; every other field is ignored (but still validated) when False."""
    kv_control_plane: str = "embedded"
    """``embedded`` (in-process controller) or ``grpc://HOST:PORT`` (remote service)."""
    kv_policy: str | None = None
    """Policy file (JSON/YAML) loaded at start; must exist and hold a policy the control plane
    accepts (``controlplane.policy_store.load_policy_file``, checked here)."""
    kv_host_pool_gb: float | None = None
    """Cap on the host (pinned on CUDA) KV pool in GB (1e9 bytes), in (0, 65536]; None (the
    default) sizes it to what the pool needs (nothing where every layer of the slot space is on
    the device: ``SlotStoreConfig.host_tier``), checked against the host's available memory. The
    launcher also refuses a cap below what the model's KV needs, assuming ``--max-total-tokens``
    is beyond the device (:class:`sglang_ext.host_pool_floor.HostPoolFloor`, which needs the
    model config)."""
    kv_scheduler: str = "fcfs"
    """Admission/rotation scheduler: fcfs, layerkv (LayerKV §3.1) or lvf (SuperInfer §4.2)."""
    kv_pacing: str = "off"
    """Token-deposit pacing of streamed output (OrbitFlow §3.2): on or off. ``on`` releases a
    stream's tokens at one per TBT-SLO interval while any are held, the rest when it finishes:
    it hides pauses and stalls a stream has run ahead of, at the price of holding back most of
    every fast stream's text (``off``, the default since `kvplane bench pacing` measured it;
    README "Streaming pacing")."""
    kv_overlap_schedule: str = "off"
    """SGLang's overlap scheduler with the layered pool: ``off`` (the default) implies
    ``--disable-overlap-schedule``; ``on`` keeps SGLang's own choice (its default: on), so the
    scheduling and kvplane's step boundary of step k+1 run while step k computes. Tested on CPU
    (``tests/sglang/test_overlap_server.py``), not yet on a GPU (``docs/overlap-schedule.md``)."""
    kv_cuda_graphs: str = "off"
    """SGLang's decode CUDA graphs with the layered pool: ``off`` (the default) turns them off;
    ``on`` keeps them for the layered Triton decode: a decode step replays a graph captured over
    persistent tables (``docs/cuda-graphs.md``), a staged one with its fetches and parked
    write-back as the graph's launches; a step the buffers cannot take runs eagerly. Tested on the CPU through SGLang's own graph runner on an emulated graph, not yet on
    a GPU."""
    kv_tls_ca: str | None = None
    """CA bundle to verify the remote control plane (grpc:// only); PEM certificates, checked here."""
    kv_tls_cert: str | None = None
    """Client certificate for mutual TLS (needs ``kv_tls_key``); PEM, checked here."""
    kv_tls_key: str | None = None
    """Client private key for mutual TLS (needs ``kv_tls_cert``); unencrypted PEM of that
    certificate, checked here."""
    kv_policy_token_file: str | None = None
    """File holding the bearer token for the remote control plane (grpc:// only); not empty
    (``controlplane.policy_store.load_token_file``, checked here)."""
    kv_gpu_budget_tokens: int | None = None
    """Device KV budget across all layers in token-layers (pages = this // page_size); None:
    as much as SGLang's own pool would hold (no forced offload). In [1, 2**40]."""
    kv_report_interval: int = 8
    """Steady decode steps coalesced into one report to the control plane, in [1, 1024]; 1 =
    report every step (with ``kv_report_quiet_interval`` 1 also in quiet stretches). A step that
    changes anything (arrival, finish, queue, pause, plan expiry, an outage) is always reported
    at once (see ``sglang_ext.step_reporter``)."""
    kv_report_quiet_interval: int | None = None
    """Steady decode steps per report in a *quiet* stretch (nothing offloaded, recomputed or
    newly decided, the step time steady; ``sglang_ext.step_reporter``), in
    [``kv_report_interval``, 1024]; None: ``4 * kv_report_interval`` (capped at 1024). Equal to
    ``kv_report_interval``: no quiet cadence."""
    kv_profile: str | None = None
    """A ``kvplane profile`` file (:class:`~sglang_ext.dataplane.profile_schema.DeviceProfile`:
    per-layer compute, H2D/D2H GB/s) that seeds the controller's profile; must exist and parse.
    None: the controller starts from defaults and learns from the first steps."""
    kv_recompute_ratio: float = 0.0
    """eLLM's uncached ratio forced on every request (``docs/recompute.md``), in [0, 1): a
    decoding request keeps the first ``floor(r * prompt / page_size)`` pages off the device and
    recomputes them each decode step; 0 (the default) recomputes nothing. A request's
    ``custom_params.kvplane_recompute_ratio`` overrides it."""
    kv_recompute_layers: int | None = None
    """Layers recomputed under ``kv_recompute_ratio`` (the prefix is fetched above), >= 0;
    None: all (pure recompute)."""
    kv_copy_engine: str = "dma"
    """How host<->device KV copies run on CUDA: ``dma`` (the default: the copy engines, strided
    runs as 2-D copies and the rest as one ``cuMemcpyBatchAsync`` per launch, no SM taken:
    ``kernels.batched_memcpy``, ``kernels.pitched_memcpy``; needs a CUDA 12.8+ driver, falls back
    to ``triton`` with a warning when the probe at start fails) or ``triton`` (gather/scatter
    kernels over the pinned pool, on ``kv_copy_programs`` SMs). The default since `kvplane
    gpu-check` runs 18-19 on an H200: H2D + D2H 1.65x one direction (the kernels 1.19x), the
    layers' compute 0.35 ms a layer while fetching (0.49 beside the kernels' programs), the
    hidden and half-offloaded placements' steps as fast or within 2.3%
    (``benchmarks/results/gpu/session32-h200-runs.md``)."""
    kv_copy_programs: int | None = None
    """Persistent programs of each Triton host<->device KV copy launch on CUDA, in [1, 4096];
    None: the kernel's default (``kernels.block_copy.DEFAULT_PROGRAMS``, 8: few, so the layers a
    fetch overlaps keep the SMs; one direction still fills PCIe). More raise H2D + D2H together
    at the layers' expense (``kvplane gpu-check``'s overlap figure sweeps 256 / 32 / 16 / 4 and
    recommends one). Ignored on CPU."""
    kv_timing_interval: int = DEFAULT_TIMING_INTERVAL
    """Time the host<->device copies and the compute stream's waits on them with CUDA events on
    about one decode step in this many (random gaps of mean N), in [1, 65536]; 1: every step.
    Each event costs host time on the scheduler thread. The ``kvplane:h2d_seconds_total`` /
    ``d2h`` / stall totals are then estimates (a timed step's seconds count N times), and the
    ``kvplane:stall_seconds`` histogram observes the timed steps only
    (:class:`~sglang_ext.dataplane.event_clock.EventClock`). Ignored on CPU (the synchronous
    copies are timed by the wall clock, every step)."""
    kv_policy_listen: str | None = None
    """``HOST:PORT`` on which TP rank 0's scheduler serves the embedded control plane's
    ``kvplane.v1.PolicyService`` (get / update / watch the live policy); None: not served.
    Checked by :class:`~sglang_ext.policy_endpoint_config.PolicyEndpointConfig` at launch."""
    kv_policy_listen_token_file: str | None = None
    """Bearer token that policy updates on ``kv_policy_listen`` must carry."""
    kv_policy_listen_allow_unauthenticated: bool = False
    """Serve policy updates without a token (refused at launch unless set)."""
    kv_policy_listen_tls_cert: str | None = None
    """Server certificate chain (PEM) of ``kv_policy_listen``; with the key, the port speaks TLS."""
    kv_policy_listen_tls_key: str | None = None
    """Server private key (PEM) of ``kv_policy_listen``."""
    kv_policy_listen_tls_ca: str | None = None
    """CA of client certificates: set, ``kv_policy_listen`` requires them (mutual TLS)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_layered_kv, bool):
            raise ValueError(
                f"--enable-layered-kv must be a boolean, got {self.enable_layered_kv!r}"
            )
        if self.kv_control_plane != "embedded" and not _GRPC_TARGET.match(self.kv_control_plane):
            raise ValueError(
                f"--kv-control-plane={self.kv_control_plane!r} is invalid; allowed: "
                "'embedded' or 'grpc://HOST:PORT'"
            )
        if self.control_plane_port is not None and not 1 <= self.control_plane_port <= 65535:
            raise ValueError(
                f"--kv-control-plane={self.kv_control_plane!r}: port {self.control_plane_port} "
                "is out of range [1, 65535]"
            )
        gb = self.kv_host_pool_gb
        if gb is not None and (
            isinstance(gb, bool) or not isinstance(gb, int | float) or not 0 < gb <= MAX_HOST_POOL_GB
        ):
            raise ValueError(
                f"--kv-host-pool-gb={gb!r} is out of range (0, {MAX_HOST_POOL_GB}] (GB)"
            )
        if self.kv_scheduler not in SCHEDULERS:
            raise ValueError(
                f"--kv-scheduler={self.kv_scheduler!r} is invalid; allowed: {', '.join(SCHEDULERS)}"
            )
        if self.kv_pacing not in PACING_CHOICES:
            raise ValueError(
                f"--kv-pacing={self.kv_pacing!r} is invalid; allowed: {', '.join(PACING_CHOICES)}"
            )
        if self.kv_overlap_schedule not in OVERLAP_CHOICES:
            raise ValueError(
                f"--kv-overlap-schedule={self.kv_overlap_schedule!r} is invalid; allowed: {', '.join(OVERLAP_CHOICES)}"
            )
        if self.kv_cuda_graphs not in OVERLAP_CHOICES:
            raise ValueError(
                f"--kv-cuda-graphs={self.kv_cuda_graphs!r} is invalid; allowed: {', '.join(OVERLAP_CHOICES)}"
            )
        for flag, value in (
            ("--kv-policy", self.kv_policy),
            ("--kv-tls-ca", self.kv_tls_ca),
            ("--kv-tls-cert", self.kv_tls_cert),
            ("--kv-tls-key", self.kv_tls_key),
            ("--kv-policy-token-file", self.kv_policy_token_file),
        ):
            if value is not None and not Path(value).is_file():
                raise ValueError(f"{flag}={value!r}: no such file")
        budget = self.kv_gpu_budget_tokens
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_GPU_BUDGET_TOKENS
        ):
            raise ValueError(
                f"--kv-gpu-budget-tokens={budget!r} is out of range [1, {MAX_GPU_BUDGET_TOKENS}] "
                "(token-layers)"
            )
        every = self.kv_report_interval
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_REPORT_INTERVAL:
            raise ValueError(
                f"--kv-report-interval={every!r} is out of range [1, {MAX_REPORT_INTERVAL}] (steps)"
            )
        quiet = self.kv_report_quiet_interval
        if quiet is not None and (
            isinstance(quiet, bool) or not isinstance(quiet, int) or not every <= quiet <= MAX_REPORT_INTERVAL
        ):
            raise ValueError(
                f"--kv-report-quiet-interval={quiet!r} is out of range [{every}, {MAX_REPORT_INTERVAL}] "
                "(steps; at least --kv-report-interval)"
            )
        ratio = self.kv_recompute_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio < 1:
            raise ValueError(f"--kv-recompute-ratio={ratio!r} is out of range [0, 1)")
        rl = self.kv_recompute_layers
        if rl is not None and (isinstance(rl, bool) or not isinstance(rl, int) or rl < 0):
            raise ValueError(f"--kv-recompute-layers={rl!r} is out of range [0, model layers]")
        if rl is not None and not ratio:  # it only says where --kv-recompute-ratio's prefix is recomputed
            raise ValueError(f"--kv-recompute-layers={rl!r} needs --kv-recompute-ratio > 0 (alone it does nothing)")
        if self.kv_copy_engine not in COPY_ENGINES:
            raise ValueError(f"--kv-copy-engine={self.kv_copy_engine!r} is invalid; allowed: {', '.join(COPY_ENGINES)}")
        cp = self.kv_copy_programs
        if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or not 1 <= cp <= MAX_COPY_PROGRAMS):
            raise ValueError(f"--kv-copy-programs={cp!r} is out of range [1, {MAX_COPY_PROGRAMS}]")
        ti = self.kv_timing_interval
        if isinstance(ti, bool) or not isinstance(ti, int) or not 1 <= ti <= MAX_TIMING_INTERVAL:
            raise ValueError(f"--kv-timing-interval={ti!r} is out of range [1, {MAX_TIMING_INTERVAL}] (steps)")
        if self.kv_profile is not None:
            self._check_profile(self.kv_profile)
        if (self.kv_tls_cert is None) != (self.kv_tls_key is None):
            raise ValueError("--kv-tls-cert and --kv-tls-key must be given together (mutual TLS)")
        remote_only = {
            "--kv-tls-ca": self.kv_tls_ca,
            "--kv-tls-cert": self.kv_tls_cert,
            "--kv-tls-key": self.kv_tls_key,
            "--kv-policy-token-file": self.kv_policy_token_file,
        }
        if self.kv_control_plane == "embedded":
            given = [flag for flag, value in remote_only.items() if value is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only apply to a remote control plane; "
                    "set --kv-control-plane=grpc://HOST:PORT or drop them"
                )
        self._check_file_contents()

    def _check_file_contents(self) -> None:
        """What the files hold, checked with the control plane's own readers (``kvplane serve``
        refuses the same files): the policy, the token, the TLS material. Imported only when a
        file is given (this module is loaded in every SGLang process)."""
        if self.kv_policy is not None or self.kv_policy_token_file is not None:
            from controlplane.api import InvalidArgument
            from controlplane.policy_store import load_policy_file, load_token_file

            for flag, path, load in (
                ("--kv-policy", self.kv_policy, load_policy_file),
                ("--kv-policy-token-file", self.kv_policy_token_file, load_token_file),
            ):
                try:
                    if path is not None:
                        load(path)
                except InvalidArgument as exc:
                    raise ValueError(f"{flag}: {exc}") from None
        if self.kv_tls_ca is not None or self.kv_tls_cert is not None:
            from controlplane.service.pem_files import (
                check_ca_dates,
                check_key_pair,
            )

            if self.kv_tls_ca is not None:
                check_ca_dates("--kv-tls-ca", self.kv_tls_ca)
            if self.kv_tls_cert is not None and self.kv_tls_key is not None:
                check_key_pair("--kv-tls-cert", self.kv_tls_cert, "--kv-tls-key", self.kv_tls_key)

    @staticmethod
    def _check_profile(path: str) -> None:
        if not Path(path).is_file():
            raise ValueError(f"--kv-profile={path!r}: no such file")
        from sglang_ext.dataplane.profile_schema import DeviceProfile  # pure Python, no torch

        try:
            DeviceProfile.load(path)
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"--kv-profile={path!r} is not a kvplane profile file: {exc}") from None

    @property
    def control_plane_host(self) -> str | None:
        """Host of a ``grpc://`` control plane (brackets stripped), None when embedded."""
        match = _GRPC_TARGET.match(self.kv_control_plane)
        return match.group("host").strip("[]") if match else None

    @property
    def control_plane_port(self) -> int | None:
        """Port of a ``grpc://`` control plane, None when embedded."""
        match = _GRPC_TARGET.match(self.kv_control_plane)
        return int(match.group("port")) if match else None

    @property
    def report_quiet_interval(self) -> int:
        """``kv_report_quiet_interval``, its default resolved (``4 * kv_report_interval``)."""
        quiet = self.kv_report_quiet_interval
        return min(QUIET_REPORT_FACTOR * self.kv_report_interval, MAX_REPORT_INTERVAL) if quiet is None else quiet

    @property
    def pacing(self) -> bool:
        """Whether streamed output is paced."""
        return self.kv_pacing == "on"

    def model_error(self, layers: int) -> str | None:
        """The refusal of these values for a model of ``layers`` layers (known once its config is
        read, at launch), or None: ``--kv-recompute-layers`` past them was clamped silently."""
        rl = self.kv_recompute_layers
        if rl is not None and rl > layers:
            return f"--kv-recompute-layers={rl} is out of range [0, {layers}] (the model's layers)"
        return None

    def to_json(self) -> str:
        """Serialise for :data:`ENV_VAR`."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LayeredKVArgs:
        """Build from a mapping; unknown keys are rejected by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown kvplane option(s) {unknown}; allowed: {sorted(known)}")
        return cls(**dict(data))

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> LayeredKVArgs:
        """Build from a parsed namespace that went through :func:`add_arguments`."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})

    @classmethod
    def from_json(cls, raw: str) -> LayeredKVArgs:
        """Parse :meth:`to_json`'s output; ValueError for bad JSON, a non-object or a bad option."""
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"must hold a JSON object, got {type(data).__name__}")
        return cls.from_mapping(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LayeredKVArgs:
        """:data:`ENV_VAR` through :func:`sglang_ext.settings.read_layered_kv_args`; the defaults
        (flag off) when it is unset."""
        return settings.read_layered_kv_args(environ)


DEFAULTS = LayeredKVArgs()
