"""BENCHMARKS.md, generated from the records committed under ``bench/records/``.

``python -m bench.benchmarks`` writes BENCHMARKS.md from the records (no
compiling, seconds). ``python -m bench.benchmarks --run main,sweeps`` first
runs those sections' commands again (each into ``bench/records/SECTION/``,
replacing what was there; the sweeps take about an hour on two cores), then
writes the page. ``--check`` writes nothing and exits 1 when the page on disk
is not what the records give.

Each section is a script of ordinary commands (``python -m bench ...``),
printed above its tables, and a renderer that reads what the script wrote.
``bench/records/SECTION/run.json`` keeps when the script ran, for how long,
on which machine and with which versions; the page prints it beside the
tables, so no figure stands apart from the command and versions that made it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import jaxmem.planners as registry
from bench import acceptance, markdown
from bench.environment import commit, now, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join("bench", "records")
PAGE = "BENCHMARKS.md"

Record = dict[str, Any]

PEERS = ",".join(registry.peers())
LITERATURE = ("greedy,sublinear,chen,vdnn_all,vdnn_conv,vdnn_dynamic,qlearn,order_ilp,order_bfs,"
              "order_dfs")
SWEPT = ("mlp", "vgg16", "resnet50", "unet", "gpt2", "llama")
# jaxmem's own heuristics (greedy is among LITERATURE's)
HEURISTICS = "blocks,keep_matmuls,keep_matmuls_fit"


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of the page.

    Attributes:
      key: its folder under ``bench/records/``.
      title: its heading.
      about: what the section shows, in Markdown, printed under the heading.
      script: the bash commands that make its records, run from the repository
        root with ``$OUT`` set to the section's folder.
      render: Markdown of the records in that folder, given the repository root and
        the folder relative to it (links in the page are relative to the root).
    """

    key: str
    title: str
    about: str
    script: str
    render: Callable[[str, str], str]


def _records(folder: str) -> list[Record]:
    """Every record of every ``results.jsonl`` under ``folder``, in path order."""
    found = []
    for base, dirs, files in sorted(os.walk(folder)):
        dirs.sort()
        if "results.jsonl" in files:
            with open(os.path.join(base, "results.jsonl"), encoding="utf-8") as source:
                found += [json.loads(line) for line in source if line.strip()]
    return found


def _render_main(root: str, folder: str) -> str:
    records = _records(os.path.join(root, folder))
    return "\n\n".join([
        markdown.by_budget(records),
        "Every run, one row each:",
        markdown.table(records),
        f"![compiled peak against estimated step time]({folder}/pareto.png)"])


def _render_sweeps(root: str, folder: str) -> str:
    by_model = {m: _records(os.path.join(root, folder, m)) for m in SWEPT}
    records = [r for m in SWEPT for r in by_model[m]]
    peers = [r for m in SWEPT for r in acceptance.peers(by_model[m])]
    plots = [f"![{m}]({folder}/{m}/sweep/frontier.png)" for m in SWEPT
             if os.path.exists(os.path.join(root, folder, m, "sweep", "frontier.png"))]
    return "\n\n".join([
        *_rerun_models(root, folder),
        "### Every model as written and under every stock policy",
        "One compile per (model, policy), from the sweeps' records.",
        markdown.peers_table(peers),
        "### `cpsat` against every rival that fits, budget by budget",
        acceptance.report(records),
        "### Frontiers",
        "Compiled peak against estimated step time: `cpsat` a line through its sweep points, "
        "each stock policy a marker.",
        "\n".join(plots)])


