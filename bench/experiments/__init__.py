"""One-off experiments, apart from the suite (``python -m bench``): each answers one question
and prints its own table. Run one from the repository root as
``python -m bench.experiments.NAME ...`` (its module docstring says more):

* ``bounds MODEL SIZE BUDGETS_MIB [--planners ...]``: the lower bound on step time beside the
  planners' plans, and their gaps.
* ``block_solve MODEL FRACTIONS``: the block-level solve's plans, its re-issues priced two
  ways, against ``keep_matmuls_fit``'s, by the estimate and by the compiled roofline.
* ``blocks MODEL SIZE FRACTIONS [OUT.jsonl]``: the zoo's scan variant with every block planned
  by jaxmem (``jaxmem.planned_policy()``), compiled for the H100 at fractions of the unplanned
  scan step's peak: status, device and host bytes, step time, the blocks' decisions.
* ``cpu_fit [--programs N] [--planners ...]``: whether CPU plans fit as compiled where the
  simulator says they do, under the CPU target's exact compiler options and with
  ``jaxmem.targets.CPU_KEEP_REMAT``; random programs from :mod:`tests.random_programs`.
* ``free_copies MODEL SIZE BUDGETS_MIB [--latency-profile]``: ``keep_matmuls_fit`` with and
  without the host copies the planners' estimate hides, and what the compiled step makes of
  them (also with a latency profile for XLA's GPU scheduler).
* ``kernel_diff MODEL FRACTION PLANS [--size S]``: each plan's compiled kernels against the
  unplanned step's, by signature, with the roofline time each change adds or saves.
* ``op_times --models ... --size small --fractions ...``: whether profiled op times pick faster
  plans than the roofline; plans priced both ways, timed on the CPU against the plain step.
* ``placement_batch MODEL [--scan] [--modes ...]``: the largest batch that fits with and
  without state placement on pinned host; ``--anchor``: the deepest Llama-3 that fits, as
  ZeRO-Offload reports it.
* ``probe_offload [BUDGET]``: the compile-only H100 probe (docs/targets.md) planned with
  offload only, every verify round printed.
* ``qlearn_curves OUT FRACTION MODEL...``: the ``qlearn`` planner's reward per episode on zoo
  steps, plotted to ``OUT/qlearn_rewards.png``.
* ``reissue_pricing MODEL FRACTION PLANS [--size S]``: what each plan adds to the step's
  time with re-issues priced four ways (the estimate's, and three that count the buffers
  fused inputs read), against the compiled roofline: each pricing's error and ranking.
"""

from __future__ import annotations

import argparse
from typing import Any


def budgets_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The arguments of an experiment run at budgets: ``MODEL SIZE BUDGETS_MIB [--target T]``
    (``doc``'s first paragraph is its description)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("size")
    p.add_argument("budgets", help="comma list of budgets in MiB")
    p.add_argument("--target", default="h100")
    return p


def train_graph(model: str, size: str, target: str) -> tuple[Any, Any, Any]:
    """``(zoo step, its MemGraph, the cost model)``: the zoo's train step of ``model`` at
    ``size``, built for ``target``."""
    import jaxmem.models as zoo
    from jaxmem.analysis.graph import build_graph
    from jaxmem.cost.costmodel import CostModel

    zs = zoo.build(model, size, step="train")
    graph = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums,
                        arg_roles=zs.arg_roles, target=target)
    return zs, graph, CostModel.for_target(target)


SEARCHES = ("greedy", "sublinear", "keep_matmuls_fit")


def plan_named(name: str, graph: Any, budget_bytes: int, cost_model: Any,
               search_s: float, bitwise: bool = True) -> Any:
    """The plan of registry planner ``name`` (``blocks:dots``: ``blocks`` with
    ``save="dots"``); a search among :data:`SEARCHES` runs for ``search_s`` seconds.
    ``bitwise=False``: as under ``Config(bitwise=False)``."""
    import jaxmem.planners as registry

    planner, _, save = name.partition(":")
    opts: dict[str, Any] = {"save": save} if save else {}
    if not bitwise:
        opts["bitwise"] = False
    if planner in SEARCHES:
        opts["time_limit_s"] = search_s
    return registry.get(planner).fn(graph, budget_bytes, cost_model, opts)
