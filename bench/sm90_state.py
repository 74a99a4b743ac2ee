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

from gdn.kernels import chunk_fwd as cf  # noqa: E402
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="portable,sm90-ns2,sm90-ns3")
    a = ap.parse_args()
    variants = {"portable": dict(state_sm90=False), "sm90-ns2": dict(state_sm90=True, state_sm90_stages=2),
                "sm90-ns3": dict(state_sm90=True, state_sm90_stages=3),
                "sm90-bv128": dict(state_sm90=True, state_sm90_BV=128, state_sm90_stages=2)}
    rows = []
    for (N, L, H, HV) in SHAPES:
        q, k, v, g, beta, cu = inputs(N, L, H, HV)
        ci = cf.prepare_chunk_indices(cu, q.shape[1], 64)
        rk = cf.l2_rnorm(k)
        g_cum, ainv, _, _ = cf.chunk_fwd_prepare(k, v, g, beta, cu, 64, True, store_ainv=True, store_wu=False,
                                                 chunk_index=ci, ainv_dtype=torch.bfloat16, rk=torch.empty_like(rk))
        row = dict(shape=f"{N}x{L} {H}/{HV}", steps=-(-L // 64))
        for name in a.variants.split(","):
            kw = variants[name]
            with cf.config_override(segment_chunks=-1, **kw):
                def state():
                    return cf.chunk_state_pass(k, None, None, g_cum, None, True, cu, 64, True, v=v, beta=beta,
                                               ainv=ainv, h_dtype=torch.bfloat16, chunk_index=ci, rk=rk)
                h, vn, ht = state()
                ms = triton.testing.do_bench(state, warmup=50, rep=300, return_mode="median")
            with cf.config_override(**kw):
                def fwd():
                    return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm_in_kernel=True)
                o, _ = fwd()
                ms_f = triton.testing.do_bench(fwd, warmup=50, rep=300, return_mode="median")
            row[name] = dict(state_ms=ms, us_per_step=1000 * ms / row["steps"], fwd_ms=ms_f)
            row.setdefault("_ref", (h.float(), vn.float(), ht, o.float()))
            r = row["_ref"]
            row[name]["diff_vs_first"] = [float((a_.float() - b_).norm() / b_.norm().clamp_min(1e-30))
                                          for a_, b_ in zip((h, vn, ht, o), r)]
        row.pop("_ref")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, rows=rows), f, indent=1)
    print(f"\n{'shape':18s}" + "".join(f"{n:>30s}" for n in a.variants.split(",")))
    for row in rows:
        print(f"{row['shape']:18s}" + "".join(
            f"{row[n]['state_ms']:8.3f}ms {row[n]['us_per_step']:5.2f}us {row[n]['fwd_ms']:7.3f}ms"
            for n in a.variants.split(",")))


if __name__ == "__main__":
    main()