def _rerun_models(root: str, folder: str) -> list[str]:
    """A line for the models whose sweep ran again on its own after the section's script
    (another commit than the section's run.json names): when, at which commit, and the
    command, from the model's own run.json; none when every model ran with the section."""
    with open(os.path.join(root, folder, "run.json"), encoding="utf-8") as source:
        section_commit = json.load(source)["commit"].rstrip("+")
    again = []
    for m in SWEPT:
        path = os.path.join(root, folder, m, "sweep", "run.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as source:
            own = json.load(source)
        if own["commit"].rstrip("+")[:7] != section_commit[:7]:
            again.append(f"`{m}` ran again on its own {own['started'][:10]} "
                         f"({own['wall_s'] / 60:.0f} min; commit {own['commit'][:7]}): "
                         f"`{own['command']}`")
    return ["Run again since, its records replacing the script's: " + "; ".join(again) + "."
            ] if again else []


def _render_text(root: str, folder: str) -> str:
    with open(os.path.join(root, folder, "output.txt"), encoding="utf-8") as source:
        return "```\n" + source.read().rstrip() + "\n```"


def _render_markdown(root: str, folder: str) -> str:
    with open(os.path.join(root, folder, "output.txt"), encoding="utf-8") as source:
        return source.read().rstrip()


def _jsonl(path: str) -> list[Record]:
    with open(path, encoding="utf-8") as source:
        return [json.loads(line) for line in source if line.strip()]


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f}"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _device_rows(records: list[Record]) -> str:
    """One row per point run on the device: the target's compile-only peak and estimate
    beside what the device measured. A peak the device could not see (its high-water mark
    was already higher before the call: ``measured_peak_note``) reads ``hidden``."""
    rows = ["| step | policy or plan | compiled MiB | measured MiB | est. ms | measured ms "
            "| measured / est. |", "|---|---|---|---|---|---|---|"]
    for r in records:
        name = (r["planner"] if r["kind"] == "peer" else
                f"jaxmem `{r['planner']}` at {r['budget_fraction']:g} "
                f"({_mib(r['budget_bytes'])} MiB): {r['status']}")
        ratio = (f"{r['step_time_s'] / r['est_step_time_s']:.2f}"
                 if r.get("step_time_s") and r.get("est_step_time_s") else "-")
        measured = ("hidden" if r.get("measured_peak_bytes") is None
                    and r.get("measured_peak_at_most_bytes") is not None
                    else _mib(r.get("measured_peak_bytes")))
        rows.append(f"| {r['model']} {r['size']} {r['variant']} | {name} "
                    f"| {_mib(r['compiled_peak_bytes'])} | {measured} "
                    f"| {_ms(r['est_step_time_s'])} | {_ms(r['step_time_s'])} "
                    f"(median of {len(r['step_times_s'])}) | {ratio} |")
    return "\n".join(rows)


def _render_device_zoo(root: str, folder: str) -> str:
    return _device_rows(_records(os.path.join(root, folder)))


def _render_device(root: str, folder: str) -> str:
    """The device's measurements beside the target's compile-only figures, and the
    scan-offload check (``bench.experiments.on_device``)."""
    checks = ["| decision table | pinned-host buffers | host temp MiB | device temp MiB "
              "| ms | elements differing from plain | from every name saved |",
              "|---|---|---|---|---|---|---|"]
    for r in _jsonl(os.path.join(root, folder, "offload_check.jsonl")):
        # the first record, the plain step run twice, has no table's figures: "-"
        largest = "" if r.get("max_abs_diff") is None else f"(max {r['max_abs_diff']:.2g}) "
        from_saved = r.get("differing_from_saved")
        checks.append(
            f"| {r['table']} | {r.get('pinned_host_buffers', '-')} "
            f"| {_mib(r.get('host_temp_bytes'))} | {_mib(r.get('device_temp_bytes'))} "
            f"| {_ms(r.get('step_time_s'))} "
            f"| {r['differing_elements']:,} of {r['compared_elements']:,} {largest}"
            f"| {'-' if from_saved is None else f'{from_saved:,}'} |")
    rows = _device_rows(_jsonl(os.path.join(root, folder, "results.jsonl")))
    return "\n\n".join([rows, "Scan offload on the device (`gpt2` small, "
                          "scanned, train step; the scan bodies as blocks under one decision "
                          "table per kind):", "\n".join(checks)])


