"""``python -m bench``: see ``python -m bench --help`` and :mod:`bench`."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Sequence

from bench import options as _options


def main(argv: Sequence[str] | None = None, *, builder: Callable[..., Any] | None = None) -> int:
    """Run the bench; returns the process exit status.

    Args:
      argv: command-line arguments (default: ``sys.argv[1:]``).
      builder: a stand-in for ``jaxmem.models.build`` (tests use a small fake step).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = _options.parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from bench.environment import command, commit, now, write_run
    from bench.output import frontier_plot, pareto_plot, table
    from bench.runner import run

    started, clock, revision = now(), time.monotonic(), commit()
    try:
        records = run(opts, builder=builder)
    except ValueError as err:
        print(f"python -m bench: error: {err}", file=sys.stderr)
        return 2
    write_run(opts.out, started, time.monotonic() - clock, revision, command=command(argv))
    print(table(records))
    print(f"results: {os.path.join(opts.out, 'results.jsonl')}")
    if opts.plot:
        if opts.sweep:
            path = frontier_plot(records, os.path.join(opts.out, "frontier.png"))
        else:
            path = pareto_plot(records, os.path.join(opts.out, "pareto.png"))
        print(f"plot: {path}" if path else "plot: nothing compiled, no plot written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
