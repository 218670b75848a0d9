"""`kvplane gpu-check`'s figures, their grading, and the JSON / Markdown report.

A :class:`Figure` is one measured number with its target and a status: ``PASS`` / ``FAIL`` when
the figure is meaningful on this machine, ``N/A`` when it is not (a transfer figure on the CPU,
where copies are synchronous; a backend that is not installed; a figure without a target) --
never ``PASS`` for something that was not measured. :func:`grade` is the one function that
decides; a missing or NaN value on a meaningful figure is a ``FAIL``.
"""

from __future__ import annotations

import json
import math
import re
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_ext.tools.gpu_check_deadline import raise_if_stopped

PASS, FAIL, NA = "PASS", "FAIL", "N/A"
STATUSES = (PASS, FAIL, NA)
OPS = ("<=", ">=")


def grade(value: float | None, op: str | None, threshold: float | None, *, meaningful: bool = True) -> str:
    """``PASS`` when ``value op threshold`` holds, ``FAIL`` when it does not (or the value is
    missing / not finite), ``N/A`` when the figure is not meaningful here or has no target."""
    if not meaningful or op is None or threshold is None:
        return NA
    if op not in OPS:
        raise ValueError(f"grade: op must be one of {OPS}, got {op!r}")
    if value is None or not math.isfinite(value):
        return FAIL
    ok = value <= threshold if op == "<=" else value >= threshold
    return PASS if ok else FAIL


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


@dataclass(frozen=True)
class Figure:
    """One reported figure."""

    key: str
    """Stable identifier (JSON consumers key on it)."""
    title: str
    """What it is, in words."""
    value: float | None
    """The measured value (None: not measured here; see ``note``)."""
    unit: str
    """Unit of ``value`` and ``threshold``."""
    op: str | None
    """``<=`` or ``>=`` (None: reported without a target)."""
    threshold: float | None
    """The target's bound."""
    status: str
    """``PASS``, ``FAIL`` or ``N/A`` (from :func:`grade`)."""
    method: str
    """How it was measured."""
    note: str = ""
    """Why a figure is N/A here, or what qualifies it."""

    @property
    def target(self) -> str:
        """The target as text (``<= 0.05``), or ``none`` when the figure has none."""
        return "none" if self.op is None else f"{self.op} {self.threshold:g}"

    @classmethod
    def graded(cls, key: str, title: str, value: float | None, unit: str, op: str | None,
               threshold: float | None, method: str, *, meaningful: bool = True, note: str = "") -> Figure:
        """A figure whose status :func:`grade` decides."""
        status = grade(value, op, threshold, meaningful=meaningful)
        return cls(key, title, None if value is None else float(value), unit, op, threshold, status, method, note)


def kernels_figure(dma_error: str | None) -> tuple[bool, str]:
    """Whether a figure measured on the Triton copy kernels is graded, and its note's start. The
    served default is the copy engines (``--kv-copy-engine dma``); where they ran here (``dma_error``
    None) the kernels are the fallback, reported beside the ``.dma`` twin that is graded instead."""
    if dma_error is None:
        return False, ("the Triton kernels', the fallback (--kv-copy-engine triton): the served default, the "
                       "copy engines, ran here and its .dma figure is graded; ")
    return True, ""


def guarded_phase(key: str, title: str, method: str, run: Callable[[], list[Figure]]) -> list[Figure]:
    """A phase's figures, or -- where it raises (code running on hardware for the first time) --
    one failed figure ``key`` naming the exception, its traceback on stderr: the phases before
    and after it keep theirs."""
    raise_if_stopped()  # a --deadline-s / SIGTERM stop that a finalizer swallowed: no more phases
    try:
        figures = run()
    except Exception as exc:  # noqa: BLE001 - reported as a failed figure, the check goes on
        traceback.print_exc()
        figures = [Figure.graded(key, title, None, "", "<=", 0.0, method, note=f"{type(exc).__name__}: {exc}")]
    raise_if_stopped()
    return figures


