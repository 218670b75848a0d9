"""Figures and Markdown of `kvplane bench sglang` (:mod:`sglang_ext.tools.sglang_bench`): paired and
pooled overheads against the baseline, the A/A noise note, the comparisons table, the report."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

OVERHEAD_TARGET_PCT = 5.0
BASELINE = "vanilla"
"""Every overhead figure is against this configuration unless it names another."""
COMPARISONS: tuple[tuple[str, str, str, str], ...] = (
    ("layered", "vanilla", "overhead", "kvplane's whole cost: layered (nothing offloaded) vs stock vanilla (overlap scheduler on)"),
    ("vanilla-no-overlap", "vanilla", "no_overlap", "forcing the overlap scheduler off (what --enable-layered-kv implies): vanilla-no-overlap vs vanilla"),
    ("layered", "vanilla-no-overlap", "plugin", "the plugin on the same scheduler loop: layered vs vanilla-no-overlap"),
    ("layered-offload", "vanilla", "offload", "forced offloading and pauses: layered-offload vs stock vanilla"),
    ("vanilla-b", "vanilla", "aa_noise", "A/A launch noise: vanilla-b (a second vanilla launch) vs vanilla"),
    ("layered-overlap", "vanilla", "overlap", "kvplane with SGLang's overlap loop kept (--kv-overlap-schedule on): layered-overlap vs stock vanilla"),
)
"""(configuration, against, key, what it measures) of every reported loss: the whole cost of
kvplane (``overhead``, held to the target) is the overlap scheduler forced off (``no_overlap``)
plus the plugin itself (``plugin``)."""


@dataclass(frozen=True)
class ConfigResult:
    """One server configuration's throughput."""

    name: str
    """vanilla, vanilla-b, vanilla-no-overlap, layered or layered-offload."""
    flags: tuple[str, ...]
    """Extra launch flags after the CPU recipe."""
    startup_s: float
    """Launch to healthy (median over the launches)."""
    tokens_per_s: tuple[float, ...]
    """Output tokens / wall s of each measured workload run."""
    median_tokens_per_s: float
    """Median of ``tokens_per_s``."""
    tokens_per_cpu_s: tuple[float, ...]
    """Output tokens / CPU seconds used by the server's processes (launcher, tokenizer, scheduler,
    detokenizer) during each measured run -- less sensitive to other jobs than wall time."""
    median_tokens_per_cpu_s: float
    """Median of ``tokens_per_cpu_s``."""
    output_tokens: int
    """Output tokens of one workload run."""
    failed_requests: int
    """Requests that did not complete, over all runs."""
    load_avg_1m: tuple[float, float]
    """Lowest and highest 1-minute load average seen at the start of a measured run."""
    steps: int
    """Scheduler steps in the per-step stats (layered configs; 0 otherwise)."""
    peak_host_fraction: float | None
    """Peak fraction of live layer-KV on host (layered configs)."""
    pauses: int
    """Pause events (layered configs)."""
    kvplane_share_pct: tuple[float, ...] = ()
    """Per launch (layered configs): kvplane's own time in the scheduler process over the step
    time without it (:mod:`sglang_ext.overhead`), over all of that launch's steps."""
    kvplane_ms_per_step: tuple[float, ...] = ()
    """Per launch (layered configs): kvplane's own ms per scheduler step."""
    kvplane_parts_ms_per_step: tuple[dict[str, float], ...] = ()
    """Per launch (layered configs): that figure split by the meter's parts (boundary,
    after_schedule, run_batch -- the step's timing brackets --, attention_prepare, layers,
    kv_write -- the layers' KV copies, which vanilla SGLang makes too --, radix, release, end_step)."""
    kvplane_counts: tuple[dict[str, int], ...] = ()
    """Per launch (layered configs): the meter's event counts (steady-decode vs general
    preparation)."""
    overlap_schedule: bool | None = None
    """Whether the servers ran SGLang's overlap scheduler, as each launch reported it
    (``disable_overlap_schedule`` in ``/server_info``); None when a launch did not say or the
    launches disagreed."""

    @property
    def share_beyond_kv_copy_pct(self) -> tuple[float, ...]:
        """Per launch: :attr:`kvplane_share_pct` without the ``kv_write`` part (the layers' KV
        copies, which vanilla SGLang's own pool makes too): an estimate of what kvplane adds
        beyond that copy, scaled by the part's share of kvplane's ms per step."""
        out = []
        for share, ms, parts in zip(self.kvplane_share_pct, self.kvplane_ms_per_step,
                                    self.kvplane_parts_ms_per_step, strict=False):
            copy = float(parts.get("kv_write", 0.0))
            out.append(round(share * (ms - copy) / ms, 3) if ms > 0 else 0.0)
        return tuple(out)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# kvplane bench sglang — {payload['device']}",
        "",
        f"Date: {payload['date']}. Model: {payload['model']}. Workload: {payload['workload']} "
        f"(warm-up + {payload['repeat']} measured runs per server launch, {payload.get('instances', 1)} "
        "launch(es) per server, median of all runs).",
        f"CPU recipe: `{' '.join(payload['cpu_args'])}`{_env_text(payload)}. Host: {payload['cpus']} CPUs, shared "
        "machine (load average recorded per configuration). Layered servers run the policy "
        f"`{json.dumps(payload['layered_policy'])}` (no SLO-driven pauses; memory-driven ones "
        "remain) and `--kv-pacing`'s default (off since issue 17; the throughput workload does not "
        "stream). Only `layered-offload` "
        "writes the per-step stats file (`$KVPLANE_STATS_FILE`, for peak host KV and pauses); "
        "`layered` runs without it, as deployed.",
        "",
        f"Baseline {payload['baseline']} The overlap scheduler column is what each server "
        "reported (`/server_info`), not what was asked for.",
        "",
        "| config | flags | overlap scheduler | tokens/s (median) | runs | tokens/CPU-s (median) | runs | failed | load avg 1m min/max | peak host KV | pauses |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["results"]:
        host = "-" if r["peak_host_fraction"] is None else f"{r['peak_host_fraction']:.0%}"
        overlap = {True: "on", False: "off", None: "?"}[r.get("overlap_schedule")]
        lines.append(
            f"| {r['name']} | `{' '.join(r['flags'])}` | {overlap} | {r['median_tokens_per_s']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in r['tokens_per_s'])} | "
            f"{r['median_tokens_per_cpu_s']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in r['tokens_per_cpu_s'])} | {r['failed_requests']} | "
            f"{r['load_avg_1m'][0]:.1f} / {r['load_avg_1m'][1]:.1f} | {host} | {r['pauses']} |"
        )
    lines += [
        "",
        "Throughput loss (positive = slower than the configuration it is against). Paired: each "
        "server launch's median run against the same launch's median run of the other "
        "configuration (interleaved rounds), median over launches -- it cancels "
        "launch-to-launch differences, which the pooled medians do not. Read every figure "
        "against the A/A noise.",
        "",
    ]
    for c in payload.get("comparisons", []):
        target = (
            f"; target <= {payload['overhead_target_pct']:g}%" if c["key"] == "overhead" else ""
        )
        per_launch = ", ".join(_pct(x) for x in c["paired_per_launch_pct"]) or "-"
        ms = "-" if c["extra_ms_per_token"] is None else f"{c['extra_ms_per_token']:+.3f} ms"
        lines.append(
            f"- {c['what']}: **{_pct(c['paired_pct'])}** paired (per launch "
            f"{per_launch}{target}); pooled medians {_pct(c['wall_pct'])} wall tokens/s, "
            f"{_pct(c['cpu_pct'])} tokens per server CPU-s; {ms} of wall time per output token."
        )
    for r in payload["results"]:
        if r.get("kvplane_share_pct"):
            lines.append(
                f"- {r['name']}: kvplane's own time in the scheduler process (in-process meter, "
                f"launch effects cancel): **{statistics.median(r['kvplane_share_pct']):+.2f}%** of the "
                f"step (median of launches; per launch {', '.join(f'{x:.2f}%' for x in r['kvplane_share_pct'])}), "
                f"{statistics.median(r['kvplane_ms_per_step']):.3f} ms per step."
            )
            beyond = r.get("share_beyond_kv_copy_pct")
            if beyond:
                lines.append(f"  - without the layers' KV copies (`kv_write`, made by vanilla SGLang's pool too): "
                             f"**{statistics.median(beyond):+.2f}%** (per launch {', '.join(f'{x:.2f}%' for x in beyond)})")
            counts = list(r.get("kvplane_counts") or ())
            for i, parts in enumerate(r.get("kvplane_parts_ms_per_step") or ()):
                split = ", ".join(f"{k} {v:.3f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
                events = ", ".join(f"{k} {v}" for k, v in (counts[i] if i < len(counts) else {}).items())
                lines.append(f"  - launch {i}, ms per step by part: {split}" + (f" (steps: {events})" if events else ""))
    for note in payload.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def extra_ms_per_token(by: dict[str, ConfigResult], base: str = BASELINE) -> dict[str, float]:
    """Wall ms per output token each configuration adds over ``base`` (medians)."""
    if base not in by or by[base].median_tokens_per_s <= 0:
        return {}
    base_ms = 1000.0 / by[base].median_tokens_per_s
    return {
        name: round(1000.0 / r.median_tokens_per_s - base_ms, 3)
        for name, r in by.items()
        if name != base and r.median_tokens_per_s > 0
    }


def paired_overhead(
    by: dict[str, ConfigResult], name: str, repeat: int, base: str = BASELINE
) -> tuple[float | None, list[float]]:
    """Throughput loss of ``name`` vs ``base`` per server launch (median run of each, same
    launch, interleaved rounds), and the median over launches. Two launches of one server
    differ by up to 25% on a small shared host, more than the effect measured; pairing each
    launch's runs cancels that, which the pooled medians do not."""
    if base not in by or name not in by or repeat < 1:
        return None, []
    base_rates, other = by[base].tokens_per_s, by[name].tokens_per_s
    per_launch = []
    for start in range(0, min(len(base_rates), len(other)), repeat):
        b = statistics.median(base_rates[start : start + repeat])
        o = statistics.median(other[start : start + repeat])
        if b > 0:
            per_launch.append(round(100.0 * (1 - o / b), 2))
    return (round(statistics.median(per_launch), 2) if per_launch else None), per_launch


def pooled_overhead(
    by: dict[str, ConfigResult], name: str, base: str, field: str = "median_tokens_per_s"
) -> float | None:
    """Throughput loss of ``name`` vs ``base`` from the pooled medians of ``field``."""
    if base not in by or name not in by or getattr(by[base], field) <= 0:
        return None
    return round(100.0 * (1 - getattr(by[name], field) / getattr(by[base], field)), 2)


def aa_noise_note(measured: list[dict[str, Any]]) -> str | None:
    """How far apart two launches of the same server were (the A/A comparison), as a sentence:
    a paired figure within that spread does not tell the configurations apart."""
    aa = next((c for c in measured if c["key"] == "aa_noise"), None)
    if aa is None or not aa["paired_per_launch_pct"]:
        return None
    spread = max(abs(x) for x in aa["paired_per_launch_pct"])
    return (
        f"A/A noise: two launches of stock vanilla differed by up to {spread:.1f}% per launch "
        f"(paired); a paired figure within +/-{spread:.1f}% does not distinguish the "
        "configurations on this run."
    )


def comparisons(by: dict[str, ConfigResult], repeat: int) -> list[dict[str, Any]]:
    """Every :data:`COMPARISONS` entry whose two configurations were measured."""
    out = []
    for name, base, key, what in COMPARISONS:
        if name not in by or base not in by:
            continue
        paired_pct, per_launch = paired_overhead(by, name, repeat, base)
        out.append(
            {
                "key": key,
                "config": name,
                "against": base,
                "what": what,
                "paired_pct": paired_pct,
                "paired_per_launch_pct": per_launch,
                "wall_pct": pooled_overhead(by, name, base),
                "cpu_pct": pooled_overhead(by, name, base, "median_tokens_per_cpu_s"),
                "extra_ms_per_token": extra_ms_per_token(by, base).get(name),
            }
        )
    return out


def find_key(tree: Any, key: str) -> Any:
    """The first non-None value of ``key`` anywhere in nested dicts and lists (None when absent)."""
    if isinstance(tree, dict):
        if key in tree and tree[key] is not None:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


def overlap_schedule_of(server_info: dict[str, Any]) -> bool | None:
    """Whether a server runs SGLang's overlap scheduler, from its ``/server_info`` (the resolved
    server args: ``disable_overlap_schedule`` after every flag and plugin has had its say)."""
    disabled = find_key(server_info, "disable_overlap_schedule")
    return None if not isinstance(disabled, bool) else not disabled


def _env_text(payload: dict[str, Any]) -> str:
    """The servers' CPU-recipe environment (``cpu_env``, absent from older results)."""
    env = payload.get("cpu_env") or {}
    return f" with `{' '.join(f'{k}={v}' for k, v in env.items())}`" if env else ""
