#!/usr/bin/env python3
"""Time the chunked forward's sequential state pass, portable Triton vs the Gluon sm_90 form, per chunk step, and
the whole forward with each (bf16, K = V = 128, L2 norm, final state, varlen B = 1). GPU only.

    python3 bench/sm90_state.py [--out results.json]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402

from gdn.kernels import chunk as cf  # noqa: E402
from gdn.kernels.common import l2_rnorm  # noqa: E402
from gdn.kernels.tuning import override  # noqa: E402
from gdn.ops import chunk_gated_delta_rule  # noqa: E402

SHAPES = [(1, 8192, 16, 32), (1, 32768, 16, 32), (4, 4096, 16, 32), (1, 65536, 2, 8), (1, 32768, 64, 64)]


def inputs(N, L, H, HV, K=128, V=128, dt=torch.bfloat16):
    T = N * L
    q = torch.randn(1, T, H, K, device="cuda", dtype=dt)
    k = torch.randn(1, T, H, K, device="cuda", dtype=dt)
    v = torch.randn(1, T, HV, V, device="cuda", dtype=dt)
    g = -torch.rand(1, T, HV, device="cuda") * 0.1
    beta = torch.rand(1, T, HV, device="cuda", dtype=dt)
    cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int32)
    return q, k, v, g, beta, cu


VARIANTS = {
    "portable": dict(state_sm90=False),
    "sm90-auto": dict(state_sm90=True),
    "sm90": dict(state_sm90=True, state_sm90_BV=64, state_sm90_stages=2),
    "sm90-ns3": dict(state_sm90=True, state_sm90_BV=64, state_sm90_stages=3),
    "sm90-bv32": dict(state_sm90=True, state_sm90_BV=32, state_sm90_stages=2),
    "sm90-bv16": dict(state_sm90=True, state_sm90_BV=16, state_sm90_stages=2),
    "portable-wu": dict(state_sm90=False, state_mode="wu"),
    "sm90-wu": dict(state_sm90=True, state_sm90_BV=64, state_mode="wu"),
    "sm90-wu-bv32": dict(state_sm90=True, state_sm90_BV=32, state_mode="wu"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=None, help="indices into SHAPES, e.g. 0,2")
    a = ap.parse_args()
    names = a.variants.split(",")
    shapes = SHAPES if a.shapes is None else [SHAPES[int(i)] for i in a.shapes.split(",")]
    rows = []
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=150, return_mode="median")  # noqa: E731
    for (N, L, H, HV) in shapes:
        q, k, v, g, beta, cu = inputs(N, L, H, HV)
        cu_cpu = cu.cpu()
        ci = cf.prepare_chunk_indices(cu, q.shape[1], 64)
        rk = l2_rnorm(k)
        g_cum, ainv, w, u = cf.chunk_fwd_prepare(k, v, g, beta, cu, 64, True, store_ainv=True, store_wu=True,
                                                 chunk_index=ci, ainv_dtype=torch.bfloat16, rk=torch.empty_like(rk))
        row = dict(shape=f"{N}x{L} {H}/{HV}", steps=-(-L // 64))
        ref = None
        for name in names:
            kw = VARIANTS[name]
            wu = kw.get("state_mode") == "wu"
            with override("chunk_fwd", segment_chunks=-1, **kw):
                def state():
                    if wu:
                        return cf.chunk_state_pass(k, w, u, g_cum, None, True, cu, 64, True, h_dtype=torch.bfloat16,
                                                   chunk_index=ci, rk=rk)
                    return cf.chunk_state_pass(k, None, None, g_cum, None, True, cu, 64, True, v=v, beta=beta,
                                               ainv=ainv, h_dtype=torch.bfloat16, chunk_index=ci, rk=rk)
                h, vn, ht = state()
                ms = bench(state)
            with override("chunk_fwd", **kw):
                def fwd():
                    return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm_in_kernel=True, cu_seqlens_cpu=cu_cpu)
                o, _ = fwd()
                ms_f = bench(fwd)
            r = dict(state_ms=ms, us_per_step=1000 * ms / row["steps"], fwd_ms=ms_f)
            if name == "portable":
                def fwd_sync():
                    return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm_in_kernel=True)
                r["fwd_sync_ms"] = bench(fwd_sync)
            outs = (h.float(), vn.float(), ht.clone(), o.float())
            if ref is None:
                ref = outs
            r["diff_vs_first"] = [float((x - y).norm() / y.norm().clamp_min(1e-30)) for x, y in zip(outs, ref)]
            row[name] = r
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, rows=rows), f, indent=1)
    print("\nstate pass per chunk step (us) / whole forward with cu_seqlens_cpu (ms); portable forward with the sync")
    print(f"{'shape':16s}" + "".join(f"{n:>18s}" for n in names) + "   sync")
    for row in rows:
        print(f"{row['shape']:16s}" + "".join(f"{row[n]['us_per_step']:7.2f} /{row[n]['fwd_ms']:7.3f}  "
                                               for n in names) + f"{row['portable'].get('fwd_sync_ms', 0):7.3f}")


if __name__ == "__main__":
    main()
