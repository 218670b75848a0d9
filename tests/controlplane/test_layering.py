"""The layering rule: the control plane decides and never imports the data plane or torch."""

import subprocess
import sys

MODULES = [
    "controlplane.model",
    "controlplane.planner",
    "controlplane.controller",
    "controlplane.embedded",
    "controlplane.service.server",
    "controlplane.service.client",
    "controlplane.cli.plan_cmd",
    "controlplane.cli.serve_cmd",
]
FORBIDDEN = ("torch", "sglang", "sglang_ext", "kernels", "simulator", "triton")


def test_control_plane_imports_no_torch_or_sglang():
    """Importing every control-plane entry point loads none of torch, SGLang or the data plane."""
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"control plane pulled in: {out.stdout.strip()}"


def test_kvplane_plan_command_stays_light():
    """`kvplane plan` resolves without importing torch (the CLI dispatcher imports lazily)."""
    code = (
        "import sys\n"
        "from kvplane.cli import build_parser\n"
        "build_parser(['plan', '--batch', 'x'])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
