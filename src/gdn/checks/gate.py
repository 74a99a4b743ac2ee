"""gdn check: gdn_gate forward and backward vs float64 autograd."""
import torch

from ..ops import gdn_gate
from ..reference import gdn_gate_ref
from ..testing import rel_err
from . import Result, register


@register
def gate_fwd_bwd(device):
    HV = 32
    a = torch.randn(64, 8, HV, device=device) * 6
    A_log, dt_bias = torch.randn(HV, device=device), torch.randn(HV, device=device)
    leaves = [t.clone().requires_grad_() for t in (a, A_log, dt_bias)]
    g = gdn_gate(*leaves)
    dg = torch.randn_like(g)
    g.backward(dg)
    refs = [t.detach().double().cpu().requires_grad_() for t in (a, A_log, dt_bias)]
    gr = gdn_gate_ref(*refs)
    gr.backward(dg.double().cpu())
    res = [Result("gate", "g", rel_err(g, gr), 1e-5)]
    for name, x, r in zip(("da", "dA_log", "ddt_bias"), leaves, refs):
        res.append(Result("gate", name, rel_err(x.grad, r.grad), 1e-5))
    return res
