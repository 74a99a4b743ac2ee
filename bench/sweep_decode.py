"""Tuning sweep for the decode kernel on a GPU: configurations (``GDN_DECODE_CFG`` strings) per batch size and state
dtype, next to the peers.

    python bench/sweep_decode.py --out $OUT/sweep_decode.json
    python bench/sweep_decode.py --layout v_last ...   # gdn only, state [B, HV, K, V] (GDNCache's default layout)

Times CUDA-graph replays of many calls over rotated state buffers (>= 2x L2 of state per replay), median of events.
Peers (FlashInfer gated_delta_rule_decode_pretranspose, fla fused_recurrent_gated_delta_rule) when importable.
"""
import argparse
import json
import os
import statistics

import torch

H, HV, K, V = 16, 32, 128, 128


def graph_time_ms(calls, reps=20):
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / len(calls))
    return statistics.median(ts)


def make(B, state_dtype, n_buf, layout="k_last"):
    dev = "cuda"
    bufs = []
    for _ in range(n_buf):
        bufs.append(dict(
            q=torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16),
            k=torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16),
            v=torch.randn(B, 1, HV, V, device=dev, dtype=torch.bfloat16),
            state=torch.randn(*((B, HV, V, K) if layout == "k_last" else (B, HV, K, V)), device=dev).to(state_dtype)
            * 0.1,
            a=torch.randn(B, 1, HV, device=dev, dtype=torch.bfloat16),
            b=torch.randn(B, 1, HV, device=dev, dtype=torch.bfloat16),
            out=torch.empty(B, 1, HV, V, device=dev, dtype=torch.bfloat16),
        ))
    A_log = torch.randn(HV, device=dev)
    dt_bias = torch.randn(HV, device=dev)
    return bufs, A_log, dt_bias


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep_decode.json")
    ap.add_argument("--batches", default="1,32,128,512,2048")
    ap.add_argument("--configs", default="32:2:1:1,16:2:4:8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--layout", default="k_last", choices=["k_last", "v_last"],
                    help="state layout; v_last times gdn only (the peers' decode takes k_last)")
    args = ap.parse_args()
    layout = args.layout
    from gdn.ops import gated_delta_rule_decode

    try:
        from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose as fi_decode
    except Exception as e:  # noqa: BLE001
        fi_decode = None
        print("flashinfer unavailable:", repr(e)[:200])
    if layout != "k_last":
        fi_decode = None
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_rec
    except Exception as e:  # noqa: BLE001
        fla_rec = None
        print("fla unavailable:", repr(e)[:200])
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    x = torch.randn(1 << 28, device="cuda")
    y = torch.empty_like(x)
    copy_ms = graph_time_ms([lambda: y.copy_(x)] * 10)
    copy_bw = 2 * x.numel() * 4 / copy_ms / 1e6  # GB/s
    del x, y
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        for sd in [getattr(torch, x) for x in args.dtypes.split(",")]:
            state_bytes = B * HV * K * V * torch.tensor([], dtype=sd).element_size()
            n_buf = max(1, min(64, int(2 * l2 // state_bytes) + 1))
            bufs, A_log, dt_bias = make(B, sd, n_buf, layout)
            moved = 2 * state_bytes + B * (2 * H * K + 2 * HV * V) * 2
            row = dict(B=B, state_dtype=str(sd)[6:], layout=layout, n_buf=n_buf, bytes=moved, copy_GBps=copy_bw)
            if fi_decode is not None:  # timed before and after gdn's configurations: the drift between the two is noise
                try:
                    row["flashinfer_first"] = graph_time_ms([lambda d=d: fi_decode(
                        d["q"], d["k"], d["v"], d["state"], A_log, d["a"], dt_bias, d["b"], None, d["out"], True)
                        for d in bufs])
                except Exception as e:  # noqa: BLE001
                    print("flashinfer", repr(e)[:300])
            for cfg in [c for c in args.configs.split(",") if c]:
                # GDN_DECODE_CFG of gdn.kernels.recurrent: BV:warps:stages:tiles[:maxnreg]
                os.environ["GDN_DECODE_CFG"] = cfg
                calls = [lambda d=d: gated_delta_rule_decode(d["q"], d["k"], d["v"], d["state"], A_log, d["a"],
                                                             dt_bias, d["b"], use_qk_l2norm=True, output=d["out"],
                                                             state_layout=layout)
                         for d in bufs]
                try:
                    row[f"gdn_{cfg}"] = graph_time_ms(calls)
                except Exception as e:  # noqa: BLE001
                    row[f"gdn_{cfg}"] = None
                    print("gdn", cfg, repr(e)[:300])
                os.environ.pop("GDN_DECODE_CFG", None)
            calls = [lambda d=d: gated_delta_rule_decode(d["q"], d["k"], d["v"], d["state"], A_log, d["a"], dt_bias,
                                                         d["b"], use_qk_l2norm=True, output=d["out"],
                                                         state_layout=layout) for d in bufs]
            row["gdn_default"] = graph_time_ms(calls)
            if fi_decode is not None:
                calls = [lambda d=d: fi_decode(d["q"], d["k"], d["v"], d["state"], A_log, d["a"], dt_bias, d["b"],
                                               None, d["out"], True) for d in bufs]
                try:
                    row["flashinfer"] = graph_time_ms(calls)
                except Exception as e:  # noqa: BLE001
                    row["flashinfer"] = None
                    print("flashinfer", repr(e)[:300])
            if fla_rec is not None and sd == torch.float32 and os.environ.get("SWEEP_FLA") and layout == "k_last":
                def fla_call(d):
                    g = -torch.exp(A_log) * torch.nn.functional.softplus(d["a"].float() + dt_bias)
                    beta = torch.sigmoid(d["b"].float())
                    return fla_rec(d["q"], d["k"], d["v"], g, beta, initial_state=d["state"].transpose(-1, -2).contiguous(),
                                   output_final_state=False, use_qk_l2norm_in_kernel=True)
                try:
                    row["fla_incl_gate_ops"] = graph_time_ms([lambda d=d: fla_call(d) for d in bufs])
                except Exception as e:  # noqa: BLE001
                    row["fla_incl_gate_ops"] = None
                    print("fla", repr(e)[:300])
            best = min((v, k) for k, v in row.items() if k.startswith("gdn_") and v)
            row["best"] = best[1]
            row["best_frac_copy"] = moved / (best[0] * 1e-3) / (copy_bw * 1e9)
            rows.append(row)
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            del bufs
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_GBps=copy_bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
