#!/usr/bin/env python3
"""Compile the Gluon sm_90 kernels for Hopper on a machine without a GPU (ptxas from the Triton wheel) and print
registers, spills, shared memory and the main loop's instruction sequence. ``python3 bench/aot_sm90.py``."""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402


def compile_gluon(kernel, args: dict, constexprs: dict, num_warps=4):
    fn = kernel
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in constexprs:
            sig[n] = "constexpr"
            consts[(i,)] = constexprs[n]
            continue
        val = args[n]
        if isinstance(val, torch.Tensor):
            sig[n] = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                            torch.int32: "i32", torch.int64: "i64"}[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, bool):
            sig[n] = "i1"
        elif isinstance(val, int):
            sig[n] = "i32"
        elif isinstance(val, float):
            sig[n] = "fp32"
        else:
            sig[n] = mangle_type(val)
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def state_pass(K=128, V=128, BV=64, NS=2, dt=torch.bfloat16, from_ainv=True):
    from gdn.kernels.chunk import hopper as m
    B, T, H, HV = 1, 256, 2, 4
    k = torch.empty(B, T, H, K, dtype=dt)
    v = torch.empty(B, T, HV, V, dtype=dt)
    ainv = torch.empty(B, T, HV, 64, dtype=dt)
    h = torch.empty(8, HV, K, V, dtype=dt)
    dn = m._GL_DT[dt]
    f32 = torch.empty(4, dtype=torch.float32)
    i32 = torch.empty(4, dtype=torch.int32)
    args = dict(k_desc=m._desc(m._rows2d(k), (64, K), dn), v_desc=m._desc(m._rows2d(v), (64, BV), dn),
                a_desc=(m._desc(ainv.reshape(B * T, HV * 64), (64, 64), dn) if from_ainv else
                        m._desc(k.new_empty(B * T, HV * K), (64, K), dn)), h_desc=m._desc(h.view(-1, V), (K, BV), dn),
                beta=torch.empty(4, dtype=dt), gcum=f32, rk_in=f32, vnew=torch.empty(4, dtype=dt), h0=f32, ht=f32,
                h0_idx=i32, ht_idx=i32, segments=i32, cu_seqlens=i32, chunk_offsets=i32, T=T, P0=3, P1=3,
                s_bb=3, s_bt=3, s_bh=1, s0n=3, s0h=3, s0k=3, s0v=1, s1n=3, s1h=3, s1k=3, s1v=1)
    cx = dict(H=H, HV=HV, K=K, V=V, BV=BV, USE_L2=True, IS_VARLEN=True, INIT=1, H0_BY_SEG=False, H0_INDEXED=True,
              STORE_H=True, STORE_VNEW=True, STORE_FINAL=True, HT_BY_SEG=False, HT_INDEXED=True, NS=NS,
              FROM_AINV=from_ainv, num_warps=4)
    return compile_gluon(m._state_pass_sm90_kernel, args, cx)


def report(c, name):
    try:
        sys.path.insert(0, os.path.dirname(__file__))
        from aot_regs import _cuobjdump, sass_sequence
        res = [ln.strip() for ln in _cuobjdump(c, "-res-usage").splitlines() if "REG:" in ln]
        print(f"{name}: {res[0].split(' TEXTURE')[0] if res else '?'}, {c.metadata.shared} B shared")
        print("   ", sass_sequence(c, loop_only=True))
    except Exception as e:  # noqa: BLE001
        print("(no SASS sequence:", e, ")")


if __name__ == "__main__":
    for bv, ns, fa in ((64, 2, True), (64, 3, True), (32, 2, True), (16, 2, True), (64, 2, False), (32, 2, False)):
        report(state_pass(BV=bv, NS=ns, from_ainv=fa), f"state pass sm90 BV={bv} NS={ns} {'ainv' if fa else 'wu'}")
