"""Context-parallel scaling over packed rows: one GPU (the plain op on the whole row) vs N GPUs (each an equal shard).

    torchrun --nproc_per_node 2 bench/cp_bench.py --out $OUT/cp.json          # 2 GPUs, NCCL (< 4 minutes)
    torchrun --nproc_per_node 2 bench/cp_bench.py --smoke --out /tmp/cp.json  # tiny sizes, gloo on CPU

Rows: 1 x T tokens (default 65536) packed from documents (``--mixes``; the defaults: 8 x 8192, 32768 + 16 x 2048,
a mix whose middle document crosses the shard boundary (4096 + 7 x 8192 + 4096) and one document of T tokens, the
worst case), H/HV = 16/32, K = V = 128, bf16, q/k L2-normalised in the kernel (Qwen3-Next); equal shards of T / N.

For every mix, the op (``cp_chunk_gated_delta_rule`` with global ``cu_seqlens``) forward (grad-enabled, as in
training) and forward + backward, and the ``GatedDeltaNet`` layer under CP (``cp_group=``, hidden 2048) for the
first mix. Times are medians of CUDA-event samples after a warm-up. ``t1`` is the single-GPU time of the plain op
(``chunk_gated_delta_rule`` on the whole row; every rank runs it on its own GPU in the same run, rank 0's is
reported), ``tN`` the context-parallel time (every rank times its own call, which includes waiting in the
collectives; the slowest rank's median is reported). **Scaling efficiency = t1 / (N * tN)**: 100% means N GPUs are
N times faster than one. Each mix also checks CP against the single-GPU op (relative errors of o, final states and
all gradients). NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` is set before NCCL starts).
Writes JSON to ``--out`` (rank 0) and prints a table last.
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

DEFAULT_MIXES = "8x8192,32768+16x2048,4096+7x8192+4096,65536"


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--HV", type=int, default=32)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="layer width for the layer rows (0: skip the layer)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--mixes", default=DEFAULT_MIXES,
                   help="comma-separated document mixes: '+'-joined 'count x length' or 'length' terms summing to T")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (T 512, heads 1/2, K = V = 16, hidden 32, mixes scaled by T / 65536, 1 + 2 iters)")
    p.add_argument("--out", required=True, help="JSON output path (written by rank 0)")
    a = p.parse_args()
    if a.smoke:
        a.T, a.H, a.HV, a.K, a.V, a.hidden, a.warmup, a.iters = 512, 1, 2, 16, 16, 32, 1, 2
        a.dtype = "float32"
    return a


def parse_mix(text: str, T: int, scale: int = 1):
    """'32768+16x2048' -> [32768, 2048, ...] (lengths divided by ``scale``); must sum to T."""
    lens = []
    for term in text.split("+"):
        n, _, L = term.partition("x") if "x" in term else ("1", "", term)
        lens += [int(L) // scale] * int(n)
    if sum(lens) != T:
        raise SystemExit(f"--mixes: {text!r} sums to {sum(lens)} tokens (scaled by 1/{scale}), expected T = {T}")
    return lens


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
    T, H, HV, K, V = a.T, a.H, a.HV, a.K, a.V
    q = torch.randn(1, T, H, K, device=dev, dtype=dtype, generator=g)
    k = torch.randn(1, T, H, K, device=dev, dtype=dtype, generator=g)
    v = torch.randn(1, T, HV, V, device=dev, dtype=dtype, generator=g)
    # gates as in the block: g = -exp(A_log) softplus(a + dt_bias) with typical values, beta = sigmoid(b)
    graw = torch.randn(1, T, HV, device=dev, dtype=torch.float32, generator=g)
    gate = -torch.nn.functional.softplus(graw - 4.0) * 2.0
    beta = torch.sigmoid(torch.randn(1, T, HV, device=dev, dtype=torch.float32, generator=g)).to(dtype)
    do = torch.randn(1, T, HV, V, device=dev, dtype=dtype, generator=g)
    return q, k, v, gate, beta, do


def slowest(x: float, dev) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank0(x: float, dev) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.broadcast(t, 0)
    return float(t.item())


# ----------------------------------------------------------------------------------------------------------------------
def bench_op(a, mix, lens, dev, dtype, world, rank, log):
    from gdn.distributed import cp_chunk_gated_delta_rule
    from gdn.ops import chunk_gated_delta_rule

    q, k, v, g, beta, do = make_inputs(a, dev, dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    scale = a.K ** -0.5
    per = a.T // world
    s, e = rank * per, (rank + 1) * per if rank < world - 1 else a.T
    shard_lengths = [per] * (world - 1) + [a.T - per * (world - 1)]

    def leaves(*xs):
        return [x.detach().clone().requires_grad_(True) for x in xs]

    L1 = leaves(q, k, v, g, beta)
    L2 = leaves(*[x[:, s:e] for x in (q, k, v, g, beta)])
    do2 = do[:, s:e].contiguous()

    def single_f():
        return chunk_gated_delta_rule(*L1, scale, None, False, cu, True)

    def single_fb():
        o, _ = chunk_gated_delta_rule(*L1, scale, None, False, cu, True)
        torch.autograd.grad([o], L1, [do])

    def cp_f():
        return cp_chunk_gated_delta_rule(*L2, scale, None, False, True, cu_seqlens=cu, shard_lengths=shard_lengths)

    def cp_fb():
        o, _ = cp_chunk_gated_delta_rule(*L2, scale, None, False, True, cu_seqlens=cu, shard_lengths=shard_lengths)
        torch.autograd.grad([o], L2, [do2])

    t1f = rank0(time_ms(single_f, dev, a.warmup, a.iters), dev)
    t1fb = rank0(time_ms(single_fb, dev, a.warmup, a.iters), dev)
    dist.barrier()
    tNf = slowest(time_ms(cp_f, dev, a.warmup, a.iters), dev)
    tNfb = slowest(time_ms(cp_fb, dev, a.warmup, a.iters), dev)
    row = {"what": "op", "mix": mix, "docs": len(lens), "single_fwd_ms": t1f, "single_fwd_bwd_ms": t1fb,
           "cp_fwd_ms": tNf, "cp_fwd_bwd_ms": tNfb, "eff_fwd": t1f / (world * tNf),
           "eff_fwd_bwd": t1fb / (world * tNfb)}
    crossing = [n for n, (x, y) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))
                if any(x < r * per < y for r in range(1, world))]
    row["crossing_docs"] = crossing
    if not a.no_check:  # CP vs the single-GPU op: outputs, final states, every gradient
        gen = torch.Generator(device=dev).manual_seed(1)
        h0 = torch.randn(len(lens), a.HV, a.K, a.V, device=dev, generator=gen) * 0.1
        dfin = torch.randn(len(lens), a.HV, a.K, a.V, device=dev, generator=gen)
        A, hA = leaves(q, k, v, g, beta), h0.clone().requires_grad_(True)
        o1, f1 = chunk_gated_delta_rule(*A, scale, hA, True, cu, True)
        torch.autograd.backward([o1, f1], [do, dfin])
        Bl, hB = leaves(*[x[:, s:e] for x in (q, k, v, g, beta)]), h0.clone().requires_grad_(True)
        o2, f2 = cp_chunk_gated_delta_rule(*Bl, scale, hB, True, True, cu_seqlens=cu)
        torch.autograd.backward([o2, f2], [do2, dfin if rank == 0 else torch.zeros_like(dfin)])
        dh0 = hB.grad.clone()
        dist.all_reduce(dh0)  # partial sums over the ranks
        errs = {"o": rel(o2, o1[:, s:e]), "final": rel(f2, f1), "dh0": rel(dh0, hA.grad)}
        for n, x, y in zip(("dq", "dk", "dv", "dg", "dbeta"), Bl, A):
            errs[n] = rel(x.grad, y.grad[:, s:e])
        row["rel_err_vs_single"] = {n: slowest(x, dev) for n, x in errs.items()}
    log(f"op  {mix:>22}: 1 GPU fwd {t1f:8.3f} fwd+bwd {t1fb:8.3f} ms | CP x{world} fwd {tNf:8.3f} "
        f"({row['eff_fwd']:6.1%}) fwd+bwd {tNfb:8.3f} ({row['eff_fwd_bwd']:6.1%})  crossing docs {crossing}"
        + ("" if a.no_check else "  max rel err " + f"{max(row['rel_err_vs_single'].values()):.1e}"))
    return row


def bench_layer(a, mix, lens, dev, dtype, world, rank, log):
    from gdn.layers import GatedDeltaNet

    torch.manual_seed(0)
    kw = dict(conv_size=4, projection="qwen3_next", device=dev, dtype=dtype)
    one = GatedDeltaNet(a.hidden, a.H, a.HV, a.K, a.V, **kw)
    cpl = GatedDeltaNet(a.hidden, a.H, a.HV, a.K, a.V, cp_group=dist.group.WORLD, **kw)
    cpl.load_state_dict(one.state_dict())
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(1, a.T, a.hidden, device=dev, dtype=dtype, generator=gen)
    dy = torch.randn(1, a.T, a.hidden, device=dev, dtype=dtype, generator=gen)
    per = a.T // world
    s, e = rank * per, (rank + 1) * per if rank < world - 1 else a.T
    x1, x2 = x.clone().requires_grad_(True), x[:, s:e].clone().requires_grad_(True)
    p1, p2 = [x1] + list(one.parameters()), [x2] + list(cpl.parameters())

    def f1():
        return one(x1, cu_seqlens=cu)

    def fb1():
        torch.autograd.grad([one(x1, cu_seqlens=cu)], p1, [dy])

    def f2():
        return cpl(x2, cu_seqlens=cu)

    def fb2():
        torch.autograd.grad([cpl(x2, cu_seqlens=cu)], p2, [dy[:, s:e]])

    t1f = rank0(time_ms(f1, dev, a.warmup, a.iters), dev)
    t1fb = rank0(time_ms(fb1, dev, a.warmup, a.iters), dev)
    dist.barrier()
    tNf = slowest(time_ms(f2, dev, a.warmup, a.iters), dev)
    tNfb = slowest(time_ms(fb2, dev, a.warmup, a.iters), dev)
    row = {"what": "layer", "mix": mix, "docs": len(lens), "hidden": a.hidden, "single_fwd_ms": t1f,
           "single_fwd_bwd_ms": t1fb, "cp_fwd_ms": tNf, "cp_fwd_bwd_ms": tNfb, "eff_fwd": t1f / (world * tNf),
           "eff_fwd_bwd": t1fb / (world * tNfb)}
    if not a.no_check:
        y1 = one(x1, cu_seqlens=cu)
        y2 = cpl(x2, cu_seqlens=cu)
        g1 = torch.autograd.grad([y1], p1, [dy])
        g2 = torch.autograd.grad([y2], p2, [dy[:, s:e]])
        gw = [t.float().clone(memory_format=torch.contiguous_format) for t in g2[1:]]
        for t in gw:
            dist.all_reduce(t)  # weight gradients: partial sums over the ranks
        errs = {"y": rel(y2, y1[:, s:e]), "dx": rel(g2[0], g1[0][:, s:e]),
                "dweights_max": max(rel(u, w) for u, w in zip(gw, g1[1:]))}
        row["rel_err_vs_single"] = {n: slowest(x, dev) for n, x in errs.items()}
    log(f"layer {mix:>20}: 1 GPU fwd {t1f:8.3f} fwd+bwd {t1fb:8.3f} ms | CP x{world} fwd {tNf:8.3f} "
        f"({row['eff_fwd']:6.1%}) fwd+bwd {tNfb:8.3f} ({row['eff_fwd_bwd']:6.1%})"
        + ("" if a.no_check else "  max rel err " + f"{max(row['rel_err_vs_single'].values()):.1e}"))
    return row


def main():
    a = parse()
    t_start = time.time()
    backend = "nccl" if torch.cuda.is_available() and not a.smoke else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    log = (lambda *s: print(*s, flush=True)) if rank == 0 else (lambda *s: None)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    log(f"# cp_bench: world={world} backend={backend} device={dev_name} T={a.T} H={a.H} HV={a.HV} K={a.K} V={a.V} "
        f"{a.dtype}; equal shards of {a.T // world}; efficiency = t(1 GPU) / ({world} * t(CP))")
    res = {"device": dev_name, "world": world, "backend": backend, "smoke": a.smoke,
           "shape": dict(T=a.T, H=a.H, HV=a.HV, K=a.K, V=a.V, hidden=a.hidden), "dtype": a.dtype,
           "use_qk_l2norm_in_kernel": True, "warmup": a.warmup, "iters": a.iters, "torch": torch.__version__,
           "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
           "efficiency": "t_single / (world * t_cp): t_single = the plain op (or layer) on the whole row on one GPU, "
                         "t_cp = the slowest rank's median time of its equal shard under context parallelism",
           "rows": []}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    scale = 65536 // a.T if a.smoke else 1
    mixes = [(m, parse_mix(m, a.T, scale)) for m in a.mixes.split(",")]
    for mix, lens in mixes:
        res["rows"].append(bench_op(a, mix, lens, dev, dtype, world, rank, log))
    if a.hidden > 0:
        res["rows"].append(bench_layer(a, mixes[0][0], mixes[0][1], dev, dtype, world, rank, log))
    res["wall_s"] = time.time() - t_start

    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)
        log(f"wrote {a.out} ({res['wall_s']:.0f} s)")
        log("")
        log(f"| what | mix | 1 GPU fwd ms | CP x{world} fwd ms | eff fwd | 1 GPU fwd+bwd ms | CP x{world} fwd+bwd ms "
            "| eff fwd+bwd | max rel err |")
        log("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in res["rows"]:
            err = max(r["rel_err_vs_single"].values()) if "rel_err_vs_single" in r else float("nan")
            log(f"| {r['what']} | {r['mix']} | {r['single_fwd_ms']:.3f} | {r['cp_fwd_ms']:.3f} | {r['eff_fwd']:.1%} | "
                f"{r['single_fwd_bwd_ms']:.3f} | {r['cp_fwd_bwd_ms']:.3f} | {r['eff_fwd_bwd']:.1%} | {err:.1e} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
