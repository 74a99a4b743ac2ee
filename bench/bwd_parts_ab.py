#!/usr/bin/env python3
"""A/B of the backward's parts kernels on one GPU: ``chunk_gated_delta_rule_bwd`` at the training target shapes (bf16,
K = V = 128, L2 norm, varlen B = 1) with ``chunk_bwd.parts_sm90`` off (portable parts A + B) and on (the Gluon
kernel), alternated in one process: CUDA-event medians of 8 calls (best of two alternations) and per-call kernel
times from torch.profiler. Writes $OUT/parts_ab.json (default ./).

    PYTHONPATH=src python3 bench/bwd_parts_ab.py [number of shapes]
"""
import sys, json, os, torch
rows = []
from gdn.testing import make_inputs
from gdn.kernels.chunk.backward import chunk_gated_delta_rule_bwd
from gdn.kernels.tuning import override
dev = torch.device("cuda")
shapes = [(1, 8192, 16, 32), (1, 32768, 16, 32), (4, 4096, 16, 32), (1, 65536, 2, 8), (1, 32768, 64, 64)]
if len(sys.argv) > 1:
    shapes = shapes[:int(sys.argv[1])]
for N, L, H, HV in shapes:
    T = N * L
    x = make_inputs(1, T, H, HV, 128, 128, dtype=torch.bfloat16, device=dev)
    cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
    do = torch.randn(1, T, HV, 128, device=dev).bfloat16()
    f = lambda: chunk_gated_delta_rule_bwd(x.q, x.k, x.v, x.g, x.beta, 128 ** -0.5, None, cu, 64, True, do, None)
    res = {}
    for on in (False, True, False, True):
        with override("chunk_bwd", parts_sm90=on):
            f(); torch.cuda.synchronize()
            ts = []
            for i in range(8):
                s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
                s.record(); f(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
            res.setdefault(on, []).append(sorted(ts)[len(ts) // 2])
    # kernel sums of the parts kernels
    ks = {}
    for on in (False, True):
        with override("chunk_bwd", parts_sm90=on):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                for i in range(3):
                    f()
                torch.cuda.synchronize()
            d = {}
            for ev in p.key_averages():
                if "chunk_bwd_out" in ev.key or "chunk_bwd_wy" in ev.key or "parts_sm90" in ev.key or "chunk_bwd_qk" in ev.key:
                    d[ev.key[:40]] = round(ev.device_time_total / 3, 1) if hasattr(ev, "device_time_total") else round(ev.cuda_time_total / 3, 1)
            ks[on] = d
    rows.append(dict(shape=f"{N}x{L} {H}/{HV}", bwd_ms_portable_parts=min(res[False]), bwd_ms_sm90_parts=min(res[True]),
                     kernels_us_portable=ks[False], kernels_us_sm90=ks[True]))
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__, rows=rows), open(os.environ.get("OUT", ".") + "/parts_ab.json", "w"), indent=1)
    print(f"{N}x{L} {H}/{HV} bwd ms portable {min(res[False]):.3f} gluon {min(res[True]):.3f} | kernels us {ks}", flush=True)
