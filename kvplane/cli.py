"""The `kvplane` command: a thin dispatcher over subcommands that live with their subsystem.

Each entry names a module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported lazily so that `kvplane plan` never imports torch or SGLang.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("controlplane.cli.plan_cmd", "plan placements for one batch or a list of batches (JSON)"),
    "serve": ("controlplane.cli.serve_cmd", "run the control-plane gRPC service"),
    "policy": ("controlplane.cli.policy_cmd", "get / update / watch a live control plane's policy (gRPC)"),
    "demo": ("kvplane.demo", "the main job: a short demo on an embedded control plane"),
    "sim": ("simulator.cli", "discrete-event serving simulator"),
    "profile": ("sglang_ext.tools.profile_cmd", "measure per-layer compute and H2D/D2H bandwidth (GPU)"),
    "gpu-check": ("sglang_ext.tools.gpu_check", "prove the GPU path: gpu tests + the served core at Llama-3-8B shapes (GPU; --device cpu dry run)"),
}

# `kvplane bench NAME`: name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "planner": ("controlplane.bench.planner_bench", "planner solve time and optimality gap"),
    "service": ("controlplane.bench.service_bench", "control-plane decisions/s and latency"),
    "transfer": ("sglang_ext.tools.transfer_bench", "batched block-first H2D/D2H bandwidth (GPU)"),
    "attention": ("sglang_ext.tools.attention_bench", "layered decode attention vs all-resident (GPU)"),
    "core": ("sglang_ext.tools.core_bench", "the served core's per-step host time vs pool size (CPU)"),
    "sglang": ("sglang_ext.tools.sglang_bench", "SGLang tokens/s with and without --enable-layered-kv"),
    "value": ("sglang_ext.tools.value_bench", "what --enable-layered-kv buys at the same device KV budget (SGLang's bench_serving)"),
    "pacing": ("sglang_ext.tools.pacing_bench", "streamed ITL and TBT-SLO attainment with --kv-pacing on vs off, light and heavy load (SGLang's bench_serving)"),
}


def _add_lazy(sub: argparse._SubParsersAction, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module)
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # an optional extra is not installed
        parser.set_defaults(_import_error=f"{name}: unavailable ({exc}); install the needed extra")
        return
    mod.add_arguments(parser)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplane", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        if name == wanted:
            _add_lazy(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="benchmarks; results state the figure and the machine")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    wanted_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, (module, help_text) in BENCHES.items():
        if name == wanted_bench:
            _add_lazy(bench_sub, name, module, help_text)
        else:
            bench_sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    error = getattr(args, "_import_error", None)
    if error:
        print(error, file=sys.stderr)
        return 2
    mod = importlib.import_module(args._module)
    try:
        return int(mod.run(args) or 0)
    except BrokenPipeError:  # `kvplane ... | head`: the reader left; nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # what a shell reports for a writer SIGPIPE ended: cut short, not a success


if __name__ == "__main__":
    sys.exit(main())
