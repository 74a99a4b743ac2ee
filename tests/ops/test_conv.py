"""causal_conv1d / causal_conv1d_update (gdn.ops.conv, kernels in gdn.kernels.conv) against the float64 reference.

Outputs are allocated through a NaN-filling ``torch.empty`` (fixture ``nan_empty``) so an element a kernel forgets to
write shows up; pool rows no sequence owns are NaN and must stay bit-for-bit untouched.
"""
from __future__ import annotations

import pytest
import torch

from gdn.ops.conv import causal_conv1d, causal_conv1d_update
from gdn.reference import causal_conv1d_ref
from gdn.testing import rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}




def _act(a):
    return "silu" if a else None


def _cu(lengths, device):
    c = [0]
    for L in lengths:
        c.append(c[-1] + L)
    return torch.tensor(c, dtype=torch.int32, device=device)


def _ref(x, w, b, act, cu=None, init=None):
    """float64 reference: (y, finals)."""
    d = lambda t: None if t is None else t.detach().to("cpu", torch.float64)  # noqa: E731
    return causal_conv1d_ref(d(x), d(w), d(b), _act(act), cu_seqlens=None if cu is None else cu.cpu(),
                             initial_conv_state=d(init))


def _pool_ref(x, w, b, act, cu, pool, idx):
    """Reference of the pool semantics: (y64, new_pool64)."""
    N = cu.numel() - 1 if cu is not None else x.shape[0]
    pool64 = pool.detach().to("cpu", torch.float64).clone()
    slots = list(range(N)) if idx is None else [int(i) for i in idx.cpu()]
    W1 = pool.shape[2]
    init = torch.stack([pool64[s] if s >= 0 else torch.zeros(x.shape[-1], W1, dtype=torch.float64) for s in slots])
    y, finals = _ref(x, w, b, act, cu, init)
    spans = [(0, int(cu[n]), int(cu[n + 1])) for n in range(N)] if cu is not None else [(n, 0, x.shape[1])
                                                                                        for n in range(N)]
    for n, (bi, s, e) in enumerate(spans):
        if slots[n] < 0:
            y[bi, s:e] = 0
        else:
            pool64[slots[n]] = finals[n]
    return y, pool64


def _pool(P, D, W, used, dtype, device):
    """Random rows for ``used``, NaN elsewhere."""
    pool = torch.full((P, D, W - 1), float("nan"), dtype=dtype, device=device)
    for r in used:
        pool[r] = torch.randn(D, W - 1, dtype=dtype, device=device)
    return pool


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


def _params(D, W, dtype, device, bias=True):
    w = (torch.randn(D, W, device=device) / W ** 0.5).to(dtype)
    b = (torch.randn(D, device=device) * 0.5).to(dtype) if bias else None
    return w, b


# ----------------------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("W,dtype,act,bias", [
    (4, torch.float32, True, True), (3, torch.float32, False, True), (2, torch.float32, True, False),
    (4, torch.bfloat16, True, True), (1, torch.float32, True, True), (4, torch.float64, False, False),
])
def test_forward_dense(device, nan_empty, W, dtype, act, bias):
    B, T, D = 2, 21, 200
    x = torch.randn(B, T, D, device=device).to(dtype)
    w, b = _params(D, W, dtype, device, bias)
    y = causal_conv1d(x, w, b, _act(act))
    assert y.shape == x.shape and y.dtype == dtype
    yr, _ = _ref(x, w, b, act)
    assert rel_err(y, yr) < TOL[dtype], rel_err(y, yr)


