"""Capacity planner: GPUs for a model, a traffic and an SLO, and what a token costs.

The roofline core (``gpus``, ``models``, ``replica``, ``perfmodel``) is shared with the
engine simulator; ``plan()`` builds the report the ``hpcserve plan`` command prints.
"""

from hpcserve.planner.errors import PlanError
from hpcserve.planner.factors import Factors
from hpcserve.planner.gpus import GPUS, GPUSpec, get_gpu
from hpcserve.planner.models import MODELS, ModelSpec, from_hf_config, resolve_model
from hpcserve.planner.perfmodel import Roofline, StepBatch, StepModel, StepTime
from hpcserve.planner.plan import plan
from hpcserve.planner.replica import Replica, memory_fit
from hpcserve.planner.report import PlanReport
from hpcserve.planner.request import PlanRequest

__all__ = [
    "GPUS",
    "MODELS",
    "Factors",
    "GPUSpec",
    "ModelSpec",
    "PlanError",
    "PlanReport",
    "PlanRequest",
    "Replica",
    "Roofline",
    "StepBatch",
    "StepModel",
    "StepTime",
    "from_hf_config",
    "get_gpu",
    "memory_fit",
    "plan",
    "resolve_model",
]
