"""Tensor parallelism for :class:`gdn.layers.GatedDeltaNet`: heads sharded over a process group (Megatron style).

Rank ``r`` of a group of size ``P`` keeps key heads ``[r H/P, (r+1) H/P)`` and value heads ``[r HV/P, (r+1) HV/P)``
(value head ``hv`` reads key head ``hv // (HV/H)``, so a contiguous block of value heads reads only its own block of
key heads). Then

* the in-projections (``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head, or ``in_proj_qkv`` / ``in_proj_z`` /
  ``in_proj_b`` / ``in_proj_a``) are column-parallel: each rank keeps the output rows of its heads;
* the depthwise conv keeps its Q|K|V channels, ``A_log`` / ``dt_bias`` their heads: everything up to the gated
  RMSNorm is local (the norm is per head);
* ``out_proj`` is row-parallel (the input columns of its value heads): the partial outputs are summed with one
  ``all_reduce`` forward (:func:`reduce_from_tensor_parallel_region`), and the partial input gradients with one
  ``all_reduce`` backward (:func:`copy_to_tensor_parallel_region` on the layer input);
* the norm weight ``[V]`` is shared by all heads, so it is replicated and its gradient (a partial sum over the local
  heads) is all-reduced by a gradient hook (:func:`allreduce_grad_in_backward`).

Per layer and step: one all-reduce of ``[B, T, hidden]`` forward and one backward, as in Megatron's attention.

:func:`shard_gated_deltanet` turns a full layer (identical weights on every rank) into the rank's shard;
:func:`shard_state_dict` / :func:`merge_state_dicts` map full <-> per-rank tensors without communication (checkpoints,
tests) and :func:`gather_full_state_dict` all-gathers a sharded layer's parameters (or gradients) into full tensors.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = [
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "allreduce_grad_in_backward",
    "shard_index",
    "shard_state_dict",
    "merge_state_dicts",
    "shard_gated_deltanet",
    "gather_full_state_dict",
]


# ----------------------------------------------------------------------------------------------------------------------
# communication with autograd
# ----------------------------------------------------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def copy_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Input of a column-parallel region: identity forward, gradient summed over ``group`` backward."""
    return x if _world(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Output of a row-parallel region: partial results summed over ``group`` forward, identity backward."""
    return x if _world(group) == 1 else _ReduceFromRegion.apply(x, group)


_HOOK_FLAG = "_gdn_tp_allreduce_grad"


def allreduce_grad_in_backward(param: torch.Tensor, group=None) -> None:
    """Sum ``param``'s gradient over ``group`` as it is computed (a replicated parameter that each rank applies to
    different heads, e.g. the norm weight). Idempotent: a second call on the same parameter does nothing."""
    if _world(group) == 1 or getattr(param, _HOOK_FLAG, False):
        return

    def hook(grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(hook)
    setattr(param, _HOOK_FLAG, True)


# ----------------------------------------------------------------------------------------------------------------------
# which rows of every parameter a rank keeps
# ----------------------------------------------------------------------------------------------------------------------
def _blocks(starts: torch.Tensor, size: int) -> torch.Tensor:
    return (starts[:, None] * size + torch.arange(size)[None, :]).reshape(-1)


def shard_index(name: str, config: Dict, rank: int, world: int) -> Optional[tuple]:
    """``(dim, index)``: the entries of the full parameter ``name`` that ``rank`` of ``world`` keeps (``index`` along
    ``dim``), or ``None`` for a replicated parameter (the norm weight).

    ``config``: ``num_k_heads, num_v_heads, head_k_dim, head_v_dim, projection`` of the full layer.
    """
    H, HV, K, V = config["num_k_heads"], config["num_v_heads"], config["head_k_dim"], config["head_v_dim"]
    if H % world != 0:
        raise ValueError(f"tp_group: num_k_heads = {H} is not divisible by the group size {world}")
    r = HV // H
    Hl, HVl = H // world, HV // world
    kh = torch.arange(rank * Hl, (rank + 1) * Hl)
    vh = torch.arange(rank * HVl, (rank + 1) * HVl)
    qkv = torch.cat([_blocks(kh, K), H * K + _blocks(kh, K), 2 * H * K + _blocks(vh, V)])
    base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    if base == "norm":
        return None
    if base == "in_proj_qkvz":
        return 0, _blocks(kh, 2 * K + 2 * r * V)
    if base == "in_proj_ba":
        return 0, _blocks(kh, 2 * r)
    if base in ("in_proj_qkv", "conv1d"):
        return 0, qkv
    if base == "in_proj_z":
        return 0, _blocks(vh, V)
    if base in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
        return 0, vh
    if name == "out_proj.weight":
        return 1, _blocks(vh, V)
    raise ValueError(f"tensor parallelism: no sharding rule for parameter {name!r} (out_proj needs bias=False)")


def _config(layer) -> Dict:
    return {"num_k_heads": layer.num_k_heads, "num_v_heads": layer.num_v_heads, "head_k_dim": layer.head_k_dim,
            "head_v_dim": layer.head_v_dim, "projection": layer.projection}


def shard_state_dict(full: Dict[str, torch.Tensor], config: Dict, rank: int, world: int) -> Dict[str, torch.Tensor]:
    """The tensors of ``rank`` from a full layer's state dict (or a dict of full gradients)."""
    out = {}
    for name, t in full.items():
        rule = shard_index(name, config, rank, world)
        out[name] = t.clone() if rule is None else t.index_select(rule[0], rule[1].to(t.device)).clone()
    return out


