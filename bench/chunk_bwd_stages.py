#!/usr/bin/env python3
"""Per-kernel time of the chunked op's forward + backward (gdn, and fla when importable), from torch.profiler's CUDA
kernel records. Usage on the GPU machine, from the repository root::

    python3 bench/chunk_bwd_stages.py --shapes 1x32768:16/32,4x4096:16/32 [--fla] --out $OUT/bwd_stages.json

For each shape: bf16 inputs, K = V = 128, L2 norm on, initial state and final state on; one warm-up, then ``--iters``
profiled forward+backward calls; prints every kernel's mean time per call (us) and the sum, sorted by time.
"""
import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def make_inputs(N, T, H, HV, K=128, V=128, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(N, T, H, K, device=device, generator=g).bfloat16().requires_grad_()
    k = torch.randn(N, T, H, K, device=device, generator=g).bfloat16().requires_grad_()
    v = torch.randn(N, T, HV, V, device=device, generator=g).bfloat16().requires_grad_()
    gl = (-torch.rand(N, T, HV, device=device, generator=g) * 0.2).float().requires_grad_()
    beta = torch.rand(N, T, HV, device=device, generator=g).bfloat16().requires_grad_()
    h0 = torch.randn(N, HV, K, V, device=device, generator=g).float() * 0.1
    return q, k, v, gl, beta, h0


def profile(fn, iters):
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    tot = defaultdict(float)
    cnt = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:90]
            tot[name] += e.device_time
            cnt[name] += 1
    return sorted(((n, t / iters, cnt[n] / iters) for n, t in tot.items()), key=lambda r: -r[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x32768:16/32,4x4096:16/32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--fla", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from gdn.ops import chunk_gated_delta_rule

    peers = {"gdn": chunk_gated_delta_rule}
    if a.fla:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
            peers["fla"] = fla_chunk
        except Exception as e:  # noqa: BLE001
            print("fla not importable:", e)
    rows = []
    for shape in a.shapes.split(","):
        nt, hh = shape.split(":")
        N, T = map(int, nt.split("x"))
        H, HV = map(int, hh.split("/"))
        q, k, v, gl, beta, h0 = make_inputs(N, T, H, HV)
        do = torch.randn(N, T, HV, 128, device="cuda").bfloat16()
        for name, op in peers.items():
            def step():
                o, _ = op(q, k, v, gl, beta, scale=128 ** -0.5, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
                torch.autograd.grad(o, (q, k, v, gl, beta), do)
            try:
                ks = profile(step, a.iters)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {shape}: failed: {e}")
                continue
            total = sum(r[1] for r in ks)
            print(f"\n== {name} {shape}: sum of kernels {total / 1000:.3f} ms per fwd+bwd")
            for n, t, c in ks:
                print(f"  {t:9.1f} us  x{c:4.1f}  {n}")
            rows.append(dict(peer=name, shape=shape, total_us=total, kernels=[dict(name=n, us=t, calls=c)
                                                                               for n, t, c in ks]))
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
