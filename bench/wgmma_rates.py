#!/usr/bin/env python3
"""wgmma rates on this GPU (sm_90, Gluon): what a chained-product kernel can reach, apart from its own code.

    PYTHONPATH=src python3 bench/wgmma_rates.py bench/results/wgmma_rates_h200.json

Two kinds of rows, every SM busy (grid = SMs x CTAs per SM):

* ``tput``: each warpgroup issues m64nNk16 bf16 products with A from registers and B from shared memory, four
  accumulating into one accumulator between waits (a GEMM main loop's pattern), for N = 64, 128, 256 and 1-4
  warpgroups per SM: the matrix rate a shape and an occupancy allow.
* ``step``: the segment pass's chain (``gdn.kernels.chunk.hopper_segments``) with nothing else: per step Z^T k^T
  (K 128, N 64), then r Ainv^T (64 x 64), then Z^T <- 0.99 Z^T + d k (K 64, N 128), each waited for before the next
  is issued, its operand converted from the accumulator in registers. ``rows_steps_per_us_per_sm``: state rows
  advanced by one chunk per microsecond per SM, to set against a kernel's own (256 rows per chunk step for the
  segment pass's S^T and M^T).

Timed by ``gdn.benchmark.timing.CudaTimer`` (median per launch; ``results/wgmma_rates_h200.json`` was taken by the
script's first form, the best of five CUDA-event timings after a warm-up launch); the clock is whatever the GPU runs
these at (short, light kernels: near its maximum), so compare rows with each other and a kernel with them only at
equal clocks.
"""
import json
import sys

import torch

from gdn.benchmark.timing import CudaTimer
from gdn.kernels import _gluon_api as G

gluon, gl = G.gluon, G.gl
wmma, wwait, fence, bar = G.warpgroup_mma, G.warpgroup_mma_wait, G.fence_async_shared, G.cta_barrier


@gluon.jit
def _fill(buf, R: gl.constexpr, Cn: gl.constexpr, s: gl.constexpr, num_warps: gl.constexpr):
    """Small nonzero bf16 values into a [R, Cn] shared tile."""
    bl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    r = gl.arange(0, R, layout=gl.SliceLayout(1, bl))
    c = gl.arange(0, Cn, layout=gl.SliceLayout(0, bl))
    buf.store((((r[:, None] * 7 + c[None, :] * s) % 13) * 0.01 - 0.06).to(gl.bfloat16))


@gluon.jit
def _tput(out, ITERS: gl.constexpr, N: gl.constexpr, num_warps: gl.constexpr):
    """ITERS x 4 accumulating [16 num_warps, 64] x [64, N] products, waited for every 4."""
    M: gl.constexpr = 16 * num_warps
    KD: gl.constexpr = 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 16])
    opA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [KD, N], gl.NVMMASharedLayout.get_default_for([KD, N], gl.bfloat16))
    _fill(b_s, KD, N, 3, num_warps)
    fence()
    bar()
    ra = gl.arange(0, M, layout=gl.SliceLayout(1, opA))
    ca = gl.arange(0, KD, layout=gl.SliceLayout(0, opA))
    a = (((ra[:, None] + ca[None, :]) % 5) * 0.01).to(gl.bfloat16)
    acc = gl.zeros([M, N], gl.float32, mma)
    for i in range(ITERS):
        acc = wmma(a, b_s, acc, is_async=True)
        acc = wmma(a, b_s, acc, is_async=True)
        acc = wmma(a, b_s, acc, is_async=True)
        acc = wmma(a, b_s, acc, is_async=True)
        acc = wwait(0, deps=[acc])
    gl.store(out + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _step(out, ITERS: gl.constexpr, num_warps: gl.constexpr):
    """ITERS steps of the segment step's chain on [16 num_warps, 128] rows of Z^T (module docstring)."""
    M: gl.constexpr = 16 * num_warps
    wpc: gl.constexpr = [num_warps, 1]
    m64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=wpc, instr_shape=[16, 64, 16])
    mK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=wpc, instr_shape=[16, 128, 16])
    opK: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mK, k_width=2)
    op6: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=m64, k_width=2)
    k_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [64, 128], k_lay)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16))
    _fill(k_s, 64, 128, 3, num_warps)
    _fill(a_s, 64, 64, 5, num_warps)
    fence()
    bar()
    kt = k_s.permute((1, 0))
    at = a_s.permute((1, 0))
    vr = gl.arange(0, M, layout=gl.SliceLayout(1, mK))
    kc = gl.arange(0, 128, layout=gl.SliceLayout(0, mK))
    st = gl.where(vr[:, None] % 128 == kc[None, :], 1.0, 0.0)
    zero = gl.zeros([M, 64], gl.float32, m64)
    for i in range(ITERS):
        za = gl.convert_layout(st.to(gl.bfloat16), opK)
        kz = wmma(za, kt, zero, use_acc=False, is_async=True)
        kz, za = wwait(0, deps=[kz, za])
        ra = gl.convert_layout((kz * 0.5).to(gl.bfloat16), op6)
        vn = wmma(ra, at, zero, use_acc=False, is_async=True)
        vn, ra = wwait(0, deps=[vn, ra])
        da = gl.convert_layout((vn * 0.25).to(gl.bfloat16), op6)
        st = wmma(da, k_s, st * 0.99, is_async=True)
        st, da = wwait(0, deps=[st, da])
    gl.store(out + gl.program_id(0), gl.sum(gl.sum(st, axis=1), axis=0))


def main():
    """Both kinds of rows, printed and written as JSON to argv[1]."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 8, device="cuda")
    timer = CudaTimer("cuda", target_s=0.1)
    rows = []
    IT = 4000
    for N in (64, 128, 256):
        for nw, per_sm in ((4, 1), (4, 2), (8, 1), (4, 3), (4, 4)):
            g = sms * per_sm
            us = timer.time(lambda i: _tput[(g,)](out, IT, N, num_warps=nw)).median_ms * 1e3
            flop = g * IT * 4 * 2 * (16 * nw) * N * 64
            rows.append(dict(kind="tput", N=N, warps=nw, per_sm=per_sm, us=us, tflops=flop / us / 1e6,
                             ns_per_wgmma_per_cta=us * 1e3 / (IT * 4)))
            print(rows[-1], flush=True)
    IT = 2000
    for nw, per_sm in ((4, 1), (8, 1), (4, 2), (4, 3), (8, 2), (4, 4)):
        g = sms * per_sm
        us = timer.time(lambda i: _step[(g,)](out, IT, num_warps=nw)).median_ms * 1e3
        flop = g * IT * 2 * (16 * nw) * (128 * 64 + 64 * 64 + 64 * 128)
        rows.append(dict(kind="step", warps=nw, per_sm=per_sm, us=us, tflops=flop / us / 1e6,
                         ns_per_step=us * 1e3 / IT, rows_steps_per_us_per_sm=per_sm * 16 * nw * IT / us))
        print(rows[-1], flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
