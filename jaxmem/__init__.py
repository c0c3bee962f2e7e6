"""jaxmem: make JAX training steps fit in GPU memory with the least slowdown.

Public surface (everything else is internal and may change):

    jaxmem.targets   compile targets (h100, h200 compile-only; cpu)
    jaxmem.optimize  decorator: plan, emit and verify a train step within a budget
    jaxmem.Config    budget, target, planner and what plans may do
    jaxmem.Plan      a planner's decisions (order, remat, offload), JSON round trip
    jaxmem.InfeasibleBudgetError  no plan fits (carries the smallest feasible budget)
    jaxmem.measure   compile a step for a target: memory, FLOPs, estimated time
    jaxmem.profile   measured op times: a trial run under jax.profiler, mapped to the
                     graph's ops (Config(op_times="profile") prices plans by them)
    jaxmem.explain   the tensors alive at a step's predicted memory peak, in words
    jaxmem.predict_peak_bytes   a step's predicted device bytes on a target
    jaxmem.pareto    plan a step at many budgets: compiled bytes vs estimated time per planner
                     (one Point each; its status a PointStatus)
    jaxmem.frontier  the points of a sweep no other point beats on memory and time
    jaxmem.remat     drop-in for jax.checkpoint whose policy (save/offload/remat per name)
                     comes from the plan; jaxmem.planned_policy() is the same for nn.remat
    jaxmem.to_policy a decision table -> (jax.checkpoint policy, MaxText-style mapping)
    jaxmem.use_decisions  apply a decision table to jaxmem.remat blocks while tracing
    jaxmem.plan_blocks    choose the decision table of a step's blocks for a budget
"""

# First: imports JAX without the CUDA plugin's start-up noise on CPU-only machines.
from jaxmem import _startup as _startup, targets as targets
from jaxmem.analysis.explain import explain as explain, predict_peak_bytes as predict_peak_bytes
from jaxmem.config import Config as Config
from jaxmem.cost import profile as profile
from jaxmem.cost.measure import Report as Report, measure as measure
from jaxmem.errors import (
    InfeasibleBudgetError as InfeasibleBudgetError,
    UnsupportedConstructError as UnsupportedConstructError,
)
from jaxmem.optimize import optimize as optimize
from jaxmem.pareto import (
    Point as Point,
    PointStatus as PointStatus,
    frontier as frontier,
    pareto as pareto,
)
from jaxmem.planners.scanplan import plan_blocks as plan_blocks
from jaxmem.plans.plan import Plan as Plan
from jaxmem.tracing.blocks import planned_policy as planned_policy, remat as remat
from jaxmem.tracing.policy import to_policy as to_policy, use_decisions as use_decisions

__version__ = "0.1.0.dev0"
