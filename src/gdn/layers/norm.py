"""``GatedRMSNorm``: the output norm of the GDN block (Qwen3-Next's ``RMSNormGated``) on the fused kernels."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.norm import gated_rms_norm


class GatedRMSNorm(nn.Module):
    """``y = x * rsqrt(mean(x^2) + eps) * weight * silu(z)`` over the last dim (per value head: ``hidden_size`` =
    ``head_v_dim``). Weight initialised to ones; output in x's dtype. ``z=None`` gives a plain RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(self.hidden_size, device=device, dtype=dtype))

    @property
    def variance_epsilon(self) -> float:  # the attribute name of Hugging Face's RMSNormGated
        return self.eps

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


__all__ = ["GatedRMSNorm"]