@pytest.mark.parametrize("W", [4, 3])
def test_forward_varlen_no_leakage(device, nan_empty, W):
    lengths = [2, 0, W, 1, 37, W - 1, 0]
    D = 72
    cu = _cu(lengths, device)
    T = int(cu[-1])
    x = torch.randn(1, T, D, device=device)
    w, b = _params(D, W, torch.float32, device)
    y = causal_conv1d(x, w, b, "silu", cu_seqlens=cu.to(torch.int64))
    yr, _ = _ref(x, w, b, True, cu)
    assert rel_err(y, yr) < 1e-5
    # each sequence alone gives the same output (nothing leaks across boundaries)
    for n in range(len(lengths)):
        s, e = int(cu[n]), int(cu[n + 1])
        if e > s:
            ys, _ = _ref(x[:, s:e], w, b, True)
            assert rel_err(y[:, s:e], ys) < 1e-5


@pytest.mark.parametrize("pool_dtype,idx_dtype", [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)])
def test_pool_varlen(device, nan_empty, pool_dtype, idx_dtype):
    W, D, P = 4, 136, 11
    lengths = [5, 1, 0, 2, 37, 3, 4, 9]            # 0, 1, 2, W-1, W, 37 ...
    idx = torch.tensor([7, 2, 9, -1, 0, 5, 10, 3], dtype=idx_dtype, device=device)
    used = [int(i) for i in idx if i >= 0]
    cu = _cu(lengths, device)
    x = torch.randn(1, int(cu[-1]), D, device=device)
    w, b = _params(D, W, torch.float32, device)
    pool = _pool(P, D, W, used, pool_dtype, device)
    yr, pr = _pool_ref(x, w, b, True, cu, pool, idx)
    before = pool.clone()
    y = causal_conv1d(x, w, b, "silu", cu_seqlens=cu, conv_state=pool, conv_state_indices=idx)
    assert rel_err(y, yr) < 1e-5
    assert torch.all(y[0, int(cu[3]):int(cu[4])] == 0)  # padding sequence: zeros
    for r in range(P):
        if r not in used or r == 9:  # unused rows and the row of the length-0 sequence: untouched
            assert torch.equal(_bits(pool[r]), _bits(before[r])), r
        else:
            tol = 0 if pool_dtype == torch.float32 else 1e-2
            assert rel_err(pool[r], pr[r]) <= tol, r


def test_pool_short_sequences_shift_state(device, nan_empty):
    """A sequence shorter than W-1 keeps the tail of the old state: new = (old | x)[-(W-1):]."""
    W, D = 4, 24
    pool = torch.randn(3, D, W - 1, device=device)
    old = pool.clone()
    x = torch.randn(1, 3, D, device=device)
    cu = torch.tensor([0, 1, 3], device=device)
    idx = torch.tensor([2, 0], device=device)
    w, b = _params(D, W, torch.float32, device)
    causal_conv1d(x, w, b, None, cu_seqlens=cu, conv_state=pool, conv_state_indices=idx)
    torch.testing.assert_close(pool[2], torch.cat([old[2][:, 1:], x[0, 0:1].T], 1), rtol=0, atol=0)
    torch.testing.assert_close(pool[0], torch.cat([old[0][:, 2:], x[0, 1:3].T], 1), rtol=0, atol=0)
    torch.testing.assert_close(pool[1], old[1], rtol=0, atol=0)


def test_state_without_indices_dense(device, nan_empty):
    B, T, D, W = 3, 6, 40, 3
    x = torch.randn(B, T, D, device=device)
    w, b = _params(D, W, torch.float32, device)
    st = torch.randn(B, D, W - 1, device=device)
    yr, pr = _pool_ref(x, w, b, True, None, st, None)
    y = causal_conv1d(x, w, b, "swish", conv_state=st)
    assert rel_err(y, yr) < 1e-5
    assert rel_err(st, pr) == 0


