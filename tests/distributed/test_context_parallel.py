"""cp_chunk_gated_delta_rule on gloo (2 and 3 processes) against chunk_gated_delta_rule on the whole sequence.

The parent process writes the full inputs, runs the single-process op (forward and backward) on the concatenated
sequence, spawns the ranks (each runs its slice through the context-parallel op and saves outputs and gradients) and
compares. Several cases run in one spawn to pay the process start-up once.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _gloo import free_port, init_gloo
from gdn.testing import make_inputs, rel_err

CUDA = torch.cuda.is_available()
TOL = 5e-3 if CUDA else 2e-4


_free_port, _init = free_port, init_gloo


def _slices(lens):
    out, s = [], 0
    for n in lens:
        out.append((s, s + n))
        s += n
    return out


def _make_case(case: dict, seed: int) -> dict:
    B, H, HV, K, V = case["B"], case["H"], case["HV"], case["K"], case["V"]
    T = sum(case["lens"])
    inp = make_inputs(B, T, H, HV, K, V, seed=seed, g_range=(-0.08, -0.002))
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (B, HV, K, V) if case["layout"] == "v_last" else (B, HV, V, K)
    h0 = torch.randn(*shape, generator=gen) * 0.3 if case["init"] else None
    do = torch.randn(B, T, HV, V, generator=gen)
    dfinal = torch.randn(*shape, generator=gen)
    w = torch.rand(len(case["lens"]), generator=gen)
    return dict(q=inp.q, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta, h0=h0, do=do, dfinal=dfinal,
                split=(w / w.sum()).tolist())


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_cp_forward(case: dict, data: dict, rank: int):
    from gdn.distributed import cp_chunk_gated_delta_rule

    s, e = _slices(case["lens"])[rank]
    xs = [data[n][:, s:e].to(_dev()) for n in ("q", "k", "v", "g", "beta")]
    h0 = data["h0"].to(_dev()) if data["h0"] is not None and rank == 0 else None
    o, final = cp_chunk_gated_delta_rule(*xs, None, h0, True, case["l2"], state_layout=case["layout"])
    return o.cpu(), final.cpu()


def _run_cp_rank(case: dict, data: dict, rank: int) -> dict:
    from gdn.distributed import cp_chunk_gated_delta_rule

    dev = _dev()
    s, e = _slices(case["lens"])[rank]
    xs = {n: data[n][:, s:e].to(dev).requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    h0 = None
    if data["h0"] is not None and rank == 0:
        h0 = data["h0"].to(dev).requires_grad_(True)
    o, final = cp_chunk_gated_delta_rule(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], None, h0,
                                         case["final"], case["l2"], state_layout=case["layout"],
                                         chunk_size=case.get("chunk_size"))
    loss = (o.float() * data["do"][:, s:e].to(dev)).sum()
    if case["final"]:
        loss = loss + (final * data["dfinal"].to(dev) * data["split"][rank]).sum()
    loss.backward()
    return _results(o, final, xs, h0)


def _results(o, final, xs, h0) -> dict:
    """Output, final state and the gradients of every leaf, on the CPU (what one run hands to the comparison)."""
    res = {"o": o.detach().cpu(), "final": None if final is None else final.detach().cpu()}
    for n, x in xs.items():
        res["d" + n] = x.grad.cpu()
    res["dh0"] = None if h0 is None else h0.grad.cpu()
    return res


def _worker(rank: int, world: int, port: int, cases: list, datas: list, out_dir: str) -> None:
    _init(rank, world, port)
    from gdn.distributed import context_parallel as cp

    try:
        for i, (case, data) in enumerate(zip(cases, datas)):
            # two_calls: the fallback for V + K wider than the kernels ([v | 0] split into two op calls)
            cp._MAX_AUG_COLS = 0 if case.get("two_calls") else 256
            res = _run_cp_rank(case, data, rank)
            if case.get("no_grad"):  # the inference path (no graph kept) gives the same forward
                with torch.no_grad():
                    res["o_no_grad"], res["final_no_grad"] = _run_cp_forward(case, data, rank)
            torch.save(res, os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _single(case: dict, data: dict) -> dict:
    from gdn.ops import chunk_gated_delta_rule

    dev = _dev()
    xs = {n: data[n].to(dev).requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    h0 = None if data["h0"] is None else data["h0"].to(dev).requires_grad_(True)
    kw = {} if case.get("chunk_size") is None else {"chunk_size": case["chunk_size"]}
    o, final = chunk_gated_delta_rule(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], None, h0, case["final"],
                                      use_qk_l2norm_in_kernel=case["l2"], state_layout=case["layout"], **kw)
    loss = (o.float() * data["do"].to(dev)).sum()
    if case["final"]:
        loss = loss + (final * data["dfinal"].to(dev)).sum()
    loss.backward()
    return _results(o, final, xs, h0)


def _check(cases: list, world: int, tmp_path) -> None:
    seed = int.from_bytes(os.urandom(3), "little")
    datas = [_make_case(c, seed + 10 * i) for i, c in enumerate(cases)]
    procs = mp.start_processes(_worker, args=(world, _free_port(), cases, datas, str(tmp_path)), nprocs=world,
                               join=False, start_method="spawn")
    refs = [_single(case, data) for case, data in zip(cases, datas)]  # while the ranks run
    while not procs.join():
        pass
    for i, (case, data, ref) in enumerate(zip(cases, datas, refs)):
        parts = [torch.load(os.path.join(tmp_path, f"case{i}_rank{r}.pt")) for r in range(world)]
        msg = f"case {case} seed {seed + 10 * i}"
        for n in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            got = torch.cat([p[n] for p in parts], dim=1)
            err = rel_err(got, ref[n])
            assert err < TOL, f"{n}: rel err {err:.2e} ({msg})"
        if case["final"]:
            for r, p in enumerate(parts):
                err = rel_err(p["final"], ref["final"])
                assert err < TOL, f"final_state on rank {r}: rel err {err:.2e} ({msg})"
        else:
            assert all(p["final"] is None for p in parts)
        if case.get("no_grad"):
            got = torch.cat([p["o_no_grad"] for p in parts], dim=1)
            assert rel_err(got, ref["o"]) < TOL, f"o without grad: rel err {rel_err(got, ref['o']):.2e} ({msg})"
            if case["final"]:
                err = rel_err(parts[-1]["final_no_grad"], ref["final"])
                assert err < TOL, f"final_state without grad: rel err {err:.2e} ({msg})"
        if data["h0"] is not None:
            err = rel_err(parts[0]["dh0"], ref["dh0"])
            assert err < TOL, f"d initial_state: rel err {err:.2e} ({msg})"


CASES_2 = [
    # GVA, l2norm, rank-0 initial state, final state (its gradient split over both ranks), unequal slices
    dict(B=1, H=1, HV=2, K=16, V=16, lens=[45, 29], layout="v_last", l2=True, init=True, final=True),
    # k_last, V != K, two sequences, rank 0 shorter
    dict(B=2, H=2, HV=2, K=16, V=32, lens=[13, 66], layout="k_last", l2=False, init=True, final=True),
    # an empty slice on the last rank; no final state
    dict(B=1, H=1, HV=2, K=16, V=16, lens=[40, 0], layout="v_last", l2=True, init=False, final=False),
]

CASES_3 = [
    # an empty slice in the middle, GVA, k_last; the two-call fallback; the no-grad forward
    dict(B=1, H=1, HV=2, K=16, V=16, lens=[19, 0, 23], layout="k_last", l2=True, init=True, final=True,
         two_calls=True, no_grad=True),
]


def test_cp_two_ranks(tmp_path):
    _check(CASES_2, 2, tmp_path)


def test_cp_three_ranks(tmp_path):
    _check(CASES_3, 3, tmp_path)


def test_cp_requires_init_process_group():
    from gdn.distributed import cp_chunk_gated_delta_rule

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised here")
    x = torch.randn(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp_chunk_gated_delta_rule(x, x, x, torch.zeros(1, 4, 1), torch.ones(1, 4, 1))
