"""One-off experiments, apart from the suite (``python -m bench``): each answers one question
and prints its own table. Run one from the repository root as
``python -m bench.experiments.NAME ...`` (its module docstring says more):

* ``blocks MODEL SIZE FRACTIONS [OUT.jsonl]``: the zoo's scan variant with every block planned
  by jaxmem (``jaxmem.planned_policy()``), compiled for the H100 at fractions of the unplanned
  scan step's peak: status, device and host bytes, step time, the blocks' decisions.
* ``cpu_fit [--programs N] [--planners ...]``: whether CPU plans fit as compiled where the
  simulator says they do, under the CPU target's exact compiler options and with
  ``jaxmem.targets.CPU_KEEP_REMAT``; random programs from :mod:`tests.random_programs`.
* ``op_times --models ... --size small --fractions ...``: whether profiled op times pick faster
  plans than the roofline; plans priced both ways, timed on the CPU against the plain step.
* ``placement_batch MODEL [--scan] [--modes ...]``: the largest batch that fits with and
  without state placement on pinned host; ``--anchor``: the deepest Llama-3 that fits, as
  ZeRO-Offload reports it.
* ``probe_offload [BUDGET]``: the compile-only H100 probe (docs/targets.md) planned with
  offload only, every verify round printed.
* ``qlearn_curves OUT FRACTION MODEL...``: the ``qlearn`` planner's reward per episode on zoo
  steps, plotted to ``OUT/qlearn_rewards.png``.
"""
