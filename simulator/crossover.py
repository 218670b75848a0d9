"""``kvplane sim reproduce recompute-vs-fetch``: where recomputing an uncached prefix is cheaper
than fetching its KV (issue 16; eLLM §4.3.1).

In the placement model (``docs/recompute.md``) a request's uncached prefix of ``u`` tokens is,
in each layer, either **recomputed** (a prefill of ``u`` tokens through that layer joins the
layer's compute) or **fetched** (their KV, ``u * kv_bytes_per_token_layer`` bytes, comes over the
H2D link). Per layer:

* recompute: ``prefill_ms(u) / L`` of the profile, LayerKV Eq. 3 as :mod:`simulator.profile`
  reads it, ``alpha * u * (2 * n_params / L + 2 * u * hidden) / FLOPS`` (eLLM §4.2.1 Eq. 7 per
  layer has the same two terms, ``24 h^2 u + 4 h u^2``; no logits: recomputed tokens are never
  sampled);
* fetch: ``u * kv_bytes_per_token_layer / h2d``.

Recompute is cheaper when the link is slower than the **crossover bandwidth**
``kv_bytes * FLOPS / (alpha * (2 * n_params / L + 2 * u * hidden))``: a constant for short
prefixes (the GEMM term) that falls once the attention term ``2 u h`` matters (``u`` near
``n_params / (L * h)``, 32-64K tokens for these models). A per-layer cost comparison only: in a
step the fetch may also hide under the layer's decode compute, which moves the crossover further
towards fetch. Compute rates are the presets' (``simulator/presets``); nothing is simulated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from simulator.profile import SimProfile, load_profile, preset_names

TOKENS = tuple(int(round(2 ** (4 + i * 13 / 59))) for i in range(60))
"""Prefix lengths of the heatmaps: 16 .. 128K tokens, log-spaced."""
GBPS = tuple(0.25 * 2 ** (i * 11 / 59) for i in range(60))
"""Link bandwidths of the heatmaps: 0.25 .. 512 GB/s, log-spaced."""
TABLE_TOKENS = (256, 4096, 32768)
HEATMAPS = ("llama2-13b-a100-pcie4", "llama3-8b-a5000-pcie3")
"""One MHA preset (eLLM's testbed) and one GQA preset (OrbitFlow's)."""


def recompute_layer_ms(p: SimProfile, tokens: int) -> float:
    """One layer's recomputation of a ``tokens``-token prefix (LayerKV Eq. 3 per layer)."""
    return p.prefill_ms(tokens) / p.layers


def fetch_layer_ms(p: SimProfile, tokens: int, h2d_gbps: float | None = None) -> float:
    """One layer's H2D fetch of a ``tokens``-token prefix's KV (default: the preset's link)."""
    gbps = p.h2d_gbps if h2d_gbps is None else h2d_gbps
    return tokens * p.kv_bytes_per_token_layer / (gbps * 1e6)


def crossover_gbps(p: SimProfile, tokens: int) -> float:
    """The link bandwidth at which recomputing and fetching ``tokens`` tokens cost the same in a
    layer; on slower links recompute is cheaper."""
    return tokens * p.kv_bytes_per_token_layer / (recompute_layer_ms(p, tokens) * 1e6)


def longest_recompute_win(p: SimProfile, h2d_gbps: float | None = None) -> int:
    """The longest prefix (tokens, 0 if none) recomputed faster than fetched on the link."""
    gbps = p.h2d_gbps if h2d_gbps is None else h2d_gbps
    best = 0
    for tokens in range(16, 1 << 20, 16):
        if crossover_gbps(p, tokens) <= gbps:
            break
        best = tokens
    return best


def rows() -> list[dict]:
    """One row per preset: the per-layer costs and crossover bandwidths."""
    out = []
    for name in preset_names():
        p = load_profile(name)
        out.append({
            "preset": name, "model": p.model,
            "kv_bytes_per_token_layer": p.kv_bytes_per_token_layer,
            "h2d_gbps": p.h2d_gbps,
            "recompute_us_per_token_layer_1k": 1e3 * recompute_layer_ms(p, 1024) / 1024,
            "fetch_us_per_token_layer": 1e3 * fetch_layer_ms(p, 1024) / 1024,
            **{f"crossover_gbps_{t}": crossover_gbps(p, t) for t in TABLE_TOKENS},
            "fetch_advantage_4k": p.h2d_gbps / crossover_gbps(p, 4096),
            "longest_recompute_win_tokens": longest_recompute_win(p),
        })
    return out


