"""The package passes mypy under the settings in ``pyproject.toml`` (``[tool.mypy]``).

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


def test_mypy_finds_nothing(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]' brings it)")
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "jaxmem", tree / "jaxmem", ignore=skip)
    shutil.copytree(ROOT / "planners", tree / "jaxmem" / "planners", ignore=skip)
    shutil.copytree(ROOT / "models", tree / "jaxmem" / "models", ignore=skip)
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                           str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                           "-p", "jaxmem"], capture_output=True, text=True, cwd=tree)
    assert done.returncode == 0, done.stdout + done.stderr
