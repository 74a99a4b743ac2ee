"""Context-parallel scaling of the chunked gated delta rule: one GPU (the plain op) vs N GPUs (context parallel).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 bench/cp_bench.py [--out bench/results/cp_h200x2.json]

Default shape: 1 x 65536 tokens, H/HV = 16/32, K = V = 128, bf16, q/k L2-normalised in the kernel (Qwen3-Next).
Every rank times the single-GPU op on the whole sequence on its own GPU (t1) and its slice under context parallelism
(t2: the slowest rank's median); scaling efficiency = t1 / (N * t2), for the forward (grad-enabled, as in training)
and for forward + backward. Medians of CUDA-event samples after a warm-up. It also checks that the context-parallel
outputs, final state and gradients equal the single-GPU op's (relative errors), times the pieces of the local pass
(the plain op on a slice with V and with V + K value columns: the cost of computing the transition in the same call),
and tries unequal splits (rank 0 does less work, so giving it a longer slice balances the ranks).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is forced before NCCL starts).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--HV", type=int, default=32)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--splits", default="0.5,0.55,0.6,0.65",
                   help="fractions of T on rank 0 to try with 2 ranks (the first is the headline); rounded to 64")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--out", default="bench/results/cp_h200x2.json")
    return p.parse_args()


# ----------------------------------------------------------------------------------------------------------------------
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev, warmup: int, iters: int) -> float:
    """Median per-call time of ``fn()``: CUDA events on GPUs, the host clock elsewhere."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    samples = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def rel(x, ref) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    if not torch.isfinite(x).all():
        return float("inf")
    d = ref.norm().item()
    return (x - ref).norm().item() / d if d > 0 else (x - ref).norm().item()


def make_inputs(a, dev, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    B, T, H, HV, K, V = a.B, a.T, a.H, a.HV, a.K, a.V
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype, generator=g)
    k = torch.randn(B, T, H, K, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype, generator=g)
    # gates as in the block: g = -exp(A_log) softplus(a + dt_bias) with typical values, beta = sigmoid(b)
    graw = torch.randn(B, T, HV, device=dev, dtype=torch.float32, generator=g)
    gate = -torch.nn.functional.softplus(graw - 4.0) * 2.0
    beta = torch.sigmoid(torch.randn(B, T, HV, device=dev, dtype=torch.float32, generator=g)).to(dtype)
    do = torch.randn(B, T, HV, V, device=dev, dtype=dtype, generator=g)
    return q, k, v, gate, beta, do


