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


@register
def gates_from_projection_columns(device):
    """The layer's gates (g and beta = sigmoid(b) in one kernel each way) on a and b as column slices of a bf16
    projection output, the backward into a shared gradient buffer's blocks, against float64 autograd."""
    from ..ops._grad_buffer import ColumnGradBuffer
    from ..ops.gate import gdn_gates

    HV, W = 32, 96
    y = (torch.randn(4, 1000, W + 2 * HV, device=device) * 6).to(torch.bfloat16)
    A_log, dt_bias = torch.randn(HV, device=device), torch.randn(HV, device=device)
    leaves = [t.clone().requires_grad_() for t in (y, A_log, dt_bias)]
    gb = ColumnGradBuffer({"z": W, "b": HV, "a": HV})
    zblk = gb.block("z", 4000, torch.bfloat16, device)
    zblk.fill_(3.0)
    b, a = leaves[0][..., W:W + HV], leaves[0][..., W + HV:]
    g, beta = gdn_gates(a, b, leaves[1], leaves[2], grad_buffer=gb)
    dg, dbeta = torch.randn_like(g), torch.randn_like(beta)
    got = torch.autograd.grad((g, beta), (b, a, leaves[1], leaves[2]), (dg, dbeta))
    ref = [t.detach().double().cpu().requires_grad_() for t in (y, A_log, dt_bias)]
    rb, ra = ref[0][..., W:W + HV], ref[0][..., W + HV:]
    gr, betar = gdn_gate_ref(ra, ref[1], ref[2]), rb.sigmoid()
    want = torch.autograd.grad((gr, betar), (rb, ra, ref[1], ref[2]), (dg.double().cpu(), dbeta.double().cpu()))
    res = [Result("gate", "gates g", rel_err(g, gr), 1e-5), Result("gate", "gates beta", rel_err(beta, betar), 1e-2)]
    for name, x, r in zip(("db", "da", "dA_log", "ddt_bias"), got, want):
        res.append(Result("gate", f"gates {name}", rel_err(x, r), 1e-2 if name in ("db", "da") else 1e-5))
    es = zblk.element_size()
    in_buffer = (got[0].data_ptr() == zblk.data_ptr() + W * es and got[1].data_ptr() == zblk.data_ptr() + (W + HV) * es
                 and bool((zblk == 3.0).all()))
    res.append(Result("gate", "gates db / da in the buffer, z block untouched", 0.0 if in_buffer else 1.0, 0.5))
    return res
