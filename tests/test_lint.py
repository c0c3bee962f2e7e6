"""The repository passes ``ruff check`` under the rules in ``pyproject.toml`` (``[tool.ruff]``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                           "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_nothing_refers_to_files_outside_the_repository():
    """The design notes the project started from are not in the repository: what a reader
    needs of them is in docs/, so no file may send the reader to them."""
    listed = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml"], capture_output=True,
                            text=True, cwd=ROOT)
    if listed.returncode != 0:
        pytest.skip("not a git checkout (an sdist): no file list to check")
    outside = ("DESIGN.md", "STYLE.md", "../shared")
    found = [f"{name}:{n}: {line.strip()}" for name in listed.stdout.split()
             if (ROOT / name).exists()
             for n, line in enumerate((ROOT / name).read_text().splitlines(), 1)
             if any(word in line for word in outside) and name != "tests/test_lint.py"]
    assert not found, "\n".join(found)
