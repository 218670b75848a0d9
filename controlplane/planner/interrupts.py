"""How a search stage is cut short (shared by :mod:`.placement_search` and :mod:`.branch_and_bound`)."""

REL_EPS = 1e-12
"""Relative margin by which a plan must beat the incumbent to replace it."""


class Deadline(Exception):
    """The stage must stop now: the deadline passed (or a node limit was reached)."""


class Satisfied(Deadline):
    """The incumbent reached the caller's target step time (a feasibility probe is answered)."""


class Unreachable(Deadline):
    """A valid lower bound proves the caller's target step time out of reach (a feasibility
    probe is answered: no)."""