def test_prefill_then_update_equals_one_conv(device, nan_empty):
    """prefill (varlen, pool) + decode steps (T=1, [N, D]) + a verify step (T=3) == one conv over everything."""
    W, D, P = 4, 48, 6
    N = 3
    pre_len = [5, 1, 11]
    steps = [1, 1, 3, 1]
    idx = torch.tensor([4, 0, 2], device=device)
    w, b = _params(D, W, torch.float32, device)
    pool = _pool(P, D, W, idx.tolist(), torch.float32, device)
    init = pool[idx].clone()
    total = [L + sum(steps) for L in pre_len]
    xs = [torch.randn(L, D, device=device) for L in total]

    cu = _cu(pre_len, device)
    xp = torch.cat([xs[n][:pre_len[n]] for n in range(N)])[None]
    outs = [[] for _ in range(N)]
    yp = causal_conv1d(xp, w, b, "silu", cu_seqlens=cu, conv_state=pool, conv_state_indices=idx)
    for n in range(N):
        outs[n].append(yp[0, int(cu[n]):int(cu[n + 1])])
    pos = list(pre_len)
    for t in steps:
        xt = torch.stack([xs[n][pos[n]:pos[n] + t] for n in range(N)])  # [N, t, D]
        if t == 1:
            yt = causal_conv1d_update(xt[:, 0], pool, w, b, "silu", conv_state_indices=idx)
            assert yt.shape == (N, D)
            yt = yt[:, None]
        else:
            yt = causal_conv1d_update(xt, pool, w, b, "silu", conv_state_indices=idx)
        for n in range(N):
            outs[n].append(yt[n])
            pos[n] += t
    for n in range(N):
        y_all = torch.cat(outs[n])
        yr, fin = _ref(xs[n][None], w, b, True, None, init[n:n + 1])
        assert rel_err(y_all, yr[0]) < 1e-5
        assert rel_err(pool[idx[n]], fin[0]) == 0


@pytest.mark.parametrize("W,T", [(3, 2), (2, 1), (3, 1), (4, 1)])   # T = 1: the decode-step kernel
def test_update_padding_and_untouched_rows(device, nan_empty, W, T):
    D, P, N = 200, 7, 5
    idx = torch.tensor([3, -1, 0, 6, -1], dtype=torch.int32, device=device)
    pool = _pool(P, D, W, [3, 0, 6], torch.bfloat16, device)
    before = pool.clone()
    x = torch.randn(N, T, D, device=device).to(torch.bfloat16)
    w, b = _params(D, W, torch.bfloat16, device)
    yr, pr = _pool_ref(x, w, b, True, None, pool, idx)
    y = causal_conv1d_update(x, pool, w, b, "silu", conv_state_indices=idx)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, yr) < 1e-2
    assert torch.all(y[1] == 0) and torch.all(y[4] == 0)
    for r in (1, 2, 4, 5):
        assert torch.equal(_bits(pool[r]), _bits(before[r]))
    for r in (3, 0, 6):
        assert rel_err(pool[r], pr[r]) == 0  # copies of bf16 inputs / old state


def test_update_channel_contiguous_pool_and_strided_x(device, nan_empty):
    """A pool stored [P, W-1, D] and passed as its [P, D, W-1] transpose (vLLM's layout), x a slice of a wider
    projection: both read and written in place through their strides."""
    W, D, P, N = 4, 40, 6, 3
    buf = torch.randn(P, W - 1, D, device=device)
    pool = buf.transpose(1, 2)
    assert pool.stride(1) == 1
    proj = torch.randn(N, D + 24, device=device)
    x = proj[:, 8:8 + D]
    idx = torch.tensor([5, 1, -1], device=device)
    w, b = _params(D, W, torch.float32, device)
    yr, pr = _pool_ref(x[:, None], w, b, True, None, pool, idx)
    y = causal_conv1d_update(x, pool, w, b, conv_state_indices=idx)
    assert rel_err(y, yr[:, 0]) < 1e-5 and rel_err(buf.transpose(1, 2), pr) == 0


