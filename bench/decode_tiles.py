#!/usr/bin/env python3
"""Sweep the ``decode`` tuning table (V tile, warps, stages, tiles per program) for one state layout on the GPU.

For each (layout, state dtype, N) the single-token decode (``gated_delta_rule_decode``, pool of N rows, L2 norm, raw
gates, HV = 32, K = V = 128) is timed as CUDA-graph replay under every candidate row (``tuning.override``), and the
best rows are printed as the fraction of copy bandwidth their state + I/O bytes reach. The winner of a class goes in
``gdn.kernels.tuning.TABLES["decode"]`` by hand (classes as in ``recurrent._decode_config``)::

    python3 bench/decode_tiles.py --layout v_last --out $OUT/decode_tiles_vlast.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from gdn.benchmark.cases import Case, cost  # noqa: E402
from gdn.benchmark.timing import measure_copy_GBps  # noqa: E402
from gdn.kernels import tuning  # noqa: E402
from gdn.ops import gated_delta_rule_decode  # noqa: E402

CANDIDATES = [dict(BV=bv, warps=w, stages=st, tiles=t)
              for bv, w, (st, t) in itertools.product((8, 16, 32, 64, 128), (1, 2, 4, 8), ((1, 1), (2, 2), (3, 4), (4, 4)))
              if bv * 128 // (32 * w) <= 256]      # fp32 tile elements per thread: keep it in registers


def time_decode(N, HV, layout, sdt, reps=20):
    H, K, V = HV // 2, 128, 128
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(N, 1, H, K, device=dev, generator=g).bfloat16()
    k = torch.randn(N, 1, H, K, device=dev, generator=g).bfloat16()
    v = torch.randn(N, 1, HV, V, device=dev, generator=g).bfloat16()
    a = torch.randn(N, 1, HV, device=dev, generator=g).bfloat16()
    b = torch.randn(N, 1, HV, device=dev, generator=g).bfloat16()
    A_log = torch.rand(HV, device=dev, generator=g).log()
    dt_bias = torch.rand(HV, device=dev, generator=g)
    shape = (N + 1, HV, K, V) if layout == "v_last" else (N + 1, HV, V, K)
    pool = (torch.randn(shape, device=dev, generator=g) * 0.1).to(sdt)
    idx = torch.randperm(N, device=dev, generator=g).int()
    out = torch.empty(N, 1, HV, V, device=dev, dtype=torch.bfloat16)

    def step():
        gated_delta_rule_decode(q, k, v, pool, A_log, a, dt_bias, b, use_qk_l2norm=True, state_indices=idx,
                                output=out, state_layout=layout)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="v_last", choices=("v_last", "k_last"))
    ap.add_argument("--points", default="fp32:256,fp32:2048,bf16:128,bf16:512", help="dtype:N, comma-separated")
    ap.add_argument("--HV", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gbps = measure_copy_GBps(torch.device("cuda"))
    print(f"copy {gbps:.0f} GB/s")
    rows = []
    for point in args.points.split(","):
        dt, n = point.split(":")
        N = int(n)
        sdt = torch.float32 if dt == "fp32" else torch.bfloat16
        nbytes = cost(Case(op="decode", model="sweep", batch=N, seqlen=1, H=args.HV // 2, HV=args.HV,
                           state_dtype=dt))["bytes"]
        base = time_decode(N, args.HV, args.layout, sdt)
        res = []
        for c in CANDIDATES:
            try:
                with tuning.override("decode", **c):
                    us = time_decode(N, args.HV, args.layout, sdt)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  {c}: failed {type(e).__name__}: {str(e)[:100]}")
                continue
            res.append(dict(cfg=c, us=us, frac=nbytes / (us * 1e-6) / (gbps * 1e9)))
        res.sort(key=lambda r: r["us"])
        print(f"\n== {args.layout} {dt} N={N}: table row {base:.2f} us "
              f"({nbytes / (base * 1e-6) / (gbps * 1e9):.1%} of copy)")
        for r in res[:8]:
            print(f"  {r['us']:9.2f} us  {r['frac']:.1%}  {r['cfg']}")
        rows.append(dict(layout=args.layout, state_dtype=dt, N=N, HV=args.HV, table_us=base, bytes=nbytes,
                         results=res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_GBps=gbps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
