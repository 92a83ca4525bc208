"""Shared set-up of the Triton kernel tests, which run under TRITON_INTERPRET=1 on the CPU. Import this module before
anything imports triton: the interpreter must be on before triton is first imported (triton.language's own helpers
are built at import time). Where another test module already imported triton in compiled mode, `IN_PROCESS` is False
and the module's tests re-run in a child process (`run_in_child_process`). Skips the importing module without
triton."""

from __future__ import annotations

import os
import subprocess
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

IN_PROCESS = isinstance(triton.language.standard.zeros, InterpretedFunction)
interp = pytest.mark.skipif(not IN_PROCESS, reason="triton was imported without the interpreter")
child_only = pytest.mark.skipif(IN_PROCESS, reason="interpreter active in this process")


def run_in_child_process(test_file: str, timeout: int) -> None:
    """Runs `test_file`'s tests in a fresh interpreter with TRITON_INTERPRET=1; fails with its output if they fail."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", test_file]  # one process
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


class CountingKernel:
    """Stands in for a Triton kernel: records each launch's grid, then launches."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]