def test_out_of_range_index_is_padding_without_checks(device, nan_empty, monkeypatch):
    """With host-side checks skipped (as under CUDA-graph capture) an out-of-range index acts as padding."""
    monkeypatch.setenv("GDN_SKIP_VALUE_CHECKS", "1")
    W, D, P = 4, 32, 3
    pool = torch.randn(P, D, W - 1, device=device)
    before = pool.clone()
    x = torch.randn(2, D, device=device)
    w, b = _params(D, W, torch.float32, device)
    y = causal_conv1d_update(x, pool, w, b, conv_state_indices=torch.tensor([7, 1], device=device))
    assert torch.all(y[0] == 0)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])
    assert not torch.equal(pool[1], before[1])


def test_strided_packed_input(device, nan_empty):
    """x = a channel slice of a packed [B, T, 300] projection (row stride 300), dense and varlen, with grads."""
    W, D = 4, 200
    packed = torch.randn(2, 19, 300, device=device)
    x = packed[..., 40:240]
    assert not x.is_contiguous() and x.stride(-1) == 1
    w, b = _params(D, W, torch.float32, device)
    y = causal_conv1d(x, w, b)
    yr, _ = _ref(x.contiguous(), w, b, True)
    assert rel_err(y, yr) < 1e-5
    xv = packed[:1, :, 40:240]
    cu = _cu([7, 12], device)
    pool = torch.randn(2, D, W - 1, device=device)
    yr, pr = _pool_ref(xv.contiguous(), w, b, True, cu, pool, None)
    y = causal_conv1d(xv, w, b, cu_seqlens=cu, conv_state=pool)
    assert rel_err(y, yr) < 1e-5 and rel_err(pool, pr) == 0


def test_empty_inputs(device):
    W, D = 4, 16
    w, b = _params(D, W, torch.float32, device)
    assert causal_conv1d(torch.randn(2, 0, D, device=device), w, b).shape == (2, 0, D)
    pool = torch.randn(2, D, W - 1, device=device)
    before = pool.clone()
    y = causal_conv1d(torch.randn(1, 0, D, device=device), w, b, cu_seqlens=torch.tensor([0, 0, 0], device=device),
                      conv_state=pool)
    assert y.shape == (1, 0, D) and torch.equal(pool, before)


def test_wide_kernel_falls_back(device):
    """Widths above the kernels' 4 run the reference path with the same pool semantics."""
    W, D = 6, 8
    x = torch.randn(1, 9, D, device=device)
    w, b = _params(D, W, torch.float32, device)
    pool = torch.randn(3, D, W - 1, device=device)
    cu = _cu([2, 7], device)
    idx = torch.tensor([2, 0], device=device)
    yr, pr = _pool_ref(x, w, b, True, cu, pool, idx)
    y = causal_conv1d(x, w, b, cu_seqlens=cu, conv_state=pool, conv_state_indices=idx)
    assert rel_err(y, yr) < 1e-5 and rel_err(pool, pr) < 1e-6


def test_torch_backend_same_semantics(device, monkeypatch):
    W, D, P = 3, 24, 5
    lengths = [3, 1, 6]
    cu = _cu(lengths, device)
    x = torch.randn(1, 10, D, device=device)
    w, b = _params(D, W, torch.float32, device)
    idx = torch.tensor([4, -1, 1], device=device)
    pool_a = torch.randn(P, D, W - 1, device=device)
    pool_b = pool_a.clone()
    ya = causal_conv1d(x, w, b, cu_seqlens=cu, conv_state=pool_a, conv_state_indices=idx)
    monkeypatch.setenv("GDN_BACKEND", "torch")
    yb = causal_conv1d(x, w, b, cu_seqlens=cu, conv_state=pool_b, conv_state_indices=idx)
    assert rel_err(ya, yb) < 1e-6 and torch.equal(pool_a, pool_b)


# ----------------------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------------------
def _grads_ref(x, w, b, act, dy, cu=None, init=None):
    xs = [None if t is None else t.detach().to("cpu", torch.float64).requires_grad_() for t in (x, w, b)]
    y, _ = causal_conv1d_ref(xs[0], xs[1], xs[2], _act(act), cu_seqlens=None if cu is None else cu.cpu(),
                             initial_conv_state=None if init is None else init.detach().cpu().double())
    y.backward(dy.detach().cpu().double())
    return [None if t is None else t.grad for t in xs]


