"""The CPU kernels' library builds, loads, and leaves the process's float maths alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.kernels import cpu_build

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")


def test_loading_the_kernels_keeps_subnormal_floats():
    # Linked with -ffast-math, gcc before 13 adds crtfastmath.o, whose constructor turns on
    # flush-to-zero for the whole process: a colocated trainer's CPU maths would lose every
    # subnormal. A fresh process, so nothing loaded earlier hides or causes it.
    code = ("import torch; from tandem.kernels import cpu_build; assert cpu_build.library(); "
            "x = float('5e-324'); "
            "print(x * 1.5, (torch.tensor([1e-310], dtype=torch.float64) * 0.5).item())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    smallest, halved = map(float, run.stdout.split())
    assert smallest > 0.0 and halved > 0.0
