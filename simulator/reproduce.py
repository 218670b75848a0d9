"""``kvplane sim reproduce NAME``: run an experiment, write its table, plot and shape checks.

Outputs under ``OUT/NAME/``: ``results.json`` (every run's metrics), ``table.md`` (the paper's
number beside ours, the expected-shape checks) and ``NAME.png`` (matplotlib, Agg backend).
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulator.experiments import EXPERIMENTS, OF_BASELINES
from simulator.runner import run_many

Row = dict[str, Any]


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _num(x: float | None, nd: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _table(rows: list[Row], cols: list[tuple[str, str, Callable[[Any], str]]]) -> str:
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "|" + "---|" * len(cols)
    body = ["| " + " | ".join(fmt(r.get(key)) for key, _, fmt in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


STD_COLS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("policy", "policy", str),
    ("tbt_attainment", "TBT att.", _pct),
    ("tpot_attainment", "TPOT att.", _pct),
    ("ttft_attainment", "TTFT att.", _pct),
    ("tbt_p99_ms", "P99 TBT ms", _num),
    ("ttft_p99_ms", "P99 TTFT ms", lambda x: _num(x, 0)),
    ("throughput_req_per_min", "req/min", lambda x: _num(x, 2)),
    ("kv_util_mean", "KV util", _pct),
    ("pauses", "pauses", str),
    ("forced_fallbacks", "forced", str),
]


# ---- shape checks -------------------------------------------------------------------------------
def _fig8a_checks(rows: list[Row]) -> list[str]:
    out = []
    for scale in sorted({r["slo_scale"] for r in rows}):
        for rate in sorted({r["rate_per_min"] for r in rows}):
            sel = {r["policy"]: r for r in rows if r["slo_scale"] == scale and
                   r["rate_per_min"] == rate}
            if "orbitflow" not in sel:
                continue
            of = sel["orbitflow"]
            base = [sel[p] for p in OF_BASELINES if p in sel]
            if not base:
                continue
            best = max(base, key=lambda r: r["tbt_attainment"])
            gap = 100 * (of["tbt_attainment"] - best["tbt_attainment"])
            ds = sel.get("deepspeed")
            thr = (of["throughput_req_per_min"] / ds["throughput_req_per_min"]
                   if ds and ds["throughput_req_per_min"] > 0 else math.nan)
            if scale == 1.5:
                out.append(
                    f"- scale {scale}, rate {rate}/min: orbitflow TBT {_pct(of['tbt_attainment'])}"
                    f" vs best baseline {best['policy']} {_pct(best['tbt_attainment'])} -> "
                    f"{gap:+.1f} points ({'PASS' if gap >= 10 else 'FAIL'} >= +10); throughput "
                    f"{thr:.2f}x deepspeed ({'PASS' if thr >= 2 else 'FAIL'} >= 2x)")
    return out


def _fig14a_checks(rows: list[Row]) -> list[str]:
    order = ["batch-uniform", "request-wise", "request-wise+pause", "orbitflow"]
    out = []
    for scale in sorted({r["slo_scale"] for r in rows}):
        sel = {r["policy"]: r["tbt_attainment"] for r in rows if r["slo_scale"] == scale}
        vals = [sel.get(p) for p in order]
        if None in vals:
            continue
        rising = all(b > a for a, b in zip(vals, vals[1:], strict=False))
        out.append(f"- scale {scale}: " + " -> ".join(_pct(v) for v in vals)
                   + f" ({'PASS' if rising else 'FAIL'}: rises at each step)")
    return out


def _kvplane_checks(rows: list[Row]) -> list[str]:
    out = []
    for rate in sorted({r["rate_per_min"] for r in rows}):
        sel = {r["policy"]: r for r in rows if r["rate_per_min"] == rate}
        if "kvplane" not in sel or "orbitflow" not in sel:
            continue
        k, o = sel["kvplane"], sel["orbitflow"]
        ratio = o["ttft_p99_ms"] / k["ttft_p99_ms"] if k["ttft_p99_ms"] else math.nan
        dtbt = 100 * (k["tbt_attainment"] - o["tbt_attainment"])
        ok = ratio >= 2 and abs(dtbt) <= 2
        out.append(f"- rate {rate}/min: P99 TTFT orbitflow {o['ttft_p99_ms']:.0f} ms / kvplane "
                   f"{k['ttft_p99_ms']:.0f} ms = {ratio:.2f}x; TBT {dtbt:+.1f} points "
                   f"({'PASS' if ok else 'FAIL'}: >= 2x at +-2 points)")
    return out


def _ratio_checks(rows: list[Row], key: str, a: str, b: str, metric: str) -> list[str]:
    out = []
    for x in sorted({r[key] for r in rows}):
        sel = {r["policy"]: r for r in rows if r[key] == x}
        if a in sel and b in sel and sel[a][metric]:
            out.append(f"- {key} {x}: {metric} {b} {sel[b][metric]:.4g} vs {a} "
                       f"{sel[a][metric]:.4g} -> {sel[b][metric] / sel[a][metric]:.2f}x")
    return out


# ---- plots ------------------------------------------------------------------------------------
def _plot(name: str, rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def lines(ax, sel, x, y, title, ylabel):  # noqa: ANN001
        by = defaultdict(list)
        for r in sel:
            label = r["policy"] + (f" [{r['workload']}]" if "workload" in r else "")
            by[label].append((r[x], r[y]))
        for pol, pts in sorted(by.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)

    if name == "orbitflow-fig8a":
        scales = sorted({r["slo_scale"] for r in rows})
        fig, axes = plt.subplots(2, len(scales), figsize=(4 * len(scales), 7), squeeze=False)
        for j, s in enumerate(scales):
            sel = [r for r in rows if r["slo_scale"] == s]
            lines(axes[0][j], sel, "rate_per_min", "tbt_attainment", f"TBT, SLO x{s}", "att.")
            lines(axes[1][j], sel, "rate_per_min", "tpot_attainment", f"TPOT, SLO x{s}", "att.")
        axes[0][0].legend(fontsize=7)
    elif name in ("orbitflow-fig14a", "orbitflow-fig14c", "kvplane-combined",
                  "orbitflow-table1"):
        key = {"orbitflow-fig14a": "slo_scale", "orbitflow-fig14c": "slo_scale",
               "kvplane-combined": "rate_per_min", "orbitflow-table1": "workload"}[name]
        metric = {"orbitflow-table1": "solver_calls_per_request"}.get(name, "tbt_attainment")
        groups = sorted({str(r[key]) for r in rows})
        pols = list(dict.fromkeys(r["policy"] for r in rows))
        ncols = 2 if name == "kvplane-combined" else 1
        fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4), squeeze=False)
        width = 0.8 / max(1, len(pols))
        metrics = [metric] + (["ttft_p99_ms"] if name == "kvplane-combined" else [])
        for ax, met in zip(axes[0], metrics, strict=False):
            for i, pol in enumerate(pols):
                vals = [next((r[met] for r in rows if r["policy"] == pol and str(r[key]) == g),
                             0) or 0 for g in groups]
                ax.bar([g + i * width for g in range(len(groups))], vals, width, label=pol)
            ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
            ax.set_xlabel(key)
            ax.set_ylabel(met)
            ax.grid(alpha=0.3, axis="y")
        axes[0][0].legend(fontsize=7)
    elif name == "layerkv-ttft":
        fig, axes = plt.subplots(1, 3, figsize=(13, 4), squeeze=False)
        lines(axes[0][0], rows, "rate_per_s", "ttft_mean_ms", "mean TTFT", "ms")
        lines(axes[0][1], rows, "rate_per_s", "ttft_p99_ms", "P99 TTFT", "ms")
        lines(axes[0][2], rows, "rate_per_s", "throughput_req_per_min", "throughput", "req/min")
        axes[0][0].legend(fontsize=7)
    else:  # superinfer-attainment
        fig, axes = plt.subplots(1, 2, figsize=(9, 4), squeeze=False)
        lines(axes[0][0], rows, "rate_per_s", "ttft_attainment", "TTFT attainment", "att.")
        lines(axes[0][1], rows, "rate_per_s", "tbt_attainment", "TBT attainment", "att.")
        axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{name} (simulated)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------
def reproduce(name: str, out_dir: Path, *, smoke: bool = False, jobs: int = 1,
              progress: Callable[[int, int, Row], None] | None = None) -> Path:
    """Run experiment ``name``; returns the markdown table's path."""
    if name not in EXPERIMENTS:
        raise ValueError(f"experiment: {name!r} is not one of {sorted(EXPERIMENTS)}")
    exp = EXPERIMENTS[name]
    specs = exp.build(smoke)
    t0 = time.perf_counter()
    rows = run_many(specs, jobs=jobs, progress=progress)
    wall = time.perf_counter() - t0
    d = out_dir / name
    d.mkdir(parents=True, exist_ok=True)
    meta = {"experiment": name, "smoke": smoke, "runs": len(rows), "wall_s": round(wall, 1),
            "jobs": jobs, "cpu": _cpu(), "solver_time": sorted({s.solver_time for s in specs})}
    (d / "results.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    _plot(name, rows, d / f"{name}.png")
    group_keys = [k for k in ("slo_scale", "rate_per_min", "rate_per_s", "workload")
                  if any(k in r for r in rows)]
    cols = [(k, k, str) for k in group_keys] + STD_COLS
    if name == "orbitflow-table1":
        cols = [("workload", "workload", str),
                ("solver_calls_per_request", "calls/req", lambda x: _num(x, 2)),
                ("solver_time_share", "E2E %", lambda x: _num(100 * x, 2)),
                ("solver_step_share", "TBT %", lambda x: _num(100 * x, 2)),
                ("solver_charged_ms", "charged ms", lambda x: _num(x, 1)),
                ("tbt_attainment", "TBT att.", _pct)]
    checks: list[str] = {
        "orbitflow-fig8a": _fig8a_checks,
        "orbitflow-fig14a": _fig14a_checks,
        "kvplane-combined": _kvplane_checks,
    }.get(name, lambda rows: [])(rows)
    if name == "layerkv-ttft":
        checks = (_ratio_checks(rows, "rate_per_s", "layerkv", "no-offload", "ttft_mean_ms")
                  + _ratio_checks(rows, "rate_per_s", "layerkv", "no-offload", "ttft_p99_ms")
                  + _ratio_checks(rows, "rate_per_s", "no-offload", "layerkv",
                                  "throughput_req_per_min"))
    if name == "superinfer-attainment":
        checks = [f"- {r['workload']} rate {r['rate_per_s']}/s {r['policy']}: TTFT att. "
                  f"{_pct(r['ttft_attainment'])}, TBT att. {_pct(r['tbt_attainment'])}, "
                  f"preemptions {r['preemptions']}, KV util {_pct(r['kv_util_mean'])}"
                  for r in rows]
    md = [f"# {name}: {exp.title}", "",
          f"**Paper:** {exp.paper}", "",
          f"![{name}]({name}.png)", "",
          _table(rows, cols), "",
          "## Shape checks", "", *(checks or ["- (no automatic check for this figure)"]), "",
          f"_Simulated; {len(rows)} runs in {wall:.1f} s wall on {meta['cpu']} with {jobs} "
          f"process(es); solver time mode {meta['solver_time']}; smoke={smoke}._", ""]
    path = d / "table.md"
    path.write_text("\n".join(md))
    return path


def reproduce_all(out_dir: Path, *, smoke: bool = False, jobs: int = 1,
                  progress: Callable[[int, int, Row], None] | None = None) -> list[Path]:
    return [reproduce(n, out_dir, smoke=smoke, jobs=jobs, progress=progress)
            for n in EXPERIMENTS]
