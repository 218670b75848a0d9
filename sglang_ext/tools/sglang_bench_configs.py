"""``kvplane bench sglang``'s server configurations: each one's launch flags after the CPU recipe,
and whether they ask for SGLang's overlap scheduler (``sglang_ext.tools.sglang_bench``)."""

from __future__ import annotations

from pathlib import Path

from sglang_ext.tools.workload import SHARED_HOST_ARGS

DEFAULT_CONFIGS = ("vanilla", "vanilla-b", "vanilla-no-overlap", "layered", "layered-offload")


def config_flags(offload_budget_tokens: int, policy_file: Path) -> dict[str, tuple[str, ...]]:
    """Every configuration's launch flags after the CPU recipe. Beyond the recipe and the
    shared-host flags (``SHARED_HOST_ARGS``: KV headroom, sleep when idle) ``vanilla`` changes
    none of SGLang's defaults -- the overlap scheduler stays on; the layered ones launch as users
    do: ``--enable-layered-kv`` implies ``--disable-overlap-schedule`` (the plugin sets it), except
    in ``layered-overlap`` (``--kv-overlap-schedule on``)."""
    base = tuple(SHARED_HOST_ARGS)
    layered = (*base, "--enable-layered-kv", "--kv-policy", str(policy_file))
    return {
        "vanilla": base,
        "vanilla-b": base,  # a second vanilla launch: the A/A noise of a paired launch
        "vanilla-no-overlap": (*base, "--disable-overlap-schedule"),
        "layered": layered,
        "layered-offload": (*layered, "--kv-gpu-budget-tokens", str(offload_budget_tokens)),
        "layered-overlap": (*layered, "--kv-overlap-schedule", "on"),  # not a default: opt-in
    }


def asks_overlap(flags: tuple[str, ...]) -> bool:
    """Whether launch flags leave SGLang's overlap scheduler on (its default; with
    ``--enable-layered-kv`` only under ``--kv-overlap-schedule on``)."""
    if "--disable-overlap-schedule" in flags:
        return False
    if "--enable-layered-kv" not in flags:
        return True
    if "--kv-overlap-schedule=on" in flags:
        return True
    at = flags.index("--kv-overlap-schedule") if "--kv-overlap-schedule" in flags else -1
    return 0 <= at < len(flags) - 1 and flags[at + 1] == "on"
