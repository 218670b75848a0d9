"""`kvplane gpu-check`: one command that proves kvplane's GPU path on a GPU host (issue 14, item 6).

1. Every ``gpu``-marked test of the repository (:class:`GpuTestRun`: pass / fail / skip counts).
2. The served core (``LayeredKVCore``, SGLang-free) at Llama-3-8B shapes with placements from the
   real planner (:class:`CoreCheck`): layered attention vs a dense reference; step time
   all-resident vs half-offloaded; measured stall vs the placement model; batched block-first H2D
   vs one contiguous pinned copy; H2D + D2H together vs one direction; host syncs per step inside
   layers; kvplane's CPU time per step as a share of the all-resident step (the worse of that
   step and the hidden placement's, :mod:`.gpu_check_host_note`) -- each with its
   target and PASS / FAIL / N/A (:mod:`.gpu_check_report`).
3. Batch changes (a request finishes, one joins) on the core check's batch: the next decode
   step's boundary continued vs through the general path it took before, then the step after one
   more change checked against the dense reference over the KV each request holds
   (:class:`~sglang_ext.tools.gpu_check_turnover.TurnoverCheck`).
4. The paged-extend (prefill) kernel the paged backends serve extends with, vs its reference and
   vs the torch-native loop it replaced (:class:`~sglang_ext.tools.gpu_check_extend.ExtendCheck`).
5. JSON and Markdown under ``benchmarks/results/gpu/gpu-check-<machine>.{json,md}``.

It never imports SGLang (the GPU host has torch, Triton and nvcc; FlashInfer's wheel may be
brought, SGLang's may not). ``--device cpu`` is the dry run: the same code at the ``small``
shapes on one intra-op thread, labelled CPU, transfer and timing figures N/A. Exit status: 0 when nothing failed,
1 when a test or a figure failed, 2 without CUDA unless ``--device cpu``. ``--deadline-s`` (or SIGTERM)
stops it early with the report written (:mod:`.gpu_check_deadline`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from typing import Any

import torch

from sglang_ext.dataplane.bench_env import NO_GPU_EXIT, describe_device, resolve_device
from sglang_ext.tools.gpu_check_config import PRESETS, GpuCheckConfig
from sglang_ext.tools.gpu_check_deadline import (
    GpuCheckDeadline,
    deadline,
    raise_if_stopped,
    stop_deferred,
)
from sglang_ext.tools.gpu_check_extend import ExtendCheck
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_report import Figure, GpuCheckReport, guarded_phase
from sglang_ext.tools.gpu_check_tests import REPO_ROOT, GpuTestRun
from sglang_ext.tools.gpu_check_turnover import TurnoverCheck

RESULTS_DIR = "benchmarks/results/gpu"
CORE_STAGE = "the served-core measurements (CoreCheck)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="auto = cuda if available, else refuse (exit 2); cpu = the dry run (labelled CPU)")
    parser.add_argument("--shapes", default="auto", choices=("auto", *PRESETS),
                        help="auto = llama3-8b on CUDA, small on the CPU")
    parser.add_argument("--attention", default="auto", choices=("auto", "flashinfer", "triton", "torch"),
                        help="the timed steps' attention (auto: flashinfer if importable, else triton; "
                        "torch on the CPU); the accuracy check runs every available one")
    for name, help_text in (("layers", "override the preset's layers"), ("requests", "override the batch size"),
                            ("context-min", "override the shortest context"),
                            ("context-max", "override the longest context"),
                            ("repeat", "timed steps per figure (median)")):
        parser.add_argument(f"--{name}", type=int, default=None, help=help_text)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked tests")
    parser.add_argument("--tests-timeout", type=float, default=360.0, help="seconds for the gpu-marked tests")
    parser.add_argument("--out-dir", default=RESULTS_DIR, help="where the JSON and Markdown go")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="stop after this many seconds and write what was measured (the report names "
                             "the phase it stopped in; SIGTERM does the same): set it under the GPU host's "
                             "command limit")


def config_from_args(args: argparse.Namespace, device: str) -> GpuCheckConfig:
    limit = getattr(args, "deadline_s", None)
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise SystemExit(f"kvplane gpu-check: --deadline-s: {limit} is out of range (allowed > 0)")
    shapes = args.shapes if args.shapes != "auto" else ("small" if device == "cpu" else "llama3-8b")
    try:
        return PRESETS[shapes].with_overrides(layers=args.layers, requests=args.requests,
                                              context_min=args.context_min, context_max=args.context_max,
                                              repeat=args.repeat, seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"kvplane gpu-check: {exc}") from None


def environment() -> dict[str, Any]:
    """Versions of what the check ran on, and the checkout measured."""
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # a copied working tree (a GPU host's) may carry an older .git: tracked files that differ
    # from HEAD are then said, so the head is not taken for the code that ran
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
            "triton": version("triton"), "flashinfer": version("flashinfer-python"), "mip": version("mip"),
            "kvplane_head": git("rev-parse", "--short", "HEAD") or "unknown",
            "kvplane_tree": "unknown" if status is None else ("modified" if status else "clean")}


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device, "gpu-check")
    if device is None:
        return NO_GPU_EXIT
    config = config_from_args(args, device)
    threads = torch.get_num_threads()
    if device == "cpu":  # one intra-op thread: on a loaded small host more threads spin, not work
        torch.set_num_threads(1)
    try:
        return _run(args, device, config)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, device: str, config: GpuCheckConfig) -> int:
    machine = describe_device(device)
    t0 = time.perf_counter()
    print(f"kvplane gpu-check on {machine} ({'GPU' if device == 'cuda' else 'CPU dry run'}; shapes {config.name})")
    tests: dict[str, Any] = {"command": "", "files": [], "passed": 0, "failed": 0, "skipped": 0, "errors": 0,
                             "elapsed_s": 0.0, "failures": [], "excluded": [], "note": "not run (--skip-tests)"}
    built: list[CoreCheck] = []
    figures: list[Figure] = []
    details: dict[str, Any] = {}
    stage = ["start-up"]
    with deadline(args.deadline_s):
        stopped = None
        try:
            if not args.skip_tests:
                stage[0] = "the gpu-marked tests"
                tests = GpuTestRun(timeout_s=args.tests_timeout).run().to_dict()
                if device == "cpu":
                    tests["note"] = "; ".join(x for x in ("no CUDA here: every gpu test skips", tests["note"]) if x)
            print(f"  gpu-marked tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} "
                  f"skipped, {tests['errors']} errors ({tests['elapsed_s']:.0f} s)", flush=True)
            _phases(args, device, config, built, figures, details, stage)
            raise_if_stopped()  # one a finalizer swallowed after the last phase
        except GpuCheckDeadline as stop:  # write what was measured: the phases done, the details so far
            stopped = stop.why
        with stop_deferred(drop=True):  # a second stop must not cut the report's writing short
            if stopped is not None:
                _stopped(device, built, figures, details, stage[0], stopped, time.perf_counter() - t0)
            report = GpuCheckReport(
                machine=machine, device=device, command="kvplane " + shlex.join(sys.argv[1:] or ["gpu-check"]),
                environment=environment(), config={**vars(config), "contexts": list(config.contexts)},
                tests=tests, figures=figures, details=details, elapsed_s=time.perf_counter() - t0,
            )
            json_path, md_path = report.write(args.out_dir)
    try:  # after the write: a pipe closed under a stop (the host's `timeout`) costs the lines only
        for f in figures:
            value = "—" if f.value is None else f"{f.value:.4g} {f.unit}"
            print(f"  {f.status:>4}  {f.title}: {value} (target {f.target})" + (f" [{f.note}]" if f.note else ""))
        print(f"  overall {report.status} in {report.elapsed_s:.0f} s; results: {json_path} and {md_path}")
    except BrokenPipeError:  # nothing more reaches that pipe, not even at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if report.status == "PASS" else 1


def _phases(args: argparse.Namespace, device: str, config: GpuCheckConfig, built: list[CoreCheck],
            figures: list[Figure], details: dict[str, Any], stage: list[str]) -> None:
    """The measured phases, each guarded (one that raises keeps the others' figures); ``figures``
    and ``details`` grow as each finishes and ``stage`` names the one running (for a stop)."""
    measured: list[bool] = []

    def core() -> list[Figure]:
        built.append(CoreCheck(config, device, args.attention))
        core_figures = built[0].run()
        with stop_deferred():  # its figures and details land together (a stop before: _stopped)
            figures.extend(core_figures)
            details.update(built[0].details)
            built[0].base, built[0].done = None, []  # handed over: a later stop adds none of them again
            measured.append(True)
        return []

    stage[0] = CORE_STAGE
    # a failure keeps what the check measured before it (its details so far)
    figures += guarded_phase("core_check", "served-core measurements", "CoreCheck.run", core)
    if built and not measured:
        details.update(built[0].details)
    if measured:  # last on the core check's batch (it finishes and admits requests), when that ran through
        stage[0] = "the batch changes (TurnoverCheck)"
        turnover = TurnoverCheck(built[0])
        figures += guarded_phase("turnover_check", "batch changes", "TurnoverCheck.run", turnover.run)
        details["turnover"] = turnover.details
    stage[0] = "the paged extend kernel (ExtendCheck)"
    extend = ExtendCheck(config, device)
    figures += guarded_phase("extend_check", "paged extend (prefill) kernel", "ExtendCheck.run", extend.run)
    details["extend"] = extend.details


def _stopped(device: str, built: list[CoreCheck], figures: list[Figure], details: dict[str, Any], stage: str,
             why: str, after_s: float) -> None:
    """A stop (``--deadline-s``, SIGTERM) in ``stage``: the copies in flight drained, what the core
    check finished if it stopped there, and the failed ``deadline`` figure naming the stage."""
    _settle(device)
    if built:  # stopped inside the core check: what it finished (nothing once it handed them over)
        figures += _core_so_far(built[0])
        details.update(built[0].details)
    note = f"{why} after {after_s:.0f} s, in {stage}; the phases after it did not run"
    details["stopped"] = {"why": why, "stage": stage, "after_s": after_s}
    figures.append(Figure.graded("deadline", "the check ran to its end", None, "", "<=", 0.0,
                                 "--deadline-s (SIGALRM) or SIGTERM: the report holds what finished before",
                                 note=note))


def _core_so_far(core: CoreCheck) -> list[Figure]:
    """The figures of a core check stopped inside :meth:`CoreCheck.run`: its base measurements'
    once they were in, then each phase it finished."""
    base, done = core.base, list(core.done)
    core.base = None
    if base is None:
        return done
    return guarded_phase("core_check_so_far", "served-core measurements so far", "CoreCheck.base", base) + done


def _settle(device: str) -> None:
    """After a stop mid-step: let the copies in flight finish before anything is freed (the host
    pool's pinned registration is dropped at exit, under a copy still reading it otherwise). One
    device-wide sync: it waits for every stream, the engines' transfer streams included."""
    if device != "cuda":
        return
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a device error: the report is still written
        traceback.print_exc()