SECTIONS = (
    Section(
        "main", "The default model: every stock policy and every planner",
        "The README's main job: the residual `mlp` at bench size, the gradient-only step, "
        "compiled for H100, every stock policy once and every planner (jaxmem's and the "
        "literature's) at 70%, 50% and 30% of the unplanned step's compiled peak. A cell is "
        "*device MiB / estimated ms* of a plan that fits, or its status; the fastest plan "
        "that fits each budget is bold.",
        "python -m bench --models mlp --size bench --step grad --planners all "
        "--fractions 0.7,0.5,0.3 --out $OUT",
        _render_main),
    Section(
        "sweeps", "Every zoo model: `cpsat` swept against every stock policy",
        "The train step (AdamW, state donated) of every zoo model at bench size, compiled for "
        "H100. Every stock policy compiles once; `cpsat` plans under the default 60 s limit at "
        "budgets from the unplanned step's compiled peak down by 0.8 until it cannot fit, and "
        "once more at the smallest budget the failure named. A point is "
        "won when `cpsat`'s plan fits the budget and its estimated time is within 1% of the "
        "fastest rival that fits. Every model is planned under the default `jaxmem.Config`: "
        "`llama` (bf16) keeps its bits where a bit-exact plan fits and is recomputed as "
        "`jax.checkpoint` would where none does (`bitwise='auto'`, docs/exactness.md). "
        "*bound ms (gap)*: no plan whose simulated peak fits the budget is estimated under "
        "the bound, and the kept plan is that far above it, both in the planners' estimate "
        "(not the compiled roofline of *planner MiB / ms*; docs/planners.md, \"How far a "
        "plan may be from the best\"); `–` for records made before plans carried it.",
        "\n".join([
            f"PEERS={PEERS}",
            f"for m in {' '.join(SWEPT)}; do",
            "  python -m bench --models $m --size bench --step train --planners $PEERS,cpsat \\",
            "      --sweep --time-limit-s 60 --out $OUT/$m/sweep",
            "done"]),
        _render_sweeps),
    Section(
        "exactness", "Exactness of every planner's emitted step",
        "Each zoo model's tiny AdamW train step, planned for the `cpu` target at 50% of its "
        "simulated peak by every planner, run emitted and plain on the CPU: `exact` means the "
        "loss, the updated parameters and the optimizer state are bitwise equal. The plan's "
        "shape: `r` re-issued tensors, `o` offloaded, `m` moved ops. No planner reaches 50% "
        "of these tiny steps (their parameters and optimizer state are most of the memory), "
        "so each runs its best plan, reported `over_budget`. Then the `small` sizes at 20%, "
        "whose larger reductions XLA:CPU gives to other kernels, under jaxmem's own planners.",
        "\n".join([
            "python -m bench.exactness mlp,vgg16,resnet50,unet,gpt2,llama "
            f"{LITERATURE},{HEURISTICS},cpsat > $OUT/output.txt \\",
            "  || echo \"exit status $?: some step differs\" >> $OUT/output.txt",
            "python -m bench.exactness mlp,vgg16,resnet50,unet,gpt2,llama "
            f"greedy,chen,{HEURISTICS},cpsat 0.2 cpu small >> $OUT/output.txt \\",
            "  || echo \"exit status $?: some step differs\" >> $OUT/output.txt"]),
        _render_text),
    Section(
        "bf16", "16-bit steps: distance from the plain step, against the stock policies",
        "Two bf16 gradient steps at tiny sizes, the zoo's `llama` (Flax linen) and a GPT "
        "written with Flax NNX: every stock policy applied to each layer, and jaxmem under "
        "the default `jaxmem.Config` at each stock policy's compiled bytes, planned for H100 "
        "and run on the CPU on six input draws. *ulps*: the largest difference of the loss "
        "and gradients from the plain step's, in bf16 ulps of each output's largest "
        "magnitude (of the largest gradient's, for a gradient that is zero at that "
        "precision, such as an attention key bias's), the worst over the draws and each "
        "draw's; *excess precision off*: the same, both steps compiled with "
        "`xla_allow_excess_precision=False`, where every bf16 op rounds as written. A "
        "`bit-exact` plan keeps the plain step's arithmetic as XLA compiles it for H100; "
        "under `jax.jit`'s own options XLA:CPU keeps fused bf16 values in f32 and fuses "
        "otherwise, so on the CPU it may differ there (docs/exactness.md). A `relaxed` plan "
        "recomputes as `jax.checkpoint` would, where no bit-exact plan fits.",
        "python -m bench.bf16 > $OUT/output.txt \\\n"
        "  || echo \"exit status $?: a plan missed its budget, changed bits with excess "
        "precision off, or is further than the stock policies\" >> $OUT/output.txt",
        _render_markdown),
    Section(
        "h200", "Measured on an H200: peaks and step times beside the estimates",
        "The zoo's scanned GPT-2 (bench size, train step, dropout 0.1) run on an NVIDIA H200: "
        "as written, under the stock `full` policy, and planned by `@jaxmem.optimize` "
        "(`bitwise=False`: the scan bodies are planned) at 25% of the unplanned step's "
        "compiled peak, called on the arrays on the GPU as a user calls it. *compiled MiB* and "
        "*est. ms* are the H200 target's compile-only figures and roofline estimate; "
        "*measured MiB* is the device allocator's peak over the step's first call, "
        "*measured ms* the median wall time of the timed calls. Then the scan-offload "
        "traps: the scanned step's scan bodies as blocks under each decision kind, compared "
        "element by element with the plain step on the same GPU. The GPU is not bitwise "
        "deterministic run to run (the first row), and any change of program moves bits "
        "(saving every name already does); a wrong gradient would show as a larger "
        "*max*, which offloading does not reach. These records need a GPU: `--run h200` "
        "on a machine without one fails.",
        "\n".join([
            "export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.92",
            "python -m bench.experiments.on_device gpt2 small --offload-check --repeats 5 "
            "--out $OUT",
            "python -m bench.experiments.on_device gpt2 bench --scan --not-bitwise "
            "--policies none,full --fractions 0.25 --target h200 --time-limit-s 20 "
            "--repeats 5 --out $OUT"]),
        _render_device),
    Section(
        "h200_zoo", "Measured on an H200: the zoo's unrolled steps",
        "The zoo's `llama` (bf16), `resnet50` and `unet` train steps (AdamW, bench size, "
        "unrolled) run on an NVIDIA H200: as written, under the stock `full` policy, and "
        "planned by `@jaxmem.optimize` under the default `jaxmem.Config` (`cpsat`, a 20 s "
        "limit) at a budget just above what `full` compiles to, called on the arrays on the "
        "GPU. Columns as in the section above. *hidden*: the device's high-water mark was "
        "already above the step's own before its first call (set while compiling in the same "
        "process; it cannot be reset), so the step's peak could not be read; the compiled "
        "figure stands.",
        "\n".join([
            "export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.92",
            "for point in llama:0.3 resnet50:0.5 unet:0.6; do",
            "  python -m bench.experiments.on_device ${point%:*} bench --policies none,full "
            "--fractions ${point#*:} \\",
            "      --target h200 --time-limit-s 20 --repeats 5 --out $OUT/${point%:*}",
            "done"]),
        _render_device_zoo),
)

