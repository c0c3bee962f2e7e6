"""CP-SAT progress lines: what they say, and that listening does not change the search."""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp

from jaxmem.analysis.graph import build_graph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners import _cpsat_model
from jaxmem.planners.coarsen import coarsen
from jaxmem.planners.cpsat import plan_cpsat
from jaxmem.plans import plan as plan_lib

H100 = CostModel.for_target("h100")
PROGRESS = "jaxmem.planners._cpsat_progress"


def _graph():
    def loss(ws, x):
        for w1, w2 in ws:
            x = x + jnp.tanh(x @ w1) @ w2
        return jnp.sum(x * x)
    ws = [(jnp.full((16, 64), 0.02), jnp.full((64, 16), 0.03)) for _ in range(3)]
    return build_graph(jax.grad(loss), ws, jnp.linspace(-1.0, 1.0, 256 * 16).reshape(256, 16))


def _search(plan):
    """The CP-SAT notes without wall times: conflicts, branches and deterministic time."""
    return [re.sub(r"[\d.]+ s wall, ", "", n) for n in plan.notes if n.startswith("CP-SAT")]


def test_listening_to_progress_does_not_change_the_search(caplog):
    g = _graph()
    budget = int(0.7 * plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes)
    # both solves end by themselves (proven optimal), as in test_cpsat's determinism test
    opts = {"time_limit_s": 20, "seed": 3, "allow_offload": False}
    with caplog.at_level(logging.WARNING, logger=PROGRESS):
        quiet = plan_cpsat(g, budget, H100, opts)
    assert not [r for r in caplog.records if r.name == PROGRESS and r.levelno == logging.INFO]
    with caplog.at_level(logging.INFO, logger=PROGRESS):
        heard = plan_cpsat(g, budget, H100, opts)
    lines = [r.getMessage() for r in caplog.records if r.name == PROGRESS]
    finals = [line for line in lines if "done in" in line]
    assert [f.split(":")[0] for f in finals] == ["cpsat order fixed", "cpsat order free"]
    solutions = [int(m) for f in finals for m in re.findall(r"(\d+) solutions", f)]
    assert sum(solutions) > 0  # the callback really ran
    assert _search(quiet) == _search(heard) and len(_search(quiet)) == 2
    assert (quiet.order, dict(quiet.remat), dict(quiet.offload)) == \
        (heard.order, dict(heard.remat), dict(heard.offload))


def test_progress_lines_are_in_user_units(caplog):
    g = _graph()
    budget = int(0.7 * plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes)
    with caplog.at_level(logging.INFO, logger=PROGRESS):
        plan = plan_cpsat(g, budget, H100, {"time_limit_s": 20, "seed": 3,
                                            "allow_offload": False, "allow_reorder": False})
    final = [r.getMessage() for r in caplog.records if "done in" in r.getMessage()][-1]
    match = re.search(r"step time ([\d.]+) (s|ms|us)  bound ([\d.]+) (s|ms|us)  gap ([\d.]+)%"
                      r"  model peak [\d.,]+ (B|KiB|MiB|GiB) \(optimal", final)
    assert match, final
    assert float(match.group(5)) == 0.0  # optimal: the bound meets the solution
    # the plan's own lower bound (seconds) is the one the line shows
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[match.group(4)]
    assert abs(float(match.group(3)) * scale - plan.lower_bound) <= 0.01 * plan.lower_bound


def test_progress_needs_units(caplog):
    g = _graph()
    budget = int(0.7 * plan_lib.simulate_plan(g, plan_lib.unplanned(g)).peak_bytes)
    c = coarsen(g, budget, H100)
    rank = c.problem.topo_rank()
    problem = dataclasses.replace(c.problem, fixed_order=tuple(sorted(range(len(rank)),
                                                                     key=rank.__getitem__)))
    with caplog.at_level(logging.INFO, logger=PROGRESS):
        _cpsat_model.solve(problem, time_limit_s=5.0, num_workers=1, seed=0)
        assert not [r for r in caplog.records if r.name == PROGRESS]
        _cpsat_model.solve(problem, time_limit_s=5.0, num_workers=1, seed=0, label="probe",
                           units=_cpsat_model.Units(c.tick_s, c.unit_bytes, c.fixed_bytes))
    assert [r.getMessage() for r in caplog.records if r.name == PROGRESS][-1].startswith(
        "cpsat probe: done in ")
