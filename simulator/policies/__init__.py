"""Serving policies selectable by name (``kvplane sim run --policy NAME``).

Policies decide; the engine executes. Policies that the control plane implements (OrbitFlow
placement, pause/resume, token deposit, the fcfs/layerkv/lvf schedulers) drive the control plane's
own code; the baselines it lacks are built on the same placement model and candidate set.
"""

from __future__ import annotations

from collections.abc import Callable

from simulator.engine import SimPolicy


def _registry() -> dict[str, Callable[[], SimPolicy]]:
    from simulator.policies.authors import AuthorsUniformPolicy
    from simulator.policies.ellm import EllmPolicy
    from simulator.policies.hcache import HCachePolicy
    from simulator.policies.layerkv import LayerKVPolicy
    from simulator.policies.lvf import LvfPolicy
    from simulator.policies.no_offload import NoOffloadPolicy
    from simulator.policies.uniform import UniformPolicy
    from simulator.policies.vllm_recompute import VllmRecomputePolicy
    from simulator.policies.vllm_swap import VllmSwapPolicy

    reg: dict[str, Callable[[], SimPolicy]] = {
        m: (lambda m=m: UniformPolicy(m)) for m in UniformPolicy.MODES
    }
    reg.update({m: (lambda m=m: AuthorsUniformPolicy(m)) for m in AuthorsUniformPolicy.MODES})
    reg["no-offload"] = lambda: NoOffloadPolicy("recompute")
    reg["no-offload-swap"] = lambda: NoOffloadPolicy("swap")
    reg["ellm"] = EllmPolicy
    reg["vllm-recompute"] = VllmRecomputePolicy
    reg["vllm-swap"] = VllmSwapPolicy
    reg["hcache"] = HCachePolicy
    reg["layerkv"] = LayerKVPolicy
    reg["lvf"] = LvfPolicy
    try:
        from simulator.policies.controlled import CONTROLLED
    except ImportError:  # the control plane's planner/controller are not installed yet
        CONTROLLED = {}
    reg.update(CONTROLLED)
    return reg


def policy_names() -> list[str]:
    return sorted(_registry())


def make_policy(name: str, **kwargs) -> SimPolicy:
    """A fresh policy instance; ``ValueError`` naming the allowed names otherwise."""
    reg = _registry()
    if name not in reg:
        raise ValueError(f"policy: {name!r} is not one of {sorted(reg)}")
    return reg[name](**kwargs) if kwargs else reg[name]()
