"""gdn check: fused gated RMSNorm forward and backward vs float64 autograd of the reference (per value head:
rows = B*T*HV, N = head_v_dim = 128 on CUDA)."""
from __future__ import annotations

import torch

from ..ops.norm import gated_rms_norm
from ..reference import gated_rmsnorm_ref
from ..testing import rel_err
from . import Result, register

OP = "norm"


@register
def gated_rmsnorm_fwd_bwd(device):
    shape = (4, 4096, 32, 128) if device.type == "cuda" else (2, 5, 4, 64)
    res = []
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        x = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
        z = torch.randn(shape, device=device).to(dtype).requires_grad_()
        w = (1 + 0.2 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
        y = gated_rms_norm(x, z, w, 1e-6)
        dy = torch.randn_like(y)
        y.backward(dy)
        refs = [t.detach().double().requires_grad_() for t in (x, z, w)]
        yr = gated_rmsnorm_ref(*refs, 1e-6)
        yr.backward(dy.double())
        name = str(dtype).replace("torch.", "")
        res.append(Result(OP, f"fwd {name} {tuple(shape)}", rel_err(y, yr), tol))
        del y, yr
        for g, t, r in zip(("dx", "dz", "dweight"), (x, z, w), refs):
            res.append(Result(OP, f"bwd {name} {g}", rel_err(t.grad, r.grad), tol))
    return res
