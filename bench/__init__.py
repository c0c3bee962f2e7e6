"""jaxmem's comparison bench: every planner and stock policy, same model, same run.

Run from the repository root::

    python -m bench --models mlp,gpt2 --size tiny --fractions 0.5,0.8 --cpu-time

It compiles each (model, planner, budget) for the target (``h100`` by
default, compile-only), writes one JSON line per run to
``OUT/results.jsonl`` (fields of docs/measurement.md), prints a table with memory
in MiB and ratios to the unplanned step (``none``), and plots compiled peak
against estimated step time in ``OUT/pareto.png``.

``--budgets`` takes budgets as ``jaxmem.Config`` reads them (bytes, ``60GiB``, a
float for a fraction of the target's memory, ``default``); ``--fractions`` takes
fractions of the unplanned step's compiled peak.

Sweep mode (:mod:`bench.sweep`) replaces ``--budgets`` and ``--fractions``::

    python -m bench --models gpt2 --size bench --planners all --sweep --sweep-factor 0.8

Each planner runs :func:`jaxmem.pareto`: budgets from the unplanned step's
compiled peak down by ``--sweep-factor`` until the planner cannot fit one (or
below ``--sweep-min`` of the peak), plus one point at the smallest budget the
failure named; the peers compile once and get one record per budget tried.
``OUT/frontier.png`` shows, per model, compiled peak against estimated step
time: each planner a line through its sweep points, each peer a marker, the
budgets as light vertical lines. Every step time is a roofline estimate for
the target, not a measurement.

One-off experiments, apart from the suite, are in :mod:`bench.experiments`
(``python -m bench.experiments.NAME``).
"""

import os

# The CUDA plugin must not look for a GPU on machines without one (docs/targets.md);
# set before anything imports jax. An explicit setting wins.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Import JAX through jaxmem first, so the CUDA plugin's start-up noise is dropped.
import jaxmem  # noqa: E402,F401