_HEADER = """\
# jaxmem benchmarks

Generated by `python -m bench.benchmarks` from the records in `bench/records/`; each section
prints the commands that made its records, when they ran, on what machine and with which
versions (`python -m bench.benchmarks --run SECTION` runs them again). Memory figures are XLA's
compiled buffer assignment for the target (compile-only for H100/H200 on a machine without a
GPU: docs/targets.md): *device MiB* = temp + arguments + outputs − aliased bytes, *host MiB* the
pinned-host counterpart; *predicted MiB* is jaxmem's simulator before compiling and *pred. err*
its distance from the compiled figure (docs/measurement.md). **Step times are roofline
estimates** for the target computed from the compiled HLO (*est. ms*, *time/none*), unless a
section says they were measured on a GPU. Budgets given as fractions are fractions of the
unplanned step's compiled peak.
"""


def _provenance(run: dict[str, Any] | None) -> str:
    """When, where and with what a section's records were made (its run.json)."""
    if run is None:
        return "*No records: run `python -m bench.benchmarks --run` for this section.*"
    ver = run["versions"]
    where = run["machine"]
    gpu = [d for d in where["devices"] if d.lower() != "cpu"]
    return (f"Ran {run['started'][:10]} ({run['wall_s'] / 60:.0f} min; commit {run['commit']}) "
            f"on {where['cpus']} CPU "
            f"cores, {'GPU: ' + ', '.join(gpu) if gpu else 'no GPU'}; "
            + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".")


def page(root: str = ROOT, sections: Sequence[Section] = SECTIONS) -> str:
    """BENCHMARKS.md as the records under ``root`` give it: per section, the script that
    made its records (as it ran), when and with what, and its tables."""
    parts = [_HEADER]
    for number, section in enumerate(sections, 1):
        folder = os.path.join(RECORDS, section.key)
        path = os.path.join(root, folder, "run.json")
        run = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as source:
                run = json.load(source)
        script = section.script if run is None else run.get("script", section.script)
        parts += [f"## {number}. {section.title}", section.about,
                  "```bash\nOUT=" + folder + "\n" + script + "\n```", _provenance(run)]
        if run is not None:
            parts.append(section.render(root, folder))
    return "\n\n".join(p.rstrip() for p in parts) + "\n"


def run(section: Section, root: str = ROOT) -> None:
    """Run one section's script into a fresh ``bench/records/KEY`` and write its run.json."""
    folder = os.path.join(RECORDS, section.key)
    revision = commit(root)  # before the run replaces the section's committed records
    shutil.rmtree(os.path.join(root, folder), ignore_errors=True)
    os.makedirs(os.path.join(root, folder))
    started, clock = now(), time.monotonic()
    # `python` in the scripts is this interpreter (the project's venv).
    env = dict(os.environ, OUT=folder, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    subprocess.run(["bash", "-euo", "pipefail", "-c", section.script], cwd=root, env=env,
                   check=True)
    write_run(os.path.join(root, folder), started, time.monotonic() - clock, revision,
              script=section.script)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.benchmarks",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--run", metavar="SECTIONS",
                   help="comma list of sections to run again first ("
                        + ", ".join(s.key for s in SECTIONS) + "), or 'all'")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if BENCHMARKS.md differs from what the records give")
    args = p.parse_args(argv)
    by_key = {s.key: s for s in SECTIONS}
    wanted = [] if not args.run else (list(by_key) if args.run == "all" else args.run.split(","))
    unknown = [k for k in wanted if k not in by_key]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; the sections are {', '.join(by_key)}")
    for key in wanted:
        run(by_key[key])
    text = page()
    path = os.path.join(ROOT, PAGE)
    if args.check:
        with open(path, encoding="utf-8") as source:
            same = source.read() == text
        print(f"{PAGE} is {'' if same else 'not '}what bench/records give")
        return 0 if same else 1
    with open(path, "w", encoding="utf-8") as sink:
        sink.write(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