def _table(rs: list[dict]) -> list[str]:
    head = ("| preset | KV B/token/layer | link GB/s | recompute us/token/layer (1K) | fetch "
            "us/token/layer | crossover GB/s at " + " / ".join(f"{t}" for t in TABLE_TOKENS)
            + " tokens | link / crossover (4K) | longest prefix recompute wins on its link |")
    lines = [head, "|" + "---|" * 8]
    for r in rs:
        win = r["longest_recompute_win_tokens"]
        lines.append(
            f"| {r['preset']} | {r['kv_bytes_per_token_layer']} | {r['h2d_gbps']:g} | "
            f"{r['recompute_us_per_token_layer_1k']:.2f} | {r['fetch_us_per_token_layer']:.3f} | "
            + " / ".join(f"{r[f'crossover_gbps_{t}']:.2f}" for t in TABLE_TOKENS)
            + f" | {r['fetch_advantage_4k']:.1f}x | {win if win else 'none'} |")
    return lines


def _plot(rs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(HEATMAPS) + 1, figsize=(5.2 * (len(HEATMAPS) + 1), 4.4))
    for ax, name in zip(axes, HEATMAPS, strict=False):
        p = load_profile(name)
        z = [[math.log2(fetch_layer_ms(p, t, g) / recompute_layer_ms(p, t)) for t in TOKENS]
             for g in GBPS]
        mesh = ax.pcolormesh(TOKENS, GBPS, z, cmap="RdBu", vmin=-8, vmax=8, shading="auto")
        ax.contour(TOKENS, GBPS, z, levels=[0.0], colors="k", linewidths=1.5)
        ax.axhline(p.h2d_gbps, color="k", ls="--", lw=1)
        ax.text(TOKENS[1], p.h2d_gbps * 1.1, f"its link {p.h2d_gbps:g} GB/s", fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("uncached prefix u (tokens)")
        ax.set_ylabel("H2D link (GB/s)")
        ax.set_title(f"{name}\nblue: recompute cheaper, red: fetch cheaper", fontsize=8)
        fig.colorbar(mesh, ax=ax, label="log2(fetch / recompute), per layer")
    ax = axes[-1]
    for i, r in enumerate(rs):
        p = load_profile(r["preset"])
        color = f"C{i}"
        ax.plot(TOKENS, [crossover_gbps(p, t) for t in TOKENS], color=color, label=r["preset"])
        ax.axhline(p.h2d_gbps, color=color, ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("uncached prefix u (tokens)")
    ax.set_ylabel("crossover bandwidth (GB/s)")
    ax.set_title("below a curve recompute is cheaper;\ndotted: each preset's own link", fontsize=8)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3, which="both")
    fig.suptitle("recompute vs fetch of an uncached prefix, per layer (placement model, "
                 "preset compute rates; nothing simulated)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(out_dir: Path) -> Path:
    """``table.md``, ``recompute-vs-fetch.png`` and ``results.json`` under ``out_dir``."""
    name = out_dir.name
    out_dir.mkdir(parents=True, exist_ok=True)
    rs = rows()
    (out_dir / "results.json").write_text(json.dumps(
        {"meta": {"experiment": name, "tokens": TOKENS, "gbps": GBPS}, "presets": rs}, indent=1))
    _plot(rs, out_dir / f"{name}.png")
    md = [f"# {name}: where recomputing an uncached prefix beats fetching its KV", "",
          "Per layer, from the placement model and each preset's compute rate "
          "(`simulator/crossover.py`): recompute = LayerKV Eq. 3 per layer, fetch = KV bytes / "
          "H2D bandwidth. Recompute is cheaper on links slower than the crossover bandwidth.",
          "", f"![{name}]({name}.png)", "", *_table(rs), ""]
    path = out_dir / "table.md"
    path.write_text("\n".join(md))
    return path
