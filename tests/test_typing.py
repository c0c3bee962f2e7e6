"""The package passes mypy under the settings in ``pyproject.toml`` (``[tool.mypy]``), and
so does a user's decorated step (the decorator's overloads).

It ships ``py.typed``, so its annotations are part of its interface. mypy does not follow
setuptools' ``package-dir`` (``planners/`` is installed as ``jaxmem.planners``, ``models/``
as ``jaxmem.models``), so the check runs on a copy laid out as installed.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# How users call the decorator, checked against its overloads: the step is an Optimized,
# bare or with arguments (mypy fails on a type that differs, Any included).
USAGE = """
from typing import Any, Callable, assert_type

import jaxmem
from jaxmem.optimize import Optimized


def step(x: int) -> int:
    return x


assert_type(jaxmem.optimize(step), Optimized)
assert_type(jaxmem.optimize(config=jaxmem.Config()), Callable[[Callable[..., Any]], Optimized])


@jaxmem.optimize
def bare(x: int) -> int:
    return x


@jaxmem.optimize(donate_argnums=0)
def with_arguments(x: int) -> int:
    return x


assert_type(bare, Optimized)
assert_type(with_arguments, Optimized)
"""


def test_mypy_finds_nothing(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]' brings it)")
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "jaxmem", tree / "jaxmem", ignore=skip)
    shutil.copytree(ROOT / "planners", tree / "jaxmem" / "planners", ignore=skip)
    shutil.copytree(ROOT / "models", tree / "jaxmem" / "models", ignore=skip)
    (tree / "usage.py").write_text(USAGE)
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                           str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                           "-p", "jaxmem", "-m", "usage"], capture_output=True, text=True, cwd=tree)
    assert done.returncode == 0, done.stdout + done.stderr
