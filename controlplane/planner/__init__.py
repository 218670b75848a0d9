"""The placement planner (issue 2 §3): candidate layouts, exact-model search, CBC stage, windows.

Public API::

    from controlplane.planner import Planner
    plan = Planner().plan(batch, time_budget_ms=None, victim_rule="largest", current_step=None)
"""

from controlplane.planner.candidates import CandidateSet, candidate_set
from controlplane.planner.planner import VICTIM_RULES, Planner

__all__ = ["VICTIM_RULES", "CandidateSet", "Planner", "candidate_set"]
