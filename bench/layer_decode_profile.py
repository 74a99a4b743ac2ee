#!/usr/bin/env python3
"""Where one cached decode step of the GatedDeltaNet layer spends its time: per-kernel CUDA times (torch.profiler)
of ``layer(x, cache=batch)`` at B sequences x 1 token, for each recurrent-state layout. Usage on the GPU machine::

    python3 bench/layer_decode_profile.py --batch 256 --layouts v_last,k_last --out $OUT/layer_decode_profile.json

Layer: hidden 2048, Qwen3-Next heads (16/32, K = V = 128), bf16 weights; cache: fp32 recurrent and conv states,
16 tokens prefilled per sequence. Also times the whole step as a CUDA-graph replay (median of 20) next to the bytes
it must move (``gdn.benchmark.cases.cost``), i.e. the same floor as ``gdn bench --ops layer_decode``.
"""
import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from sweep_decode import graph_time_ms  # noqa: E402  (CUDA-graph replay time per call, median of events)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--layouts", default="v_last,k_last")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from gdn.benchmark.cases import Case, cost
    from gdn.layers import GatedDeltaNet, GDNCache

    dev, B, hidden = "cuda", a.batch, 2048
    bf = dict(device=dev, dtype=torch.bfloat16)
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden, 16, 32, 128, 128, **bf).eval()
    case = Case(op="layer_decode", model="qwen3next-tp1", batch=B, seqlen=1, H=16, HV=32, K=128, V=128,
                state_dtype="fp32", hidden=hidden)
    floor_bytes = cost(case)["bytes"]
    rows = []
    for layout in a.layouts.split(","):
        cache = GDNCache.for_layers(layer, num_slots=B, dtype=torch.float32, state_layout=layout)
        batch = cache.batch(cache.allocate(B))
        with torch.no_grad():
            layer(torch.randn(B, 16, hidden, **bf), cache=batch)
            x = torch.randn(B, 1, hidden, **bf)

            def step():
                layer(x, cache=batch)
            step()
            torch.cuda.synchronize()
            ms = graph_time_ms([step])
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(a.iters):
                    step()
                torch.cuda.synchronize()
        tot, cnt = defaultdict(float), defaultdict(int)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                tot[e.name[:90]] += e.device_time / a.iters
                cnt[e.name[:90]] += 1
        ks = sorted(tot.items(), key=lambda kv: -kv[1])
        print(f"\n== layout {layout}: step {ms * 1e3:.1f} us (graph replay), bytes floor "
              f"{floor_bytes / 1e6:.0f} MB, {floor_bytes / (ms * 1e-3) / 1e9:.0f} GB/s; kernels (us per step):")
        for n, t in ks:
            print(f"  {t:8.1f}  x{cnt[n] / a.iters:3.1f}  {n}")
        rows.append(dict(layout=layout, batch=B, step_us=ms * 1e3, bytes=floor_bytes,
                         kernels=[dict(name=n, us=t, calls=cnt[n] / a.iters) for n, t in ks]))
        del cache, batch
        torch.cuda.empty_cache()
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
