"""How a kernel's output is judged against a reference, shared by the tests and the GPU check.

One error measure (``relative_error``) and one tolerance per input dtype (``TOLERANCE``), so
that ``tests/`` on a CPU and ``benchmarks/gpu_check.py`` on a GPU pass or fail a kernel by the
same rule; ``kernel_backends`` lists the backends to check side by side. Torch only: nothing
here imports a test framework.
"""

from __future__ import annotations

import torch

from . import cpu_build
from .dispatch import KernelOps, select_kernels

# The largest relative error a kernel may have, by the dtype of its inputs, against a
# reference computed from the same inputs in float32 or wider: a few roundings to that dtype.
TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 2e-3,
                                       torch.bfloat16: 1e-2}


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """‖out − reference‖ / ‖reference‖, in float64.

    Returns inf when ``out`` holds a NaN or an inf anywhere, so that no tolerance passes it.
    """
    if not torch.isfinite(out).all():
        return float("inf")
    reference = reference.double()
    return ((out.double() - reference).norm() / reference.norm()).item()


def kernel_backends(device: torch.device) -> dict[str, KernelOps]:
    """Every backend's kernels on ``device``, by name (``"torch"``, ``"triton"``, and on a
    CPU whose compiler builds it ``"cpu"``).

    Raises:
        ValueError: on a CPU without the Triton interpreter (see ``select_kernels``).
    """
    names = ["torch", "triton"]
    if device.type == "cpu" and cpu_build.available():
        names.append("cpu")
    return {name: select_kernels(name, device) for name in names}
