"""gdn check: gradients of the chunked op (gdn.kernels.chunk.backward) against float64 autograd of the reference.

Every gradient (q, k, v, g, beta, initial state) of ``chunk_gated_delta_rule_bwd`` -- the backward the op's autograd
Function calls -- is compared with torch autograd through ``chunk_gated_delta_rule_ref`` in float64: fixed-length
batch with GVA, L2 norm, initial state and final-state gradient; a ragged varlen batch (lengths 0, 1, 63, 65, ...);
bf16 and fp32; plus strong decay (g = -30) and, when the public op is differentiable, autograd through it in both
state layouts. CUDA: B=2, T=300, H=2, HV=4, K=V=128; CPU (interpreter): tiny shapes.
"""
from __future__ import annotations

import torch

from ..reference import chunk_gated_delta_rule_ref
from ..testing import make_inputs, rel_err
from . import Result, register

_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
_TOL = {torch.float32: 3e-3, torch.bfloat16: 3e-2}


def _shapes(device):
    if device.type == "cuda":
        return dict(B=2, T=300, H=2, HV=4, K=128, V=128, lens=[0, 1, 63, 65, 300, 129])
    return dict(B=1, T=70, H=1, HV=2, K=16, V=16, lens=[0, 1, 63, 65])


def _ref_grads(q, k, v, g, beta, scale, h0, cu, l2, do, dht, layout="v_last"):
    # float64 on the inputs' device (exact either way; on a GPU this keeps the check to seconds)
    xs = [None if x is None else x.detach().to(torch.float64).requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_gated_delta_rule_ref(*xs[:5], scale, xs[5], True, cu, l2, state_layout=layout)
    outs, grads = [o], [do.detach().to(torch.float64)]
    if dht is not None:
        outs.append(ht)
        grads.append(dht.detach().to(torch.float64))
    torch.autograd.backward(outs, grads)
    return [None if x is None else x.grad for x in xs]


def _case(device, dtype, *, varlen, l2=True, g_range=(-1.0, -0.01)):
    from ..kernels.chunk.backward import chunk_gated_delta_rule_bwd

    s = _shapes(device)
    if varlen:
        cu = torch.tensor([0] + torch.tensor(s["lens"]).cumsum(0).tolist(), dtype=torch.int32, device=device)
        B, T, N = 1, int(cu[-1]), len(s["lens"])
    else:
        cu, B, T, N = None, s["B"], s["T"], s["B"]
    H, HV, K, V = s["H"], s["HV"], s["K"], s["V"]
    x = make_inputs(B, T, H, HV, K, V, dtype=dtype, device=device, g_range=g_range)
    h0 = torch.randn(N, HV, K, V, device=device)
    dht = torch.randn(N, HV, K, V, device=device)
    do = torch.randn(B, T, HV, V, device=device).to(dtype)
    scale = K ** -0.5
    mine = chunk_gated_delta_rule_bwd(x.q, x.k, x.v, x.g, x.beta, scale, h0, cu, 64, l2, do, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, scale, h0, cu, l2, do, dht)
    return mine, ref


def _results(tag, mine, ref, tol, note=""):
    out = []
    for name, a, r in zip(_NAMES, mine, ref):
        if r is None:
            continue
        out.append(Result("chunk_backward", f"{tag} {name}", rel_err(a, r), tol, note))
    return out


@register
def chunk_backward_batch(device):
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        mine, ref = _case(device, dtype, varlen=False)
        out += _results(f"B={_shapes(device)['B']} GVA l2 {str(dtype)[6:]}", mine, ref, _TOL[dtype])
    return out


@register
def chunk_backward_varlen(device):
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        mine, ref = _case(device, dtype, varlen=True, l2=dtype == torch.float32)
        out += _results(f"varlen {str(dtype)[6:]}", mine, ref, _TOL[dtype])
    return out


@register
def chunk_backward_strong_decay(device):
    """g = -30: dg is ~exp(-30) small, so it is measured against the scale of dv instead of its own norm."""
    mine, ref = _case(device, torch.float32, varlen=False, g_range=(-30.0, -30.0))
    out = [r for r in _results("g=-30 fp32", mine, ref, _TOL[torch.float32]) if not r.case.endswith(" dg")]
    dg_err = (mine[3].detach().to(ref[3]) - ref[3]).norm().item() / ref[2].norm().item()
    out.append(Result("chunk_backward", "g=-30 fp32 dg (vs |dv|)", dg_err, 1e-5))
    return out


@register
def chunk_backward_public_op(device):
    """Autograd through gdn.ops.chunk_gated_delta_rule in both state layouts (skipped until it is differentiable)."""
    from ..ops import chunk_gated_delta_rule

    s = _shapes(device)
    out = []
    for layout in ("v_last", "k_last"):
        B, T, H, HV, K, V = s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"]
        x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, device=device)
        shp = (B, HV, K, V) if layout == "v_last" else (B, HV, V, K)
        h0 = torch.randn(shp, device=device)
        dht = torch.randn(shp, device=device)
        do = torch.randn(B, T, HV, V, device=device).to(torch.bfloat16)
        leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta, h0)]
        try:
            o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, state_layout=layout)
        except NotImplementedError:
            return []
        if o.grad_fn is None:
            return []
        torch.autograd.backward([o, ht], [do, dht])
        ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, K ** -0.5, h0, None, True, do, dht, layout=layout)
        out += _results(f"op {layout} bf16", [t.grad for t in leaves], ref, _TOL[torch.bfloat16])
    return out
