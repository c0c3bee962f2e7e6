"""The ``jaxmem`` command line: commands, ``--json`` and exit codes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxmem.__main__ import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_level(monkeypatch):
    monkeypatch.delenv("JAXMEM_LEVEL", raising=False)


def test_plan_prints_the_summary(capsys):
    assert main(["plan", "mlp", "--budget", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "mlp (tiny, train) on cpu" in out  # the default target: auto, and no GPU here
    assert "Plan by cpsat: status ok" in out


def test_plan_json_parses(capsys):
    assert main(["plan", "mlp", "--step", "grad", "--budget", "0.5", "--json",
                 "--target", "h100"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["target"] == "h100" and record["plan"]["status"] == "ok"
    assert record["compiled_bytes"] <= record["budget_bytes"]


def test_the_default_target_is_where_the_arguments_live(capsys):
    """One default target everywhere: "auto", the device of the arguments (no GPU here)."""
    assert main(["plan", "mlp", "--step", "grad", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "cpu"


def test_infeasible_budget_exits_3(capsys):
    assert main(["plan", "mlp", "--budget", "4KiB"]) == 3
    assert "infeasible budget" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    [],
    ["plan"],
    ["plan", "no_such_model"],
    ["plan", "mlp", "--size", "huge"],
    ["plan", "mlp", "--budget", "lots"],
    ["plan", "mlp", "--planner", "nope"],
    ["plan", "no_such_module_xyz:make"],
    ["compare", "mlp", "--planners", "greedy,nope"],
    ["compare", "mlp"],
    ["-v", "plan", "mlp", "--quiet"],
])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err


def test_a_bad_level_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("JAXMEM_LEVEL", "9")
    assert main(["plan", "mlp"]) == 2
    assert "JAXMEM_LEVEL='9'" in capsys.readouterr().err


def test_level_0_has_no_plan(monkeypatch, capsys):
    monkeypatch.setenv("JAXMEM_LEVEL", "0")
    assert main(["plan", "mlp"]) == 0
    assert "plain jax.jit" in capsys.readouterr().out


def test_explain_shows_the_peak_before_and_after(capsys):
    assert main(["explain", "mlp", "--budget", "1MiB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "before the plan" in out and "after the plan" in out and out.count("peak ") == 2


def test_compare_table_and_json(capsys):
    assert main(["compare", "mlp", "--planners", "greedy,chen", "--budget", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "compiled MiB" in out and "greedy" in out and "chen" in out
    assert main(["compare", "mlp", "--planners", "greedy,chen", "--budget", "4KiB", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["planner"] for r in rows] == ["greedy", "chen"]
    assert all(r["status"] == "infeasible" for r in rows)


def test_module_function_step(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_steps.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp

        def make():
            def step(w, x):
                return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
            args = (jax.ShapeDtypeStruct((32, 32), jnp.float32),
                    jax.ShapeDtypeStruct((16, 32), jnp.float32))
            return step, args, 0

        def wrong():
            return 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "my_steps:make", "--target", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == "my_steps:make"
    assert main(["plan", "my_steps:wrong"]) == 2


def test_python_dash_m_exit_code():
    env = {k: v for k, v in os.environ.items() if k != "JAXMEM_LEVEL"}
    done = subprocess.run([sys.executable, "-m", "jaxmem", "plan", "mlp", "--budget", "4KiB"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    assert "smallest budget this planner is known to fit" in done.stderr


def test_report_writes_png_and_html(tmp_path, capsys):
    assert main(["plan", "mlp", "--budget", "1MiB", "--report", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and "Decisions" in page


# A four-layer tanh MLP gradient that CP-SAT solves to optimality in well under a second of
# its deterministic time, at a budget the step does not fit as written (so cpsat solves): both
# solves end by themselves, long before the time limit, however busy the machine is.
CPSAT_STEP = """
import jax, jax.numpy as jnp

def make():
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x ** 2)
    ws = [jax.ShapeDtypeStruct((128, 128), jnp.float32) for _ in range(4)]
    return jax.grad(loss), (ws, jax.ShapeDtypeStruct((512, 128), jnp.float32))
"""
CPSAT = ["plan", "cpsat_progress_step:make", "--planner", "cpsat", "--budget", "1.9MiB",
         "--time-limit", "120", "--on-over-budget", "warn", "--target", "h100"]


def test_cpsat_progress_on_stderr_unless_quiet(tmp_path, monkeypatch, capsys):
    (tmp_path / "cpsat_progress_step.py").write_text(CPSAT_STEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(CPSAT) == 0
    err = capsys.readouterr().err
    done = [line for line in err.splitlines() if ": done in " in line]
    labels = [line.split(":")[1].strip() for line in done]
    assert set(labels) == {"cpsat order fixed", "cpsat order free"}, err
    # Each solve ends by itself (optimal), with its solution's step time and the bound.
    assert all("step time " in line and " bound " in line and "(optimal, " in line
               for line in done), err
    progress = logging.getLogger("jaxmem.planners")
    assert not progress.handlers and progress.propagate  # left as it was found
    assert main([*CPSAT, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "Plan by cpsat" in captured.out and "cpsat order" not in captured.err
