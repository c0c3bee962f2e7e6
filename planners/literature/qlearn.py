"""Swap scheduling by tabular Q-learning, in the spirit of a patent on Q-learning memory scheduling.

The residual buffers of a step are grouped into *layer types* (the primitive
that produces them: ``dot_general``, ``conv_general_dilated``, ``tanh``, ...;
the ``max_types`` largest by bytes). A *state* is the current swap plan: one
decision per type (``"keep"`` or ``"offload"``; add ``"remat"`` through
``choices``). An *action* moves one type to its next decision, or stays. The
reward of a state is

    r = nt + w · (nm − nt),    nt = t_keep / t,    nm = (peak_keep − peak) / (peak_keep − budget)

(normalized step time and memory, both in [0, 1], higher is better: ``nt`` is
1 for the all-``keep`` plan, ``nm`` is the share of the needed memory cut that
the plan achieves, clipped to [0, 1], and 1 for any plan that fits; ``w`` in
[0, 1] weighs memory against time, 0.8 by default: fit first, then be fast). Q is
a table, updated with α = 0.5, γ = 0.9 under an ε-greedy policy whose ε decays
linearly over the episodes, with optimistic initial values (1 / (1 − γ), the
most any state-action can be worth); every episode starts from the all-``keep``
plan. Offloaded tensors are prefetched one layer ahead, as in
:mod:`jaxmem.planners.literature.vdnn`.

Feedback comes from the simulator (peak) and the cost model (time) by
default; ``feedback="measure"`` times each plan's emitted step on the
available backend instead (``args`` must then hold concrete arguments). A
``warmup_graph`` (the same step traced with a sub-batch: same ops, smaller
tensors) can be learned on first, for ``warmup_episodes``.

The mean reward of each episode is kept (:attr:`QLearnResult.episode_rewards`,
and in the plan's notes: :func:`episode_rewards` reads them back) so a plot
can show the convergence.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.analysis.graph import build_graph
>>> from jaxmem.cost.costmodel import CostModel
>>> def loss(ws, x):
...     for w in ws:
...         x = jnp.tanh(x @ w)
...     return jnp.sum(x)
>>> g = build_graph(jax.grad(loss), [jnp.ones((64, 64))] * 4, jnp.ones((32, 64)))
>>> r = learn(g, 1 << 30, CostModel.for_target("h100"), {"episodes": 10})
>>> len(r.episode_rewards), r.plan.planner
(10, 'qlearn')
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import time
from typing import Any, Callable, ClassVar, Literal, Mapping

import jax

from jaxmem.analysis.memgraph import MemGraph
from jaxmem.cost.costmodel import CostModel
from jaxmem.planners._estimate import estimate_time_s
from jaxmem.planners._options import Kind, PlannerOptions, check_options
from jaxmem.planners._registry import register
from jaxmem.planners._shared import find_residuals, finish
from jaxmem.planners.literature.vdnn import vdnn_decisions
from jaxmem.plans import plan as plan_lib

logger = logging.getLogger(__name__)

State = tuple[int, ...]
CHOICES: tuple[str, ...] = ("keep", "offload", "remat")
_REWARDS_NOTE = "episode rewards: "


@dataclasses.dataclass(frozen=True)
class QLearnOptions(PlannerOptions):
    """The options of ``qlearn`` (the module docstring says what they mean); of the common
    ones it reads ``seed``, and it always offloads.

    Attributes:
      episodes: episodes to learn for (each state is evaluated once, so they are cheap).
      steps: actions per episode (``None``: the number of layer types, plus one).
      alpha: the learning rate α.
      gamma: the discount γ.
      w: the reward's weight of memory against time, in [0, 1].
      epsilon_start: ε of the first episode (it decays linearly).
      epsilon_end: ε of the last episode.
      max_types: layer types decided, the largest by bytes.
      choices: the decisions per type, distinct values of :data:`CHOICES` starting with
        ``"keep"``.
      feedback: ``"model"`` (the simulator and the cost model) or ``"measure"`` (each
        plan's emitted step timed on the available backend).
      args: the step's concrete arguments, for ``"measure"``.
      kwargs: its keyword arguments, for ``"measure"``.
      repeats: timed runs per plan, for ``"measure"``.
      warmup_graph: the step traced with a sub-batch, learned on first.
      warmup_episodes: episodes on ``warmup_graph``.
      warmup_args: ``warmup_graph``'s concrete arguments, for ``"measure"``.
    """

    always_plans: ClassVar[tuple[Kind, ...]] = ("offload",)

    episodes: int = 300
    steps: int | None = None
    alpha: float = 0.5
    gamma: float = 0.9
    w: float = 0.8
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    max_types: int = 6
    choices: tuple[str, ...] = ("keep", "offload")
    feedback: Literal["model", "measure"] = "model"
    args: Any = None
    kwargs: Mapping[str, Any] | None = None
    repeats: int = 5
    warmup_graph: MemGraph | None = None
    warmup_episodes: int = 0
    warmup_args: Any = None

    def __post_init__(self) -> None:
        choices = self.choices
        if not choices or choices[0] != "keep" or not set(choices) <= set(CHOICES) or len(
                set(choices)) != len(choices):
            raise ValueError(f"qlearn choices must start with 'keep' and be distinct values of "
                             f"{CHOICES}; got {choices!r}")
        if not 0.0 <= self.w <= 1.0:
            raise ValueError(f"qlearn w must lie in [0, 1]; got {self.w}")


@dataclasses.dataclass(frozen=True)
class QLearnResult:
    """What :func:`learn` found.

    Attributes:
      plan: the plan of the best state visited.
      episode_rewards: mean reward of each episode, warm-up episodes first.
      types: the layer types the decisions are about (producer primitives).
      best_state: the decision index per type of the plan.
      q_table: (state, action) -> learned value.
      evaluations: state -> (peak bytes, step time s) of each state visited
        (on the full graph).
    """

    plan: plan_lib.Plan
    episode_rewards: tuple[float, ...]
    types: tuple[str, ...]
    best_state: State
    q_table: Mapping[tuple[State, int], float]
    evaluations: Mapping[State, tuple[int, float]]


class _Env:
    """Plans, their peaks and times, and rewards for one graph (memoized per state)."""

    def __init__(self, graph: MemGraph, budget_bytes: int, cost_model: CostModel,
                 types: tuple[str, ...], opts: QLearnOptions, args: Any) -> None:
        self.graph, self.budget, self.cost_model = graph, budget_bytes, cost_model
        self.choices = tuple(opts.choices)
        self.res = find_residuals(graph)
        by_type: dict[str, list[int]] = {k: [] for k in types}
        for t in self.res.tensors:
            key = graph.ops[graph.tensors[t].producer].primitive  # type: ignore[index]
            if key in by_type:
                by_type[key].append(t)
        self.members = [by_type[k] for k in types]
        self.measure = _measurer(graph, args, opts) if opts.feedback == "measure" else None
        self.memo: dict[State, tuple[int, float]] = {}
        self.peak_keep, self.t_keep = self.evaluate((0,) * len(types))

    def plan(self, state: State) -> plan_lib.Plan:
        offload = [t for i, c in enumerate(state) if self.choices[c] == "offload"
                   for t in self.members[i] if plan_lib.copy_keeps_fusion(self.graph, t)]
        remat = [t for i, c in enumerate(state) if self.choices[c] == "remat"
                 for t in self.members[i]]
        r, o = vdnn_decisions(self.graph, self.res, offload, remat)
        return plan_lib.Plan(order=self.res.order, remat=r, offload=o, placement={},
                             planner="qlearn", budget_bytes=self.budget,
                             predicted_peak_bytes=0, predicted_time_s=None)

    def evaluate(self, state: State) -> tuple[int, float]:
        if state not in self.memo:
            p = self.plan(state)
            peak = plan_lib.simulate_plan(self.graph, p).peak_bytes
            took = (self.measure(p) if self.measure is not None
                    else estimate_time_s(self.graph, p, self.cost_model))
            self.memo[state] = (peak, took)
        return self.memo[state]

    def reward(self, state: State, w: float) -> float:
        peak, took = self.evaluate(state)
        nt = self.t_keep / took if took > 0 else 1.0
        need = self.peak_keep - self.budget
        if peak <= self.budget:
            nm = 1.0
        elif need <= 0:
            nm = 0.0  # the all-keep plan fits and this one does not
        else:
            nm = min(1.0, max(0.0, (self.peak_keep - peak) / need))
        return nt + w * (nm - nt)


def _measurer(graph: MemGraph, args: Any, opts: QLearnOptions
              ) -> Callable[[plan_lib.Plan], float]:
    """Median wall time of a plan's emitted step on the default backend."""
    from jaxmem import emit as emit_lib

    if args is None:
        raise ValueError("qlearn feedback='measure' runs the emitted step, so it needs concrete "
                         "arguments: pass options={'feedback': 'measure', 'args': (...)} (and "
                         "'warmup_args' with a warmup_graph), or use feedback='model'.")
    call_args, kwargs = tuple(args), dict(opts.kwargs or {})

    def measure(plan: plan_lib.Plan) -> float:
        step = jax.jit(emit_lib.emit(graph, plan))
        jax.block_until_ready(step(*call_args, **kwargs))  # compile and warm up
        times = []
        for _ in range(max(1, int(opts.repeats))):
            start = time.perf_counter()
            jax.block_until_ready(step(*call_args, **kwargs))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return measure


def _types(graph: MemGraph, max_types: int) -> tuple[str, ...]:
    """The ``max_types`` producer primitives of residuals with the most bytes."""
    res = find_residuals(graph)
    total: dict[str, int] = {}
    for t in res.tensors:
        key = graph.ops[graph.tensors[t].producer].primitive  # type: ignore[index]
        total[key] = total.get(key, 0) + graph.tensors[t].bytes
    return tuple(sorted(total, key=lambda k: (-total[k], k))[:max_types])


def _run(env: _Env, q: dict[tuple[State, int], float], episodes: int, steps: int,
         opts: QLearnOptions, rng: random.Random, rewards: list[float]) -> None:
    """Q-learning episodes on ``env``, updating ``q`` and appending mean episode rewards."""
    n_types, n_choices = len(env.members), len(env.choices)
    actions = n_types + 1  # change one type's decision, or stay
    # Rewards lie in [0, 1], so no value exceeds 1 / (1 - gamma): starting every entry
    # there (optimistic initial values) makes the greedy policy try what it has not
    # tried, instead of preferring whatever it happened to update most often.
    q0 = 1.0 / (1.0 - opts.gamma) if opts.gamma < 1 else 1.0
    for e in range(episodes):
        frac = e / max(1, episodes - 1)
        eps = opts.epsilon_start + frac * (opts.epsilon_end - opts.epsilon_start)
        state: State = (0,) * n_types
        got = []
        for _ in range(steps):
            if rng.random() < eps:
                a = rng.randrange(actions)
            else:
                values = [q.get((state, b), q0) for b in range(actions)]
                a = max(range(actions), key=lambda b: (values[b], -b))
            nxt = state
            if a < n_types:
                nxt = state[:a] + ((state[a] + 1) % n_choices,) + state[a + 1:]
            r = env.reward(nxt, opts.w)
            future = max(q.get((nxt, b), q0) for b in range(actions))
            old = q.get((state, a), q0)
            q[(state, a)] = old + opts.alpha * (r + opts.gamma * future - old)
            got.append(r)
            state = nxt
        rewards.append(sum(got) / len(got))


def learn(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
          options: Mapping[str, Any] | None = None) -> QLearnResult:
    """Learn a swap plan by Q-learning; see the module docstring for the options' meaning.

    Options: :class:`QLearnOptions`.
    """
    opts = check_options("qlearn", options, QLearnOptions)
    choices = opts.choices
    started = time.perf_counter()
    types = _types(graph, int(opts.max_types))
    steps = int(opts.steps or len(types) + 1)
    rng = random.Random(opts.seed)
    q: dict[tuple[State, int], float] = {}
    rewards: list[float] = []
    notes = [f"types: {', '.join(types) or 'none'}; choices: {', '.join(choices)}; "
             f"feedback: {opts.feedback}"]
    warm = opts.warmup_graph
    if warm is not None and opts.warmup_episodes > 0:
        scale = (plan_lib.simulate_plan(warm, plan_lib.unplanned(warm)).peak_bytes
                 / max(1, plan_lib.simulate_plan(graph, plan_lib.unplanned(graph)).peak_bytes))
        warm_env = _Env(warm, int(budget_bytes * scale), cost_model, types, opts,
                        opts.warmup_args)
        _run(warm_env, q, int(opts.warmup_episodes), steps, opts, rng, rewards)
        notes.append(f"warm-up: {opts.warmup_episodes} episodes on a sub-batch graph")
    env = _Env(graph, budget_bytes, cost_model, types, opts, opts.args)
    _run(env, q, int(opts.episodes), steps, opts, rng, rewards)
    best = max(env.memo, key=lambda s: (env.reward(s, opts.w), -env.memo[s][1]))
    decided = ", ".join(f"{k}={choices[c]}" for k, c in zip(types, best)) or "nothing to decide"
    notes.append(f"best state: {decided}; {len(env.memo)} states visited")
    notes.append(_REWARDS_NOTE + ",".join(f"{r:.4f}" for r in rewards))
    p = env.plan(best)
    plan = finish(graph, budget_bytes, cost_model, planner="qlearn", started=started,
                  order=p.order, remat=p.remat, offload=p.offload, notes=notes, log=logger)
    if opts.feedback == "measure":
        plan = plan.replace(predicted_time_s=env.memo[best][1],
                            notes=plan.notes + ("predicted_time_s is the measured step time "
                                                f"on {jax.default_backend()}",))
    return QLearnResult(plan=plan, episode_rewards=tuple(rewards), types=types, best_state=best,
                        q_table=dict(q), evaluations=dict(env.memo))


def qlearn(graph: MemGraph, budget_bytes: int, cost_model: CostModel,
           options: Mapping[str, Any] | None = None) -> plan_lib.Plan:
    """The planner: :func:`learn`'s plan (episode rewards in its notes)."""
    return learn(graph, budget_bytes, cost_model, options).plan


def episode_rewards(plan: plan_lib.Plan) -> tuple[float, ...]:
    """The mean reward per episode recorded in a ``qlearn`` plan's notes (for a plot).

    Raises:
      ValueError: for a plan without them (not made by ``qlearn``).
    """
    for note in plan.notes:
        if note.startswith(_REWARDS_NOTE):
            body = note[len(_REWARDS_NOTE):]
            return tuple(float(x) for x in body.split(",")) if body else ()
    raise ValueError(f"plan by {plan.planner!r} has no episode rewards; only qlearn plans "
                     f"record them")


register("qlearn", qlearn, "swap plan by tabular Q-learning over layer types",
         options=QLearnOptions)
