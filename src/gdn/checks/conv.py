"""gdn check: causal_conv1d (dense, varlen + pool, backward) and causal_conv1d_update (decode, verify) vs the float64
reference. Tiny shapes on CPU (Triton interpreter); on CUDA the Qwen3-Next layer's conv: D = 2*16*128 + 32*128 = 8192
channels, W = 4, 4 x 4096 tokens."""
from __future__ import annotations

import torch

from ..ops.conv import causal_conv1d, causal_conv1d_update
from ..reference import causal_conv1d_ref
from ..testing import rel_err
from . import Result, register

OP = "conv"


def _shapes(device):
    if device.type == "cuda":
        return dict(D=8192, B=4, T=4096, lengths=[1, 3, 4, 5, 777, 4096, 3000, 8000 - 3886], N_dec=256, P=512,
                    B_bwd=2, T_bwd=2048)
    return dict(D=72, B=2, T=21, lengths=[1, 3, 4, 5, 0, 37], N_dec=5, P=9, B_bwd=2, T_bwd=19)


def _ref_pool(x, w, b, cu, pool, idx):
    """(y64, new_pool64) of the pool semantics on the reference (on x's device, float64)."""
    N = cu.numel() - 1 if cu is not None else x.shape[0]
    slots = idx.tolist()
    pool64 = pool.to(torch.float64)
    init = torch.stack([pool64[s] if s >= 0 else torch.zeros_like(pool64[0]) for s in slots])
    y, fin = causal_conv1d_ref(x.double(), w.double(), None if b is None else b.double(), "silu", cu_seqlens=cu,
                               initial_conv_state=init)
    spans = ([(0, int(cu[n]), int(cu[n + 1])) for n in range(N)] if cu is not None
             else [(n, 0, x.shape[1]) for n in range(N)])
    for n, (bi, s, e) in enumerate(spans):
        if slots[n] < 0:
            y[bi, s:e] = 0
        else:
            pool64[slots[n]] = fin[n]
    return y, pool64


@register
def conv_forward(device):
    s = _shapes(device)
    D, W = s["D"], 4
    x = torch.randn(s["B"], s["T"], D, device=device).to(torch.bfloat16)
    w = (torch.randn(D, W, device=device) / 2).to(torch.bfloat16)
    y = causal_conv1d(x, w, None, "silu")
    yr, _ = causal_conv1d_ref(x.double(), w.double(), None, "silu")
    res = [Result(OP, f"fwd bf16 B={s['B']} T={s['T']} D={D}", rel_err(y, yr), 1e-2)]
    del y, yr

    # varlen prefill with a bf16 pool, a padding sequence and int32 indices
    lengths = s["lengths"]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    N = len(lengths)
    P = s["P"]
    perm = torch.randperm(P)[:N].tolist()
    perm[1] = -1
    idx = torch.tensor(perm, dtype=torch.int32, device=device)
    pool = torch.randn(P, D, W - 1, device=device).to(torch.bfloat16)
    xv = torch.randn(1, int(cu[-1]), D, device=device).to(torch.bfloat16)
    b = torch.randn(D, device=device).to(torch.bfloat16)
    yr, pr = _ref_pool(xv, w, b, cu, pool, idx)
    y = causal_conv1d(xv, w, b, "silu", cu_seqlens=cu, conv_state=pool, conv_state_indices=idx)
    res.append(Result(OP, f"varlen+pool bf16 N={N} T={int(cu[-1])}", rel_err(y, yr), 1e-2))
    res.append(Result(OP, "varlen+pool new states", rel_err(pool, pr), 1e-2))
    return res


@register
def conv_update(device):
    s = _shapes(device)
    D, W, P, N = s["D"], 4, s["P"], s["N_dec"]
    w = (torch.randn(D, W, device=device) / 2).to(torch.bfloat16)
    res = []
    for T in (1, 4):
        perm = torch.randperm(P)[:N]
        perm[::7] = -1
        idx = perm.to(device)
        pool = torch.randn(P, D, W - 1, device=device).to(torch.bfloat16)
        x = torch.randn(N, T, D, device=device).to(torch.bfloat16)
        yr, pr = _ref_pool(x, w, None, None, pool, idx)
        y = causal_conv1d_update(x[:, 0] if T == 1 else x, pool, w, None, "silu", conv_state_indices=idx)
        res.append(Result(OP, f"update bf16 N={N} T={T}", rel_err(y.reshape(N, T, D), yr), 1e-2))
        res.append(Result(OP, f"update T={T} new states", rel_err(pool, pr), 1e-2))
    return res


@register
def conv_backward(device):
    s = _shapes(device)
    D, W = s["D"], 4
    res = []
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        x = torch.randn(s["B_bwd"], s["T_bwd"], D, device=device).to(dtype).requires_grad_()
        w = (torch.randn(D, W, device=device) / 2).to(dtype).requires_grad_()
        b = torch.randn(D, device=device).to(dtype).requires_grad_()
        y = causal_conv1d(x, w, b, "silu")
        dy = torch.randn_like(y)
        y.backward(dy)
        del y
        refs = [t.detach().double().requires_grad_() for t in (x, w, b)]
        yr, _ = causal_conv1d_ref(*refs, "silu")
        yr.backward(dy.double())
        del yr
        name = str(dtype).replace("torch.", "")
        for g, t, r in zip(("dx", "dweight", "dbias"), (x, w, b), refs):
            res.append(Result(OP, f"bwd {name} {g}", rel_err(t.grad, r.grad), tol))
    return res
