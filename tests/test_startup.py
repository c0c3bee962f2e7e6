"""Importing jaxmem on a CPU-only machine prints nothing, and keeps real errors."""

import importlib.util
import os
import subprocess
import sys

import pytest

from jaxmem import _startup


def test_only_the_plugins_two_known_messages_are_dropped():
    assert _startup._NOISE.match(
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR")
    assert _startup._NOISE.match(
        "I0000 00:00:1795623453.054336    6791 cudart_stub.cc:31] Could not find cuda drivers "
        "on your machine, GPU will not be used.")
    for real in ("E0000 00:00:1.0 1 cuda_dnn.cc:9] could not load cuDNN",
                 "I0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on your "
                 "machine, GPU will not be used. Also something else",
                 "Traceback (most recent call last):"):
        assert not _startup._NOISE.match(real)


@pytest.mark.parametrize("platforms, quiet", [("cpu", True), ("", False), ("cuda,cpu", False)])
def test_which_platform_settings_are_quieted(monkeypatch, platforms, quiet):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert _startup._cpu_only() is quiet


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
                    reason="the noise comes from the CUDA plugin, which is not installed")
def test_import_with_the_cuda_plugin_writes_nothing_to_stderr():
    code = ("import os; os.write(2, b'before\\n'); import jaxmem, jax; "
            "jax.numpy.ones(2).block_until_ready(); os.write(2, b'after\\n')")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)
    assert done.stderr.splitlines() == ["before", "after"]