@pytest.mark.parametrize("W,act,bias,varlen", [(4, True, True, True), (3, False, True, False), (2, True, False, True)])
def test_backward_fp32(device, nan_empty, W, act, bias, varlen):
    D = 200
    if varlen:
        cu = _cu([1, 0, 37, W - 1, W, 2], device)
        x = torch.randn(1, int(cu[-1]), D, device=device)
    else:
        cu = None
        x = torch.randn(2, 23, D, device=device)
    w, b = _params(D, W, torch.float32, device, bias)
    x.requires_grad_()
    w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    y = causal_conv1d(x, w, b, _act(act), cu_seqlens=cu)
    dy = torch.randn_like(y)
    y.backward(dy)
    gx, gw, gb = _grads_ref(x, w, b, act, dy, cu)
    assert rel_err(x.grad, gx) < 1e-5
    assert rel_err(w.grad, gw) < 1e-5
    if b is not None:
        assert rel_err(b.grad, gb) < 1e-5


def test_backward_bf16_strided(device, nan_empty):
    W, D = 4, 96
    packed = torch.randn(2, 21, 160, device=device).to(torch.bfloat16)
    x = packed[..., 32:128].detach().requires_grad_()
    w, b = _params(D, W, torch.bfloat16, device)
    w.requires_grad_()
    b.requires_grad_()
    y = causal_conv1d(x, w, b)
    dy = torch.randn_like(y)
    y.backward(dy)
    gx, gw, gb = _grads_ref(x, w, b, True, dy)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert rel_err(x.grad, gx) < 1e-2 and rel_err(w.grad, gw) < 1e-2 and rel_err(b.grad, gb) < 1e-2


def test_backward_with_pool_state(device, nan_empty):
    """Gradients (x, weight, bias) with initial states read from a pool that the forward overwrote."""
    W, D, P = 4, 40, 5
    cu = _cu([2, 9, 0, 5], device)
    idx = torch.tensor([3, 0, 1, -1], device=device)
    pool = torch.randn(P, D, W - 1, device=device)
    init = torch.stack([pool[i] if i >= 0 else torch.zeros(D, W - 1, device=device) for i in idx.tolist()])
    x = torch.randn(1, 16, D, device=device, requires_grad=True)
    w, b = _params(D, W, torch.float32, device)
    w.requires_grad_()
    b.requires_grad_()
    y = causal_conv1d(x, w, b, cu_seqlens=cu, conv_state=pool, conv_state_indices=idx)
    dy = torch.randn_like(y)
    dy[0, 11:] = 0  # the padding sequence's output is a constant
    y.backward(dy)
    gx, gw, gb = _grads_ref(x, w, b, True, dy, cu, init)
    assert rel_err(x.grad, gx) < 1e-5 and rel_err(w.grad, gw) < 1e-5 and rel_err(b.grad, gb) < 1e-5


