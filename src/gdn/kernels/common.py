"""Small Triton helpers shared by the kernel families."""
import torch
import triton
import triton.language as tl

from .launch import gdc_wait, launch


@triton.jit
def softplus(x):
    """torch.nn.functional.softplus with its default threshold 20 (x above it returns x), fp32."""
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))))


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def gdn_gate_value(a, A_log, dt_bias):
    """log-space decay g = -exp(A_log) * softplus(a + dt_bias), fp32."""
    return -tl.exp(A_log) * softplus(a + dt_bias)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement where it may be launched with programmatic dependent launch
    (:func:`gdn.kernels.launch.pdl_args`): with PDL, wait until the kernel before it in the stream has finished and
    its writes are visible (nothing of global memory may be touched before); without (the interpreter, ordinary
    launches), nothing. Gluon kernels call it too (the wait is a Triton builtin both front ends lower; gdn.aot builds
    them on 3.6 and 3.9)."""
    if PDL:
        gdc_wait()


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1). Host code: plain Python, because ``triton.next_power_of_2`` /
    ``triton.cdiv`` are constexpr functions whose host call costs ~5 us each (an import inside every call)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers (see :func:`next_pow2`)."""
    return -(-int(a) // int(b))


def value_heads_per_program(H: int, HV: int, want: int, setting: str) -> int:
    """How many of a q/k head's HV / H value heads one program handles (they share the q/k tiles): ``want`` 0 = all
    of them, else the largest divisor of HV / H not above ``want``. A negative ``want`` raises ValueError naming
    ``setting``."""
    if want < 0:
        raise ValueError(f"{setting}: expected 0 (all value heads of a q/k head) or a positive count, got {want}")
    r = HV // H
    want = want or r
    return max(d for d in range(1, r + 1) if r % d == 0 and d <= want)


@triton.jit
def l2_rnorm_kernel(x, r, n_rows, T, s_b, s_t, s_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                    BR: tl.constexpr):
    """r[b, t, h] = rsqrt(sum_k x[b, t, h, k]^2 + 1e-6) for strided x [B, T, H, K] (last dim contiguous)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m = rows < n_rows
    i_b = rows // (T * H)
    i_t = (rows // H) % T
    i_h = rows % H
    o_k = tl.arange(0, BK)
    b_x = tl.load(x + i_b[:, None] * s_b + i_t[:, None] * s_t + i_h[:, None] * s_h + o_k[None, :],
                  mask=m[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)
    tl.store(r + rows, tl.rsqrt(tl.sum(b_x * b_x, axis=1) + 1e-6), mask=m)


def l2_rnorm(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H] = rsqrt(sum(x^2) + 1e-6) over the last dim of a (strided, last dim contiguous) [B, T, H, K] tensor:
    the L2 row scalings of q or k that the chunk kernels apply after their products. fp32 (fp64 for fp64 x)."""
    B, T, H, K = x.shape
    r = torch.empty(B, T, H, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    n = B * T * H
    if n:
        BR = 32
        launch(l2_rnorm_kernel, (cdiv(n, BR),), x, r, n, T, x.stride(0), x.stride(1), x.stride(2), H=H, K=K,
               BK=next_pow2(max(16, K)), BR=BR, num_warps=4)
    return r
