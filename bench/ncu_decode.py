#!/usr/bin/env python3
"""Decode kernels under Nsight Compute: gdn configurations and FlashInfer, one call each inside a profiler range.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 bench/ncu_decode.py --B 512 --dtype float32 --configs 128:8:1:1:0,64:4:1:1:0 > ncu.txt

Each implementation is warmed up (compiled) first, outside the profiled range. Configs are GDN_DECODE_CFG strings
(gdn.kernels.recurrent._decode_config).
"""
import argparse
import os

import torch

H, HV, K, V = 16, 32, 128, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--configs", default="128:8:1:1:0")
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args()
    from gdn.ops import gated_delta_rule_decode

    dev, B, sd = "cuda", args.B, getattr(torch, args.dtype)
    q = torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, 1, HV, V, device=dev, dtype=torch.bfloat16)
    state = (torch.randn(B, HV, V, K, device=dev) * 0.1).to(sd)
    a = torch.randn(B, 1, HV, device=dev, dtype=torch.bfloat16)
    b = torch.randn(B, 1, HV, device=dev, dtype=torch.bfloat16)
    out = torch.empty(B, 1, HV, V, device=dev, dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV, device=dev)

    calls = []
    for cfg in [c for c in args.configs.split(",") if c]:
        def run(cfg=cfg):
            os.environ["GDN_DECODE_CFG"] = cfg
            gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, b, use_qk_l2norm=True, output=out)
            os.environ.pop("GDN_DECODE_CFG", None)
        calls.append((f"gdn {cfg}", run))
    if not args.no_flashinfer:
        try:
            from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose as fi
            calls.append(("flashinfer", lambda: fi(q, k, v, state, A_log, a, dt_bias, b, None, out, True)))
        except Exception as e:  # noqa: BLE001
            print("flashinfer unavailable:", repr(e)[:200])
    for _, c in calls:
        c()
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, c in calls:
        print("profiling", name, flush=True)
        c()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
