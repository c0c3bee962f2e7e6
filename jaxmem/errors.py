"""Errors jaxmem raises where the user has to decide something: a budget no plan fits, a
construct the analysis refuses, blocks without names to decide on.

>>> from jaxmem.errors import InfeasibleBudgetError
>>> err = InfeasibleBudgetError(budget_bytes=1 << 20, best_compiled_bytes=3 << 20,
...                             min_feasible_bytes=2 << 20)
>>> isinstance(err, ValueError), err.min_feasible_bytes
(True, 2097152)
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxmem.units import format_bytes

# Planners named in the message as worth a try (the one that failed left out).
_SUGGESTED = ("cpsat", "sublinear", "blocks")


def _size(n: int | None) -> str:
    return "unknown" if n is None else f"{format_bytes(n)} ({n:,} B)"


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
      floor_bytes: the device bytes no plan can go below, when known: the
        step's arguments and the outputs it cannot write into donated
        arguments (non-donated argument bytes + output bytes, and at least all
        argument bytes). When it is over the budget, the message names it and
        the arguments to donate instead of suggesting other planners.
      undonated: ``(argument, bytes)`` of the largest arguments the step does
        not donate, largest first (``argument`` as the user would pass it to
        ``donate_argnums``/``donate_argnames``: an int or a name).
    """

    def __init__(self, budget_bytes: int, best_compiled_bytes: int | None,
                 min_feasible_bytes: int | None, detail: str = "",
                 planner: str | None = None, floor_bytes: int | None = None,
                 undonated: Sequence[tuple[int | str, int]] = ()) -> None:
        self.budget_bytes = int(budget_bytes)
        self.best_compiled_bytes = None if best_compiled_bytes is None else int(best_compiled_bytes)
        self.min_feasible_bytes = None if min_feasible_bytes is None else int(min_feasible_bytes)
        self.detail = detail
        self.planner = planner
        self.floor_bytes = None if floor_bytes is None else int(floor_bytes)
        self.undonated = tuple((a, int(b)) for a, b in undonated)
        head = (f"no plan fits the memory budget of {_size(self.budget_bytes)}: the best plan "
                f"compiled to {_size(self.best_compiled_bytes)} of device memory; the smallest "
                f"budget this planner is known to fit is {_size(self.min_feasible_bytes)}")
        if self.floor_bytes is not None and self.floor_bytes > self.budget_bytes:
            message = head + ". " + self._floor_advice()
        else:
            others = " or ".join(repr(p) for p in [p for p in _SUGGESTED if p != planner][:2])
            message = (
                f"{head} (another planner, e.g. {others}, may reach "
                f"lower). Raise the budget (Config(budget=...)), try another planner "
                f"(Config(planner=...)), allow more remat/offload (allow_remat / allow_offload / "
                f"allow_state_offload), make the batch smaller, or pass "
                f"Config(on_over_budget='warn') to run the best plan anyway.")
        if detail:
            message += f" Tried: {detail}"
        super().__init__(message)

    def _floor_advice(self) -> str:
        text = (f"The step's arguments and the outputs it does not write into donated arguments "
                f"alone take {_size(self.floor_bytes)}, over the budget, and no plan of "
                f"remat, offload or order goes below them.")
        if self.undonated:
            nums = [a for a, _ in self.undonated if isinstance(a, int)]
            names = [a for a, _ in self.undonated if isinstance(a, str)]
            listed = ", ".join(f"argument {a!r}: {format_bytes(b)}" if isinstance(a, str)
                               else f"argument {a}: {format_bytes(b)}" for a, b in self.undonated)
            how = " and ".join(
                ([f"donate_argnums={tuple(nums) if len(nums) > 1 else nums[0]}"] if nums else [])
                + ([f"donate_argnames={tuple(names) if len(names) > 1 else names[0]!r}"]
                   if names else []))
            text += (f" The largest arguments the step does not donate are {listed}: if the "
                     f"step returns their new values (parameters, optimizer state), donate them "
                     f"({how}) so that XLA writes the outputs into their buffers.")
        text += (" Otherwise raise the budget (Config(budget=...)), place the state on the host "
                 "(allow_state_offload=True), make the arguments smaller, or pass "
                 "Config(on_over_budget='warn') to run the best plan anyway.")
        return text

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # keep the fields through pickling (multiprocessing, pytest-xdist)
        return (type(self), (self.budget_bytes, self.best_compiled_bytes,
                             self.min_feasible_bytes, self.detail, self.planner,
                             self.floor_bytes, self.undonated))


class UnsupportedConstructError(ValueError):
    """The step uses a construct the analysis refuses (the message names it and the line)."""


class NoNamesError(ValueError):
    """The step's forward pass has no checkpoint names to decide on (``plan_blocks``)."""