def merge_state_dicts(shards: List[Dict[str, torch.Tensor]], config: Dict) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`shard_state_dict`: full tensors from the per-rank dicts (replicated ones from rank 0)."""
    world = len(shards)
    out = {}
    for name, t0 in shards[0].items():
        rule = shard_index(name, config, 0, world)
        if rule is None:
            out[name] = t0.clone()
            continue
        dim = rule[0]
        shape = list(t0.shape)
        shape[dim] *= world
        full = t0.new_empty(shape)
        for r, sd in enumerate(shards):
            full.index_copy_(dim, shard_index(name, config, r, world)[1].to(t0.device), sd[name])
        out[name] = full
    return out


# ----------------------------------------------------------------------------------------------------------------------
# layers
# ----------------------------------------------------------------------------------------------------------------------
def shard_gated_deltanet(layer, tp_group=None):
    """The shard of a full :class:`gdn.layers.GatedDeltaNet` for this rank of ``tp_group`` (default: the world).

    ``layer`` must hold the same weights on every rank (e.g. built from one seed or loaded from one checkpoint). Returns
    a new ``GatedDeltaNet(..., tp_group=tp_group)`` on the same device and dtype holding this rank's heads; its forward
    takes the full ``hidden_states`` and returns the full output on every rank (one all-reduce), and equals the full
    layer's forward and gradients (input gradient all-reduced; the replicated norm weight's gradient all-reduced).
    The original layer is left untouched.
    """
    if getattr(layer, "tp_size", 1) != 1:
        raise ValueError(f"layer: expected a full (unsharded) GatedDeltaNet, got one already sharded "
                         f"over {layer.tp_size} ranks")
    world = _world(tp_group)
    rank = dist.get_rank(tp_group) if world > 1 else 0
    if world > 1 and tp_group is None:  # the layer reads tp_group=None as "not sharded": name the world explicitly
        tp_group = dist.group.WORLD
    cfg = _config(layer)
    if layer.num_k_heads % world != 0:
        raise ValueError(f"tp_group: num_k_heads = {layer.num_k_heads} is not divisible by the group size {world}")
    p = layer.A_log
    shard = type(layer)(layer.hidden_size, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim,
                          layer.head_v_dim, conv_size=layer.conv_size, norm_eps=layer.norm_eps,
                          layer_idx=layer.layer_idx, projection=layer.projection,
                          conv_bias=layer.conv1d.bias is not None, chunk_size=layer.chunk_size,
                          tp_group=tp_group if world > 1 else None, cp_group=getattr(layer, "cp_group", None),
                          device=p.device, dtype=p.dtype)
    with torch.no_grad():
        sd = shard_state_dict({n: t.detach() for n, t in layer.state_dict().items()}, cfg, rank, world)
    shard.load_state_dict(sd, assign=True)  # keeps every tensor's own dtype (e.g. fp32 A_log next to bf16 weights)
    shard.train(layer.training)
    for name, prm in layer.named_parameters():
        dict(shard.named_parameters())[name].requires_grad_(prm.requires_grad)
    if world > 1:
        for name, prm in shard.named_parameters():
            if shard_index(name, cfg, rank, world) is None:
                allreduce_grad_in_backward(prm, tp_group)
    return shard


def gather_full_state_dict(shard, tp_group=None, *, grads: bool = False) -> Dict[str, torch.Tensor]:
    """All-gather a sharded layer's parameters (``grads=True``: their gradients, zeros where None) into the full
    layer's tensors, on every rank of ``tp_group``. Collective: every rank must call it."""
    world = _world(tp_group)
    if grads:
        local = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                 for n, p in shard.named_parameters()}
    else:
        local = {n: t.detach() for n, t in shard.state_dict().items()}
    if world == 1:
        return {n: t.clone() for n, t in local.items()}
    per_rank: List[Dict[str, torch.Tensor]] = [dict() for _ in range(world)]
    for name, t in local.items():
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=tp_group)
        for r in range(world):
            per_rank[r][name] = parts[r]
    return merge_state_dicts(per_rank, _config(shard))
