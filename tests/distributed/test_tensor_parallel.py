"""Tensor-parallel GatedDeltaNet on gloo (2 processes) against the unsharded layer in one process.

Every rank builds the same full layer, shards it (shard_gated_deltanet), runs forward and backward on the same input
and gathers the gradients of the full weights (gather_full_state_dict); the parent compares output, input gradient
and weight gradients with the unsharded layer.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _gloo import free_port, init_gloo
from gdn.testing import rel_err

CUDA = torch.cuda.is_available()
TOL = 5e-3 if CUDA else 2e-4


_free_port, _init = free_port, init_gloo


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _build(case: dict, state=None):
    from gdn.layers import GatedDeltaNet

    layer = GatedDeltaNet(case["hidden"], case["H"], case["HV"], case["K"], case["V"], conv_size=4,
                          projection=case["projection"], conv_bias=case["conv_bias"], chunk_size=case["chunk"],
                          device=_dev(), dtype=torch.float32)
    if state is not None:
        layer.load_state_dict(state)
    return layer


def _make_case(case: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    layer = _build(case)
    with torch.no_grad():  # random weights of a sensible size everywhere (the norm weight too)
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
        layer.norm.weight.uniform_(0.5, 1.5)
        if layer.conv1d.bias is not None:
            layer.conv1d.bias.normal_(0, 0.1)
    state = {n: t.detach().cpu().clone() for n, t in layer.state_dict().items()}
    x = torch.randn(case["B"], case["T"], case["hidden"])
    dy = torch.randn(case["B"], case["T"], case["hidden"])
    return dict(state=state, x=x, dy=dy)


def _run(layer, data):
    x = data["x"].to(_dev()).requires_grad_(True)
    y = layer(x)
    (y * data["dy"].to(_dev())).sum().backward()
    return y.detach().cpu(), x.grad.cpu()


def _worker(rank: int, world: int, port: int, cases: list, datas: list, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        from gdn.distributed import gather_full_state_dict, shard_gated_deltanet

        for i, (case, data) in enumerate(zip(cases, datas)):
            full = _build(case, data["state"])
            shard = shard_gated_deltanet(full, None)
            assert shard.local_num_v_heads == case["HV"] // world
            y, dx = _run(shard, data)
            grads = gather_full_state_dict(shard, None, grads=True)
            params = gather_full_state_dict(shard, None)
            torch.save({"y": y, "dx": dx, "grads": {n: t.cpu() for n, t in grads.items()},
                        "params": {n: t.cpu() for n, t in params.items()}},
                       os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _check(cases: list, world: int, tmp_path) -> None:
    seed = int.from_bytes(os.urandom(3), "little")
    datas = [_make_case(c, seed + i) for i, c in enumerate(cases)]
    procs = mp.start_processes(_worker, args=(world, _free_port(), cases, datas, str(tmp_path)), nprocs=world,
                               join=False, start_method="spawn")
    refs = []
    for case, data in zip(cases, datas):  # the unsharded layer, while the ranks run
        full = _build(case, data["state"])
        y, dx = _run(full, data)
        refs.append((y, dx, {n: p.grad.cpu() for n, p in full.named_parameters()}))
    while not procs.join():
        pass
    for i, (case, data, (y, dx, ref_grads)) in enumerate(zip(cases, datas, refs)):
        msg = f"case {case} seed {seed + i}"
        for r in range(world):
            got = torch.load(os.path.join(tmp_path, f"case{i}_rank{r}.pt"))
            assert rel_err(got["y"], y) < TOL, f"output on rank {r}: rel err {rel_err(got['y'], y):.2e} ({msg})"
            assert rel_err(got["dx"], dx) < TOL, f"input grad on rank {r}: {rel_err(got['dx'], dx):.2e} ({msg})"
            assert set(got["params"]) == set(data["state"])
            for n, t in got["params"].items():
                assert torch.equal(t, data["state"][n]), f"gathered parameter {n} differs ({msg})"
            assert set(got["grads"]) == set(ref_grads)
            for n, g in got["grads"].items():
                err = rel_err(g, ref_grads[n])
                assert err < TOL, f"grad of {n} on rank {r}: rel err {err:.2e} ({msg})"


CASES = [
    dict(projection="qwen3_next", hidden=32, H=2, HV=4, K=16, V=16, B=2, T=21, chunk=64, conv_bias=False),
    dict(projection="qwen3_5", hidden=24, H=2, HV=2, K=16, V=32, B=1, T=19, chunk=64, conv_bias=True),
]


def test_tp_two_ranks(tmp_path):
    _check(CASES, 2, tmp_path)


def test_shard_and_merge_roundtrip():
    from gdn.distributed import merge_state_dicts, shard_index, shard_state_dict

    cfg = dict(num_k_heads=6, num_v_heads=12, head_k_dim=3, head_v_dim=5, projection="qwen3_next")
    H, HV, K, V, hid = 6, 12, 3, 5, 7
    full = {
        "in_proj_qkvz.weight": torch.randn(2 * H * K + 2 * HV * V, hid),
        "in_proj_ba.weight": torch.randn(2 * HV, hid),
        "conv1d.weight": torch.randn(2 * H * K + HV * V, 1, 4),
        "A_log": torch.randn(HV), "dt_bias": torch.randn(HV),
        "norm.weight": torch.randn(V), "out_proj.weight": torch.randn(hid, HV * V),
    }
    for world in (1, 2, 3):
        shards = [shard_state_dict(full, cfg, r, world) for r in range(world)]
        assert shards[0]["in_proj_qkvz.weight"].shape[0] == full["in_proj_qkvz.weight"].shape[0] // world
        merged = merge_state_dicts(shards, cfg)
        for n in full:
            assert torch.equal(merged[n], full[n]), n
    # rank 1 of 2 keeps the second half of the q, k and v channel blocks of the conv
    _, idx = shard_index("conv1d.weight", cfg, 1, 2)
    assert idx[:H // 2 * K].tolist() == list(range(H // 2 * K, H * K))
    with pytest.raises(ValueError, match="divisible"):
        shard_index("A_log", cfg, 0, 4)
    with pytest.raises(ValueError, match="no sharding rule"):
        shard_index("out_proj.bias", cfg, 0, 2)
