#!/usr/bin/env python3
"""sm_90 builds of the chunked op's sequential kernels without a GPU: registers, spills, shared memory and the SASS
instruction sequence (barriers, stores, waits between the tensor-core products) per configuration.

    python3 bench/aot_chunk.py [--stages 2,3] [--seq]

Rows: the forward state pass (``_chunk_state_kernel``, ainv and w/u modes), its Gluon Hopper form
(``gdn.kernels.chunk.hopper``, ainv and w/u modes, V tiles 32 and 64; the depth of its TMA ring = the stages) and the
backward's reverse pass (``chunk_bwd_dh_kernel``) at 1x32768 16/32 (K = V = 128, bf16, L2 norm, BV 64) for each
pipelining depth. How to read the sequence: ``bench/NOTES.md`` (chunked kernels: design, resources).
"""
import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from aot_regs import aot_compile, resource_usage, sass_sequence  # noqa: E402
from gdn.aot import compile_hopper_state_pass  # noqa: E402

BF, F32, I32 = (torch.empty(1, dtype=d) for d in (torch.bfloat16, torch.float32, torch.int32))
T, H, HV, K, V, BV = 32768, 16, 32, 128, 128, 64


def state_pass(from_ainv: bool, stages: int):
    from gdn.kernels.chunk import state as cf

    args = dict(k=BF, v=BF, beta=BF, ainv=BF, w=BF, u=BF, gcum=F32, rk_in=F32, h_out=BF, vnew=BF, h0=F32, ht=F32,
                h0_idx=I32, ht_idx=I32, segments=I32, chunk_offsets=I32, cu_seqlens=I32,
                T=T, P0=1, P1=1, NV=2, s_kb=T * H * K, s_kt=H * K, s_kh=K, s_vb=T * HV * V,
                s_vt=HV * V, s_vh=V, s_bb=T * HV, s_bt=HV, s_bh=1, s0n=HV * K * V, s0h=K * V, s0k=V, s0v=1,
                s1n=HV * K * V, s1h=K * V, s1k=V, s1v=1, ck_pool=None, ck_idx=None, P2=0, CK_E=1, CK_C=0, s_ckn=0,
                s2n=0, s2h=0, s2k=0, s2v=0)
    ce = dict(CKPT=False, H=H, HV=HV, K=K, V=V, KP=K, BV=BV, USE_L2=True, IS_VARLEN=False, FROM_AINV=from_ainv, INIT=1,
              H0_BY_SEG=False, H0_INDEXED=False, HAS_U=True, STORE_H=True, STORE_VNEW=True, STORE_FINAL=True,
              HT_BY_SEG=False, HT_INDEXED=False, DT=tl.bfloat16, PREC="tf32x3",
              SPLIT_H=False)
    return aot_compile(cf._chunk_state_kernel, args, ce, num_warps=4, num_stages=stages)


def reverse_pass(stages: int):
    from gdn.kernels.chunk.backward import reverse as cb

    args = dict(q=BF, k=BF, w=BF, gcum=F32, do=BF, rq=F32, rk=F32, x0=F32, xend=F32, gs=BF, dvn=BF, segments=I32,
                chunk_offsets=I32, cu_seqlens=None, scale=1.0, T=T, s_qb=T * H * K, s_qt=H * K, s_qh=K,
                s_kb=T * H * K, s_kt=H * K, s_kh=K, s_ob=T * HV * V, s_ot=HV * V, s_oh=V)
    ce = dict(H=H, HV=HV, K=K, VC=V, C=64, BK=K, BV=BV, VARLEN=False, L2NORM=True, INIT=2, HAS_R=True,
              STORE_STEPS=True, STORE_END=False, END_BY_SEG=True, ACC=tl.float32, MM=tl.bfloat16, PREC="ieee")
    return aot_compile(cb.chunk_bwd_dh_kernel, args, ce, num_warps=4, num_stages=stages)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="2,3")
    p.add_argument("--seq", action="store_true", help="print the SASS instruction sequence of every build's main loop")
    a = p.parse_args()
    for st in (int(x) for x in a.stages.split(",")):
        builds = [(f"state pass {'ainv' if fa else 'w/u'}", lambda fa=fa, st=st: state_pass(fa, st))
                  for fa in (True, False)]
        builds += [(f"hopper state pass {'ainv' if fa else 'w/u'} BV {bv}",
                    lambda fa=fa, bv=bv, st=st: compile_hopper_state_pass(BV=bv, NS=st, from_ainv=fa))
                   for fa in (True, False) for bv in (32, 64)]
        builds.append(("reverse pass", lambda st=st: reverse_pass(st)))
        for name, build in builds:
            c = build()
            r = resource_usage(c)
            seq = sass_sequence(c, loop_only=True)
            print(f"{name:32s} stages {st}  regs {r['regs']:3d}  spill {r['stack']:4d} B  shared {r['shared']:6d} B"
                  f"  loop: barriers {sum(int(x.split('x')[-1]) for x in seq.split() if x.startswith('BAR.SYNC'))}",
                  flush=True)
            if a.seq:
                print("   ", seq)


if __name__ == "__main__":
    main()
