"""Fused gated RMSNorm (gdn.ops.norm, kernels in gdn.kernels.norm) against float64 autograd of the reference."""
from __future__ import annotations

import pytest
import torch

from gdn.layers.norm import GatedRMSNorm
from gdn.ops.norm import gated_rms_norm
from gdn.reference import gated_rmsnorm_ref
from gdn.testing import rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}




def _ref(x, z, w, eps, dy):
    xs = [None if t is None else t.detach().to("cpu", torch.float64).requires_grad_() for t in (x, z, w)]
    if xs[1] is None:
        y = xs[0] * torch.rsqrt(xs[0].pow(2).mean(-1, keepdim=True) + eps) * xs[2]
    else:
        y = gated_rmsnorm_ref(xs[0], xs[1], xs[2], eps)
    y.backward(dy.detach().cpu().double())
    return [y.detach()] + [None if t is None else t.grad for t in xs]


def _check(x, z, w, eps=1e-6, tol=None):
    for t in (x, z, w):
        if t is not None:
            t.requires_grad_()
    y = gated_rms_norm(x, z, w, eps)
    assert y.shape == x.shape and y.dtype == x.dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, gx, gz, gw = _ref(x, z, w, eps, dy)
    tol = tol or TOL[x.dtype]
    assert rel_err(y, yr) < tol, rel_err(y, yr)
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    assert rel_err(x.grad, gx) < tol, rel_err(x.grad, gx)
    assert rel_err(w.grad, gw) < tol, rel_err(w.grad, gw)
    if z is not None:
        assert z.grad.dtype == z.dtype
        assert rel_err(z.grad, gz) < tol, rel_err(z.grad, gz)


@pytest.mark.parametrize("shape,dtype", [
    ((2, 9, 3, 128), torch.float32), ((37, 200), torch.float32), ((3, 5, 256), torch.bfloat16),
    ((4, 2, 64), torch.float16), ((7, 96), torch.float64),
])
def test_forward_backward(device, nan_empty, shape, dtype):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    z = (torch.randn(shape, device=device) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], device=device)).to(dtype)
    _check(x, z, w)


def test_mixed_dtypes_and_eps(device, nan_empty):
    """bf16 x with fp32 gate and weight; tiny x so eps matters."""
    x = (torch.randn(6, 4, 128, device=device) * 1e-3).to(torch.bfloat16)
    z = torch.randn(6, 4, 128, device=device)
    w = 1 + 0.3 * torch.randn(128, device=device)
    _check(x, z, w, eps=1e-5, tol=1e-2)


def test_no_gate(device, nan_empty):
    x = torch.randn(5, 3, 72, device=device)
    w = 1 + 0.3 * torch.randn(72, device=device)
    _check(x, None, w)


def test_strided_views(device, nan_empty):
    """x, z as head views of packed projections (row strides > N) and a non-flattenable (transposed) view."""
    B, T, HV, V = 2, 5, 3, 64
    proj = torch.randn(B, T, 2 * HV * V + 16, device=device)
    x = proj[..., :HV * V].view(B, T, HV, V)
    z = proj[..., HV * V:2 * HV * V].view(B, T, HV, V)
    w = 1 + 0.3 * torch.randn(V, device=device)
    _check(x.detach(), z.detach(), w)
    xt = torch.randn(T, B, HV, V, device=device).transpose(0, 1)
    zt = torch.randn(T, B, HV, V, device=device).transpose(0, 1)
    _check(xt.detach(), zt.detach(), w.detach().clone())


def test_gradcheck_fp64(device):
    x = torch.randn(3, 2, 8, dtype=torch.float64, device=device, requires_grad=True)
    z = torch.randn(3, 2, 8, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: gated_rms_norm(a, b, c, 1e-6), (x, z, w), fast_mode=True)


def test_module(device):
    m = GatedRMSNorm(128, eps=1e-5, device=device)
    assert m.weight.shape == (128,) and torch.all(m.weight == 1) and m.variance_epsilon == 1e-5
    with torch.no_grad():
        m.weight.mul_(1 + 0.1 * torch.randn(128, device=device))
    x = torch.randn(2, 3, 4, 128, device=device)
    z = torch.randn(2, 3, 4, 128, device=device)
    y = m(x, z)
    assert rel_err(y, gated_rmsnorm_ref(x.double(), z.double(), m.weight.double(), 1e-5)) < 1e-5
    y.sum().backward()
    assert m.weight.grad is not None and m.weight.grad.shape == (128,)


def test_torch_backend(device, monkeypatch):
    x, z = (torch.randn(4, 32, device=device) for _ in range(2))
    w = torch.randn(32, device=device)
    ya = gated_rms_norm(x, z, w)
    monkeypatch.setenv("GDN_BACKEND", "torch")
    yb = gated_rms_norm(x, z, w)
    assert rel_err(ya, yb) < 1e-6


def test_empty(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    y = gated_rms_norm(x, torch.randn(0, 64, device=device), torch.ones(64, device=device))
    assert y.shape == (0, 64)


def test_bad_inputs(device):
    x = torch.randn(4, 16, device=device)
    z = torch.randn(4, 16, device=device)
    w = torch.ones(16, device=device)
    cases = [
        (lambda: gated_rms_norm(x.to(torch.int32), z, w), TypeError, "x"),
        (lambda: gated_rms_norm(x, z[:, :8], w), ValueError, "z"),
        (lambda: gated_rms_norm(x, z.to(torch.int64), w), TypeError, "z"),
        (lambda: gated_rms_norm(x, z, torch.ones(8, device=device)), ValueError, "weight"),
        (lambda: gated_rms_norm(x, z, torch.ones(2, 16, device=device)), ValueError, "weight"),
        (lambda: gated_rms_norm(x, z, torch.empty(16, device="meta")), ValueError, "weight"),
        (lambda: gated_rms_norm(x, z, w, eps=-1.0), ValueError, "eps"),
        (lambda: gated_rms_norm(x, z, w, eps="1e-6"), TypeError, "eps"),
    ]
    for fn, exc, name in cases:
        with pytest.raises(exc) as ei:
            fn()
        assert str(ei.value).split(":")[0] == name, (name, str(ei.value))