@dataclass
class GpuCheckReport:
    """Everything one run measured, written as ``gpu-check-<machine>.{json,md}``."""

    machine: str
    """GPU name, or ``CPU: <model> (<n> threads)`` for the dry run."""
    device: str
    """``cuda`` or ``cpu``."""
    command: str
    """The command line that produced it."""
    environment: dict[str, Any]
    """Versions (python, torch, triton, flashinfer), the checkout measured."""
    config: dict[str, Any]
    """The shapes (:class:`~sglang_ext.tools.gpu_check_config.GpuCheckConfig`)."""
    tests: dict[str, Any]
    """The ``gpu``-marked tests: counts and the files run (:class:`GpuTestRun`)."""
    figures: list[Figure] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    """Supporting measurements (plan, step times, per-backend errors, sync op names)."""
    elapsed_s: float = 0.0

    @property
    def status(self) -> str:
        """``FAIL`` if a figure failed or a test failed / errored, else ``PASS``."""
        failed_tests = self.tests.get("failed", 0) + self.tests.get("errors", 0)
        return FAIL if failed_tests or any(f.status == FAIL for f in self.figures) else PASS

    def to_dict(self) -> dict[str, Any]:
        return {
            "figure": "kvplane gpu-check: the gpu-marked tests, then the served core (LayeredKVCore) "
                      "with placements from the real planner",
            "machine": self.machine, "device": self.device, "status": self.status,
            "label": "CPU dry run (transfer and timing figures are not meaningful on a CPU)"
                     if self.device == "cpu" else "GPU",
            "command": self.command, "environment": self.environment, "config": self.config,
            "tests": self.tests,
            "figures": [{**asdict(f), "target": f.target} for f in self.figures],
            "details": self.details, "elapsed_s": self.elapsed_s,
        }

    def to_markdown(self) -> str:
        label = "CPU dry run" if self.device == "cpu" else "GPU"
        t = self.tests
        lines = [
            f"# kvplane gpu-check on {self.machine} ({label})", "",
            f"Overall: **{self.status}**. Command: `{self.command}`; {self.elapsed_s:.0f} s.", "",
            "Environment: " + ", ".join(f"{k} {v}" for k, v in self.environment.items()) + ".", "",
            f"Shapes ({self.config['name']}): {self.config['layers']} layers, {self.config['q_heads']} query / "
            f"{self.config['kv_heads']} KV heads x {self.config['head_dim']}, {self.config['dtype']}, page "
            f"{self.config['page_size']}, batch {self.config['requests']}, contexts "
            f"{self.config['context_min']}-{self.config['context_max']}.", "",
            f"## gpu-marked tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
            f"{t.get('skipped', 0)} skipped, {t.get('errors', 0)} errors", "",
            f"`{t.get('command', '')}` ({t.get('elapsed_s', 0.0):.0f} s){': ' + t['note'] if t.get('note') else ''}",
            "", "## Figures", "",
            "| figure | value | target | status | how measured |", "|---|---|---|---|---|",
        ]
        for f in self.figures:
            value = "—" if f.value is None else f"{f.value:.4g} {f.unit}"
            how = f.method + (f" *{f.note}*" if f.note else "")
            target = f"{f.target} {f.unit}" if f.op else f.target
            cells = (_cell(f.title), value, target, f.status, _cell(how))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Details (plan, step times, per-backend errors) are in the JSON next to this file.", ""]
        return "\n".join(lines)

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write ``<out_dir>/gpu-check-<machine slug>.json`` and ``.md``; return both paths."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.machine.lower()).strip("-")[:60]
        base = Path(out_dir) / f"gpu-check-{slug}"
        base.parent.mkdir(parents=True, exist_ok=True)
        json_path, md_path = base.with_suffix(".json"), base.with_suffix(".md")
        json_path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        md_path.write_text(self.to_markdown())
        return json_path, md_path
