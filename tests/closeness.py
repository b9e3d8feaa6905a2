"""Shared assertions of the equivalence tests (fp32 on CPU: docs/DESIGN.md section 4, ~1e-5 relative)."""

import torch

RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|``."""
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    """No NaN in ``a`` and ``rel_err(a, b) < rtol``."""
    assert not torch.isnan(a).any()
    err = rel_err(a, b)
    assert err < rtol, f"relative error {err:.2e}"
