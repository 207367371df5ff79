"""What the kernel tests share: the backends, the tolerances and the error measure."""

from __future__ import annotations

import torch

from tandem.kernels import TORCH_OPS, select_kernels

# Relative error allowed against a float64 reference, per input dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# On a CPU the Triton kernels run in Triton's interpreter (conftest switches it on).
BACKENDS = {"torch": TORCH_OPS, "triton": select_kernels("triton", torch.device("cpu"))}


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """‖out − reference‖ / ‖reference‖; NaN or inf anywhere in ``out`` fails."""
    assert torch.isfinite(out).all()
    return ((out.double() - reference).norm() / reference.norm()).item()
