"""The one error the planner raises for bad input."""

from __future__ import annotations


class PlanError(ValueError):
    """Bad planner input: the message names the flag or field, the bad value and what is allowed.

    The CLI prints it as ``hpcserve plan: error: <message>`` and exits 2.
    """
