"""The host-time note of `kvplane gpu-check`'s ``kvplane_cpu_share``: where kvplane's host time
per step went (:func:`cpu_split`), from :class:`~sglang_ext.tools.gpu_check_measure.CoreCheck`'s
details."""

from __future__ import annotations

from typing import Any


def cpu_share(details: dict[str, Any], resident_ms: float) -> tuple[float, str]:
    """``kvplane_cpu_share``'s value and its "X ms of Y ms" note: the worse of the all-resident
    step's host time over its step and the hidden placement's over the overlap phase's own
    all-resident step (an eager step's time moves with the host: gpu-check run 18 timed the
    first at 18.3 ms and the overlap phase's at 12.5); the half-offloaded step's over the first
    all-resident step where the overlap phase failed."""
    host = details["kvplane_cpu_ms_per_step"]
    h = host["hidden"]
    other, base = (host["placed"], resident_ms) if h is None else (h["ms"], h["resident_step_ms"])
    if host["resident"] / resident_ms >= other / base:
        return host["resident"] / resident_ms, f"{host['resident']:.3f} ms of {resident_ms:.3f} ms (all-resident)"
    return other / base, f"{other:.3f} ms of {base:.3f} ms ({'half-offloaded' if h is None else 'hidden placement'})"


def cpu_split(details: dict[str, Any]) -> str:
    """Where the host time went (ms per step): boundary and the layers' calls, each step kind.
    Each term is its own median over the same steps, so they add up to about the total."""
    host = details["kvplane_cpu_ms_per_step"]
    h = host["hidden"]

    def split(kind: str) -> str:
        calls = host[f"{kind}_layer_calls"]
        return (f"{kind} {host[kind]:.3f} ~ boundary {host[f'{kind}_boundary']:.3f} + "
                + " + ".join(f"{k} {v:.3f}" for k, v in calls.items()))

    top = (details["kvplane_host_profile"]["placed"] if h is None else h["profile"])[:3]
    profile = ", ".join(f"{row['function']} {row['own_ms_per_step']:.3f}" for row in top)
    launches = host["placed_launches_per_step"]
    advanced = (f"on {details['placed_engine']}, {host['placed_steps_advanced']} of "
                f"{host['resident_steps_timed']} placed steps advanced, "
                f"{launches['h2d']:g} H2D + {launches['d2h']:g} D2H launches a step, "
                f"{launches['driver_ms']:.3f} ms of it inside the copy engines' driver calls")
    hidden = ("hidden placement: not measured (the overlap phase failed)" if h is None else
              f"hidden {h['ms']:.3f} ~ boundary {h['boundary']:.3f} + "
              + " + ".join(f"{k} {v:.3f}" for k, v in h["layer_calls"].items())
              + f" (on {h['engine']}, {h['driver_ms']:.3f} ms in driver calls; all-resident step "
              f"{h['resident_step_ms']:.3f} ms then)")
    return (f"{split('resident')}; {hidden}; half-offloaded {split('placed')} ({advanced}, "
            f"of a {details['placed_step_ms']:.3f} ms step); means with the timed steps "
            f"{host['resident_mean']:.3f} / {host['placed_mean']:.3f}; "
            f"{'placed' if h is None else 'hidden'} step's top own time (cProfile, ms): {profile}")
