"""Every docstring example in the package runs and prints what it says.

The modules are imported by their package names (``jaxmem.planners.cpsat``, not the
``planners/cpsat.py`` file): importing a planner's file a second time would register a
second copy of it.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

import jaxmem
import jaxmem.models
import jaxmem.planners


def _modules() -> list[str]:
    """jaxmem's modules, its planners' and its zoo's (those two live in folders of their
    own, so walking ``jaxmem`` alone does not reach them)."""
    names = {"jaxmem.planners", "jaxmem.models"}
    for package in (jaxmem, jaxmem.planners, jaxmem.models):
        names.update(m.name for m in pkgutil.walk_packages(package.__path__,
                                                           package.__name__ + "."))
    return sorted(n for n in names if not n.endswith("__main__"))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()