def test_gradcheck_fp64(device):
    W, D = 3, 3
    cu = torch.tensor([0, 2, 2, 6], device=device)
    x = torch.randn(1, 6, D, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(D, W, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(D, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c, d: causal_conv1d(a, c, d, cu_seqlens=cu), (x, w, b),
                                     fast_mode=True)


# ----------------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------------
def _bad_cases(device):
    D, W, P = 8, 4, 3
    x = torch.randn(1, 5, D, device=device)
    w = torch.randn(D, W, device=device)
    b = torch.randn(D, device=device)
    pool = torch.randn(P, D, W - 1, device=device)
    cu = torch.tensor([0, 2, 5], device=device)
    idx = torch.tensor([0, 2], device=device)
    meta_w = torch.empty(D, W, device="meta")
    fwd = lambda **kw: dict(dict(x=x, weight=w, bias=b, cu_seqlens=cu, conv_state=pool,  # noqa: E731
                                 conv_state_indices=idx), **kw)
    return pool, [
        (fwd(x=x[0]), ValueError, "x"),
        (fwd(x=x.to(torch.int32)), TypeError, "x"),
        (fwd(x=x.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "x"),
        (fwd(weight=w[:, :, None]), ValueError, "weight"),
        (fwd(weight=torch.randn(D + 1, W, device=device)), ValueError, "weight"),
        (fwd(weight=w.to(torch.int64)), TypeError, "weight"),
        (fwd(weight=meta_w), ValueError, "weight"),
        (fwd(bias=torch.randn(D - 1, device=device)), ValueError, "bias"),
        (fwd(activation="relu"), ValueError, "activation"),
        (fwd(x=torch.randn(2, 5, D, device=device)), ValueError, "cu_seqlens"),
        (fwd(cu_seqlens=torch.tensor([0, 2, 4], device=device)), ValueError, "cu_seqlens"),
        (fwd(cu_seqlens=torch.tensor([0., 2., 5.], device=device)), TypeError, "cu_seqlens"),
        (fwd(conv_state=torch.randn(P, D, W, device=device)), ValueError, "conv_state"),
        (fwd(conv_state=torch.randn(P, D + 1, W - 1, device=device)), ValueError, "conv_state"),
        (fwd(conv_state=pool[0]), ValueError, "conv_state"),
        (fwd(conv_state_indices=torch.tensor([0, 3], device=device)), ValueError, "conv_state_indices"),
        (fwd(conv_state_indices=torch.tensor([0, -2], device=device)), ValueError, "conv_state_indices"),
        (fwd(conv_state_indices=torch.tensor([0, 1, 2], device=device)), ValueError, "conv_state_indices"),
        (fwd(conv_state_indices=torch.tensor([0., 1.], device=device)), TypeError, "conv_state_indices"),
        (fwd(conv_state_indices=None), ValueError, "conv_state"),  # 3 rows for 2 sequences
        (fwd(conv_state=None), ValueError, "conv_state_indices"),
    ]


def test_bad_inputs_raise_and_leave_pool_untouched(device):
    pool, cases = _bad_cases(device)
    before = pool.clone()
    for kw, exc, name in cases:
        kw = dict(kw)
        activation = kw.pop("activation", "silu")
        with pytest.raises(exc) as ei:
            causal_conv1d(kw.pop("x"), kw.pop("weight"), kw.pop("bias"), activation, **kw)
        assert str(ei.value).split(":")[0] == name, (name, str(ei.value))
        assert torch.equal(pool, before)


def test_update_bad_inputs(device):
    D, W, P = 8, 4, 3
    pool = torch.randn(P, D, W - 1, device=device)
    before = pool.clone()
    w = torch.randn(D, W, device=device)
    x = torch.randn(2, D, device=device)
    idx = torch.tensor([0, 2], device=device)
    cases = [
        (lambda: causal_conv1d_update(x[None, None], pool, w, conv_state_indices=idx), ValueError, "x"),
        (lambda: causal_conv1d_update(x, None, w, conv_state_indices=idx), TypeError, "conv_state"),
        (lambda: causal_conv1d_update(x, pool[:, :, :2], w, conv_state_indices=idx), ValueError, "conv_state"),
        (lambda: causal_conv1d_update(x, pool, w[:4], conv_state_indices=idx), ValueError, "weight"),
        (lambda: causal_conv1d_update(x, pool, w, conv_state_indices=idx + 1), ValueError, "conv_state_indices"),
        (lambda: causal_conv1d_update(x, pool, w), ValueError, "conv_state"),
        (lambda: causal_conv1d_update(x, pool, w, activation="gelu", conv_state_indices=idx), ValueError,
         "activation"),
    ]
    for fn, exc, name in cases:
        with pytest.raises(exc) as ei:
            fn()
        assert str(ei.value).split(":")[0] == name, (name, str(ei.value))
        assert torch.equal(pool, before)
