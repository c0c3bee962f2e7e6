"""Errors jaxmem raises where the user has to decide something.

>>> from jaxmem.errors import InfeasibleBudgetError
>>> err = InfeasibleBudgetError(budget_bytes=1 << 20, best_compiled_bytes=3 << 20,
...                             min_feasible_bytes=2 << 20)
>>> isinstance(err, ValueError), err.min_feasible_bytes
(True, 2097152)
"""

from __future__ import annotations

_MiB = float(1 << 20)
# Planners named in the message as worth a try (the one that failed left out).
_SUGGESTED = ("cpsat", "sublinear", "blocks")


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / _MiB:,.1f} MiB ({n:,} B)"


class InfeasibleBudgetError(ValueError):
    """No plan jaxmem found fits the memory budget.

    Attributes:
      budget_bytes: the budget that was asked for.
      best_compiled_bytes: the smallest compiled device footprint any plan
        reached (temp + arguments + outputs - aliased), or ``None`` when
        nothing was compiled.
      min_feasible_bytes: the smallest budget the planner is known to meet: the
        best compiled footprint when one was reached, else the planner's lower
        bound; ``None`` when unknown. Another planner may reach lower.
      detail: what was tried, for the message.
      planner: the planner that was used, when known (the message then suggests others).
    """

    def __init__(self, budget_bytes: int, best_compiled_bytes: int | None,
                 min_feasible_bytes: int | None, detail: str = "",
                 planner: str | None = None) -> None:
        self.budget_bytes = int(budget_bytes)
        self.best_compiled_bytes = None if best_compiled_bytes is None else int(best_compiled_bytes)
        self.min_feasible_bytes = None if min_feasible_bytes is None else int(min_feasible_bytes)
        self.detail = detail
        others = " or ".join(repr(p) for p in [p for p in _SUGGESTED if p != planner][:2])
        message = (
            f"no plan fits the memory budget of {_mib(self.budget_bytes)}: the best plan compiled "
            f"to {_mib(self.best_compiled_bytes)} of device memory; the smallest budget this "
            f"planner is known to fit is {_mib(self.min_feasible_bytes)} (another planner, e.g. "
            f"{others}, may reach lower). Raise the budget (Config(budget=...)), try "
            f"another planner (Config(planner=...)), allow more remat/offload (allow_remat / "
            f"allow_offload / allow_state_offload), make the batch smaller, or pass "
            f"Config(on_over_budget='warn') to run the best plan anyway.")
        if detail:
            message += f" Tried: {detail}"
        super().__init__(message)

    def __reduce__(self):  # keep the fields through pickling (multiprocessing, pytest-xdist)
        return (type(self), (self.budget_bytes, self.best_compiled_bytes,
                             self.min_feasible_bytes, self.detail))
