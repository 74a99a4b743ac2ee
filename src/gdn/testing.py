"""Helpers shared by the test suite and ``gdn check``: error metrics and random inputs (never zeros)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def _relative(x: torch.Tensor, ref: torch.Tensor, size) -> float:
    """``size(x - ref) / size(ref)`` in float64 on the CPU (``size`` of a zero reference taken as 1); NaN/inf in x
    gives inf (never passes)."""
    x64, r64 = x.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    if x64.shape != r64.shape:
        raise AssertionError(f"shape mismatch: {tuple(x64.shape)} vs reference {tuple(r64.shape)}")
    if not torch.isfinite(x64).all():
        return float("inf")
    den = size(r64)
    num = size(x64 - r64)
    return num / den if den > 0 else num


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64; NaN/inf anywhere gives inf (never passes)."""
    return _relative(x, ref, lambda t: t.norm().item())


def max_rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref| / max |ref|`` in float64: catches a few wrong elements that a norm-wise error averages away;
    NaN/inf anywhere gives inf."""
    return _relative(x, ref, lambda t: t.abs().max().item() if t.numel() else 0.0)


def poison_(x: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) so unwritten elements show up."""
    return x.fill_(float("nan"))


@dataclass
class GDNInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor
    a: torch.Tensor
    dt_bias: torch.Tensor
    b: torch.Tensor


def make_inputs(B: int, T: int, H: int, HV: int, K: int, V: int, *, dtype=torch.float32, device="cpu",
                g_range=(-1.0, -0.01), beta_range=(0.0, 1.0), seed: Optional[int] = None,
                normalize_qk: bool = False) -> GDNInputs:
    """Fresh random inputs. g uniform in ``g_range`` (log-space, <= 0), beta uniform in ``beta_range``.

    q/k are scaled so that, without in-kernel L2 norm, |k| is about 1 (keeps the recurrence well-conditioned).
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = rnd(B, T, H, K)
    if normalize_qk:
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
    else:
        q, k = q / K ** 0.5, k / K ** 0.5
    v = rnd(B, T, HV, V)
    lo, hi = g_range
    g = lo + (hi - lo) * torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    blo, bhi = beta_range
    beta = blo + (bhi - blo) * torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    A_log = torch.log(torch.rand(HV, generator=gen, dtype=torch.float64) * 15 + 1)
    a = rnd(B, T, HV)
    dt_bias = rnd(HV) * 0.5
    b = rnd(B, T, HV) * 2
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return GDNInputs(cast(q), cast(k), cast(v), g.to(device=device, dtype=torch.float32 if dtype != torch.float64
                                                    else torch.float64),
                     cast(beta), A_log.to(device=device, dtype=torch.float32), cast(a),
                     dt_bias.to(device=device, dtype=torch.float32), cast(b))


def to64(*xs):
    return [None if x is None else x.detach().to("cpu", torch.float64) for x in xs]
