"""Q-learning reward per episode on zoo steps:
``python -m bench.experiments.qlearn_curves OUT FRACTION MODEL...``.

Runs the ``qlearn`` planner (simulator + cost-model feedback, no compile) on the
bench-size train step of each model at ``FRACTION`` of its simulated unplanned
peak, prints one JSON line per model (first/last 10-episode mean reward, the
final plan's predicted peak and estimated time) and plots reward per episode to
``OUT/qlearn_rewards.png``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, fraction, models = Path(args[0]), float(args[1]), args[2:]

    import numpy as np

    import jaxmem.models as zoo
    from jaxmem.analysis.graph import build_graph
    from jaxmem.cost.costmodel import CostModel
    from jaxmem.planners.literature import qlearn
    from jaxmem.plans import plan as plan_lib

    cost_model = CostModel.for_target("h100")
    curves: dict[str, list[float]] = {}
    for model in models:
        zs = zoo.build(model, "bench", step="train")
        graph = build_graph(zs.fn, *zs.args, donate_argnums=zs.donate_argnums,
                            arg_roles=zs.arg_roles)
        plain_peak = plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes
        started = time.perf_counter()
        result = qlearn.learn(graph, int(fraction * plain_peak), cost_model, {})
        rewards = np.asarray(result.episode_rewards)
        curves[model] = rewards.tolist()
        print(json.dumps({
            "model": model, "budget_fraction": fraction, "ops": len(graph.ops),
            "episodes": len(rewards), "solve_time_s": round(time.perf_counter() - started, 1),
            "reward_first10": round(float(rewards[:10].mean()), 3),
            "reward_last10": round(float(rewards[-10:].mean()), 3),
            "unplanned_predicted_mib": round(plain_peak / 2**20, 1),
            "plan_predicted_mib": round(result.plan.predicted_peak_bytes / 2**20, 1),
            "plan_est_time_ms": round(1e3 * (result.plan.predicted_time_s or 0.0), 2),
            "status": result.plan.status}), flush=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for model, rewards in curves.items():
        ax.plot(range(1, len(rewards) + 1), rewards, label=model)
    ax.set_xlabel("episode")
    ax.set_ylabel("mean reward of the episode")
    ax.set_title(f"qlearn on h100, bench size, budget {fraction:.0%} of the unplanned peak")
    ax.legend()
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "qlearn_rewards.png", dpi=100)
    print(f"plot: {out / 'qlearn_rewards.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