def split_points(T, world, frac0):
    """Slice boundaries: rank 0 gets ``frac0`` of T (with 2 ranks), the rest evenly; multiples of 64."""
    if world == 2:
        t0 = int(round(T * frac0 / 64)) * 64
        t0 = max(0, min(T, t0))
        return [0, t0, T]
    per = (T // world // 64) * 64
    pts = [i * per for i in range(world)] + [T]
    return pts


# ----------------------------------------------------------------------------------------------------------------------
def main():
    a = parse()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dev = torch.device("cpu")
    from gdn.distributed import cp_chunk_gated_delta_rule
    from gdn.ops import chunk_gated_delta_rule

    dtype = getattr(torch, a.dtype)
    q, k, v, g, beta, do = make_inputs(a, dev, dtype)
    scale = a.K ** -0.5
    log = (lambda *s: print(*s, flush=True)) if rank == 0 else (lambda *s: None)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    log(f"# cp_bench: world={world} backend={backend} device={dev_name}"
        f" B={a.B} T={a.T} H={a.H} HV={a.HV} K={a.K} V={a.V} {a.dtype}")

    def leaves(*xs):
        return [x.detach().clone().requires_grad_(True) for x in xs]

    # ---- single GPU: the plain op on the whole sequence (every rank on its own GPU; rank 0's number is reported).
    # Leaves are made once; the timed backward is autograd.grad (no .grad accumulation kernels).
    L1 = leaves(q, k, v, g, beta)

    def single_fwd():
        return chunk_gated_delta_rule(*L1, scale, None, True, use_qk_l2norm_in_kernel=True)

    def single_fwd_bwd():
        o, _ = chunk_gated_delta_rule(*L1, scale, None, True, use_qk_l2norm_in_kernel=True)
        torch.autograd.grad([o], L1, [do])

    res = {"device": dev_name, "world": world,
           "backend": backend, "shape": dict(B=a.B, T=a.T, H=a.H, HV=a.HV, K=a.K, V=a.V), "dtype": a.dtype,
           "use_qk_l2norm_in_kernel": True, "warmup": a.warmup, "iters": a.iters,
           "torch": torch.__version__, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass

    t1_f = time_ms(single_fwd, dev, a.warmup, a.iters)
    t1_fb = time_ms(single_fwd_bwd, dev, a.warmup, a.iters)
    dist.barrier()
    t1 = torch.tensor([t1_f, t1_fb], dtype=torch.float64, device=dev)
    dist.broadcast(t1, 0)
    t1_f, t1_fb = t1.tolist()
    res["single"] = {"fwd_ms": t1_f, "fwd_bwd_ms": t1_fb}
    log(f"single GPU (plain op, T={a.T}): fwd {t1_f:.3f} ms   fwd+bwd {t1_fb:.3f} ms")

    # ---- context parallel at several splits
    splits = [float(s) for s in a.splits.split(",")] if world == 2 else [1.0 / world]
    res["cp"] = []
    for frac in splits:
        pts = split_points(a.T, world, frac)
        s, e = pts[rank], pts[rank + 1]
        L2 = leaves(*[x[:, s:e] for x in (q, k, v, g, beta)])
        do2 = do[:, s:e].contiguous()

        def cp_fwd():
            return cp_chunk_gated_delta_rule(*L2, scale, None, True, True)

        def cp_fwd_bwd():
            o, _ = cp_chunk_gated_delta_rule(*L2, scale, None, True, True)
            torch.autograd.grad([o], L2, [do2])

        dist.barrier()
        tf = time_ms(cp_fwd, dev, a.warmup, a.iters)
        tfb = time_ms(cp_fwd_bwd, dev, a.warmup, a.iters)
        both = torch.tensor([tf, tfb], dtype=torch.float64, device=dev)
        per_rank = [torch.zeros_like(both) for _ in range(world)]
        dist.all_gather(per_rank, both)
        per_rank = [x.tolist() for x in per_rank]
        t2_f, t2_fb = max(x[0] for x in per_rank), max(x[1] for x in per_rank)
        entry = {"split": pts, "rank0_fraction": pts[1] / a.T, "fwd_ms": t2_f, "fwd_bwd_ms": t2_fb,
                 "per_rank_ms": per_rank, "eff_fwd": t1_f / (world * t2_f), "eff_fwd_bwd": t1_fb / (world * t2_fb)}
        res["cp"].append(entry)
        log(f"CP x{world} split {pts}: fwd {t2_f:.3f} ms (eff {entry['eff_fwd']:.1%})   fwd+bwd {t2_fb:.3f} ms "
            f"(eff {entry['eff_fwd_bwd']:.1%})   per rank {[[round(t, 3) for t in x] for x in per_rank]}")
    head = res["cp"][0]
    best = max(res["cp"], key=lambda x: x["eff_fwd_bwd"])
    res["scaling_efficiency"] = {"fwd": head["eff_fwd"], "fwd_bwd": head["eff_fwd_bwd"], "split": head["split"]}
    res["scaling_efficiency_best_split"] = {"fwd": best["eff_fwd"], "fwd_bwd": best["eff_fwd_bwd"],
                                            "split": best["split"]}

    # ---- the pieces of the local pass (rank 0's GPU): plain op on half the sequence with V and with V + K columns
    half = a.T // world
    hq, hk, hv, hg, hb, hdo = [x[:, :half] for x in (q, k, v, g, beta, do)]
    hv_aug = torch.cat([hv, torch.zeros(*hv.shape[:3], a.K, device=dev, dtype=dtype)], -1)
    hdo_aug = torch.cat([hdo, hdo[..., :a.K]], -1)
    eye = torch.cat([torch.zeros(a.B, a.HV, a.K, a.V, device=dev),
                     torch.eye(a.K, device=dev).expand(a.B, a.HV, a.K, a.K)], -1)
    pieces = {}
    del L1, L2
    for name, vv, dd, h0 in (("plain_V", hv, hdo, None), ("aug_V_plus_K", hv_aug, hdo_aug, eye)):
        L3 = leaves(hq, hk, vv, hg, hb)

        def f(L3=L3, h0=h0):
            return chunk_gated_delta_rule(*L3, scale, h0, True, use_qk_l2norm_in_kernel=True)

        def fb(L3=L3, dd=dd, h0=h0):
            o, _ = chunk_gated_delta_rule(*L3, scale, h0, True, use_qk_l2norm_in_kernel=True)
            torch.autograd.grad([o], L3, [dd])

        pieces[name] = {"fwd_ms": time_ms(f, dev, a.warmup, a.iters), "fwd_bwd_ms": time_ms(fb, dev, a.warmup, a.iters)}
    res["local_pieces_T_over_world"] = pieces
    log(f"local pieces (T={half}): plain V: fwd {pieces['plain_V']['fwd_ms']:.3f} fwd+bwd "
        f"{pieces['plain_V']['fwd_bwd_ms']:.3f} ms | V+K columns: fwd {pieces['aug_V_plus_K']['fwd_ms']:.3f} "
        f"fwd+bwd {pieces['aug_V_plus_K']['fwd_bwd_ms']:.3f} ms")

    # ---- correctness: CP (headline split) vs the single-GPU op on the whole sequence
    if not a.no_check:
        pts = head["split"]
        s, e = pts[rank], pts[rank + 1]
        lq, lk, lv, lg, lb = leaves(q, k, v, g, beta)
        o1, f1 = chunk_gated_delta_rule(lq, lk, lv, lg, lb, scale, None, True, use_qk_l2norm_in_kernel=True)
        gen = torch.Generator(device=dev).manual_seed(1)
        dfin = torch.randn(f1.shape, device=dev, generator=gen)
        torch.autograd.backward([o1, f1], [do, dfin])
        ref = {"o": o1[:, s:e], "final": f1, "dq": lq.grad[:, s:e], "dk": lk.grad[:, s:e], "dv": lv.grad[:, s:e],
               "dg": lg.grad[:, s:e], "dbeta": lb.grad[:, s:e]}
        cq, ck, cv, cg, cb = leaves(*[x[:, s:e] for x in (q, k, v, g, beta)])
        o2, f2 = cp_chunk_gated_delta_rule(cq, ck, cv, cg, cb, scale, None, True, True)
        torch.autograd.backward([o2, f2], [do[:, s:e], dfin if rank == world - 1 else torch.zeros_like(dfin)])
        got = {"o": o2, "final": f2, "dq": cq.grad, "dk": ck.grad, "dv": cv.grad, "dg": cg.grad, "dbeta": cb.grad}
        errs = torch.tensor([rel(got[n], ref[n]) for n in ref], dtype=torch.float64, device=dev)
        all_errs = [torch.zeros_like(errs) for _ in range(world)]
        dist.all_gather(all_errs, errs)
        worst = torch.stack(all_errs).max(0).values.tolist()
        res["rel_err_vs_single_gpu"] = dict(zip(ref.keys(), worst))
        log("rel err CP vs single GPU (max over ranks): "
            + "  ".join(f"{n} {x:.2e}" for n, x in res["rel_err_vs_single_gpu"].items()))
        del o1, f1, o2, f2, lq, lk, lv, lg, lb, cq, ck, cv, cg, cb

    log(f"scaling efficiency (t1 / ({world} t2)), split {head['split']}: fwd {head['eff_fwd']:.1%}   "
        f"fwd+bwd {head['eff_fwd_bwd']:.1%};  best split {best['split']}: fwd {best['eff_fwd']:.1%}   "
        f"fwd+bwd {best['eff_fwd_bwd']:.1%}")
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)
        log(f"wrote {a.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
