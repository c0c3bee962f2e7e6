"""Render bench results (JSON lines) as a Markdown table: ``python -m bench.markdown FILE``."""

from __future__ import annotations

import json
import sys

MiB = 1 << 20


def _mib(x: float | None) -> str:
    return "–" if x is None else f"{x / MiB:,.0f}"


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def table(lines: list[dict]) -> str:
    """One row per record: model, step, planner, budget, status, memory and time figures."""
    head = ("| model | step | planner | budget MiB | status | device MiB | host MiB | predicted MiB "
            "| pred. err | est. ms | time/none | flops/none | solve s |")
    rows = [head, "|" + "---|" * 13]
    for r in lines:
        err = r.get("prediction_error")
        rows.append(
            f"| {r['model']}{' (scan)' if r.get('variant') == 'scan' else ''} | {r['step']} "
            f"| {r['planner']} | {_mib(r['budget_bytes'])} | {r['status'][:60]} "
            f"| {_mib(r['compiled_peak_bytes'])} | {_mib(r['host_bytes'])} "
            f"| {_mib(r['predicted_peak_bytes'])} | {'–' if err is None else f'{100 * err:.1f}%'} "
            f"| {_num(r['est_step_time_s'] and 1e3 * r['est_step_time_s'], '.2f')} "
            f"| {_num(r['est_time_ratio'], '.3f')} | {_num(r['flops_ratio'], '.3f')} "
            f"| {_num(r['solve_time_s'], '.1f')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m bench.markdown RESULTS.jsonl [...]", file=sys.stderr)
        return 2
    records = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
