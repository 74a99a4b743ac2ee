"""The Gated DeltaNet block (Qwen3-Next / Qwen3.5 linear-attention layer) on gdn's ops.

Data flow (seed 004, "Block compute flow")::

    x ─ in_proj ─┬─ q|k|v (packed channels) ─ causal conv1d + SiLU ─ q, k (L2-normalised in the kernel), v ─┐
                 ├─ a, b ─ g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) ──────────────────────┤
                 │                                                             gated delta rule ─ o ────────┘
                 └─ z ─────────────────────────────────────────── gated RMSNorm(o, z) ─ out_proj ─ y

Paths: without a cache (training) the chunked op runs end to end and everything is differentiable. With a cache
(:class:`gdn.layers.GDNCache`) prefill runs the chunked op reading/writing the state pools through slot indices,
decode (one token per sequence) and speculative verification (2-D slots) run the recurrent op.

Parameter names and layouts follow Hugging Face's ``Qwen3NextGatedDeltaNet`` (``projection="qwen3_next"``:
``in_proj_qkvz`` grouped per key head, ``in_proj_ba``) or ``Qwen3_5GatedDeltaNet`` (``projection="qwen3_5"``:
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), so ``load_state_dict(hf_layer.state_dict())`` works
(see :meth:`GatedDeltaNet.from_hf`).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from .. import reference as ref
from ..backend import use_triton
from ..ops._grad_buffer import ColumnGradBuffer, merge_adjacent
from ..ops.chunk import chunk_gated_delta_rule_packed, split_packed_qkv
from ..ops.gate import gdn_gates
from ..ops.norm import gated_rms_norm
from .cache import GDNCache, GDNCacheBatch
from .norm import GatedRMSNorm

__all__ = ["GatedDeltaNet", "gated_deltanet_ref"]

PROJECTIONS = ("qwen3_next", "qwen3_5")


# ----------------------------------------------------------------------------------------------------------------------
# tensor parallelism (heads sharded over tp_group, see gdn.distributed.tensor_parallel): column-parallel
# in-projections, row-parallel out_proj
# ----------------------------------------------------------------------------------------------------------------------
def _tp_world(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


# ----------------------------------------------------------------------------------------------------------------------
# the in-projections of a training step in one GEMM
# ----------------------------------------------------------------------------------------------------------------------
def _merge_narrow(parts, rows: int, narrow: int = 256):
    """(gradient, width) parts, adjacent parts narrower than ``narrow`` (the gate projections b, a: HV columns, where
    they did not arrive as one block already: ``merge_adjacent``) concatenated into one (None parts as zeros): each
    product with such a part reads all of x for its weight gradient and reads + writes all of dx for its input
    gradient (~65 us per part at 4 x 4096 tokens, hidden 2048), which one product does for the merged part at once."""
    out, run = [], []

    def flush():
        if len(run) == 1:
            out.append(run[0])
        elif run:
            if all(g is None for g, _ in run):
                out.append((None, sum(n for _, n in run)))
            else:
                like = next(g for g, _ in run if g is not None)
                cols = [g.reshape(-1, n) if g is not None else like.new_zeros(rows, n) for g, n in run]
                out.append((torch.cat(cols, dim=-1), sum(n for _, n in run)))
        run.clear()

    for g, n in parts:
        if n < narrow:
            run.append((g, n))
        else:
            flush()
            out.append((g, n))
    flush()
    return out


class _RowPermutedLinear(torch.autograd.Function):
    """``x [..., hidden]`` times the rows ``perms[i]`` of the weights ``ws[i]``, stacked (one GEMM), the product split
    into ``sizes`` along its last dimension (views). Backward: one GEMM per part straight into one weight-gradient
    buffer (autograd would concatenate the parts' gradients, ~0.4 GB at 4 x 4096 tokens), dx accumulated in place
    (no add of per-projection dx), and each weight's gradient put back in its own row order by a gather with the
    inverse permutation (``index_select``'s backward is a scatter-add into a zero-filled tensor, ~5x slower). Parts
    whose gradients arrive as adjacent blocks of one buffer (the layer's z | b | a: :mod:`gdn.ops._grad_buffer`)
    take one product together."""

    @staticmethod
    def forward(ctx, x, perms, inv_perms, sizes, *ws):
        wp = torch.empty(sum(p.numel() for p in perms), x.shape[-1], dtype=ws[0].dtype, device=x.device)
        off = 0
        for w, p in zip(ws, perms):
            torch.index_select(w, 0, p, out=wp[off:off + p.numel()])
            off += p.numel()
        y = F.linear(x, wp)
        ctx.save_for_backward(x, wp, *inv_perms)
        ctx.sizes = sizes
        return tuple(torch.split(y, list(sizes), dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        x, wp, *inv = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        want_x, want_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[4:])
        dwp = torch.empty_like(wp) if want_w else None
        dx = None
        off = 0
        for g, n in _merge_narrow(merge_adjacent(grads, ctx.sizes), x2.shape[0]):
            rows = slice(off, off + n)
            off += n
            if g is None:
                if want_w:
                    dwp[rows].zero_()
                continue
            g2 = g.reshape(-1, n)
            if want_w:
                torch.mm(g2.t(), x2, out=dwp[rows])
            if want_x:
                dx = torch.mm(g2, wp[rows]) if dx is None else dx.addmm_(g2, wp[rows])
        if want_x and dx is None:
            dx = torch.zeros_like(x2)
        dws, off = [], 0
        for ip in inv:
            dws.append(dwp[off:off + ip.numel()].index_select(0, ip) if want_w else None)
            off += ip.numel()
        return (dx.view_as(x) if want_x else None, None, None, None, *dws)


# ----------------------------------------------------------------------------------------------------------------------
# the block
# ----------------------------------------------------------------------------------------------------------------------
def _plain_module(m: nn.Module, cls) -> bool:
    """Whether ``m`` is exactly a ``cls`` (no subclass) without forward hooks, so its forward may be replaced by the
    function it calls."""
    from torch.nn.modules import module as _mod

    return (type(m) is cls and not m._forward_hooks and not m._forward_pre_hooks
            and not _mod._global_forward_hooks and not _mod._global_forward_pre_hooks)


def _plain_linear(m: nn.Module) -> bool:
    """Whether calling ``m`` is exactly ``F.linear(x, m.weight)``: a plain bias-free nn.Linear without forward hooks
    (a PEFT / LoRA wrapper or a hook changes what the projection computes, so its weight alone must not be used)."""
    return _plain_module(m, nn.Linear) and m.bias is None


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet block.

    Args:
        hidden_size: model width.
        num_k_heads, num_v_heads: H (q/k heads) and HV (value heads, a multiple of H).
        head_k_dim, head_v_dim: K and V.
        conv_size: W, width of the depthwise causal conv over the packed Q|K|V channels.
        norm_eps: epsilon of the gated RMSNorm.
        layer_idx: the layer's index in a model (selects its pools in a shared :class:`GDNCache`).
        projection: ``"qwen3_next"`` (``in_proj_qkvz`` + ``in_proj_ba``, grouped per key head) or ``"qwen3_5"``
            (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
        conv_bias: give the conv a bias (Qwen3-Next has none).
        chunk_size: chunk length of the chunked op.
        tp_group: ``torch.distributed`` process group to shard heads over (tensor parallelism); the layer then holds
            ``num_k_heads / world`` key heads and ``num_v_heads / world`` value heads and all-reduces ``out_proj``.
        cp_group: ``torch.distributed`` process group to split the sequence over (context parallelism, training
            only): each rank's forward takes its contiguous slice along T of the row (``cu_seqlens`` global, the same
            on every rank) and returns that slice of the output; the conv (:func:`gdn.distributed.cp_causal_conv1d`)
            and the chunked op (:func:`gdn.distributed.cp_chunk_gated_delta_rule`) exchange halos and states.
            Parameter gradients are each rank's partial sums (all-reduce them over the group, as for data
            parallelism). Composes with ``tp_group`` (a separate group: heads sharded over one, tokens over the other).
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_size: int = 4, norm_eps: float = 1e-6, *, layer_idx: int = 0, projection: str = "qwen3_next",
                 conv_bias: bool = False, chunk_size: int = 64, tp_group=None, cp_group=None, device=None,
                 dtype=None):
        super().__init__()
        if projection not in PROJECTIONS:
            raise ValueError(f"projection: expected one of {PROJECTIONS}, got {projection!r}")
        if num_k_heads < 1 or num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads: expected a multiple of num_k_heads = {num_k_heads}, got {num_v_heads}")
        if conv_size < 2:
            raise ValueError(f"conv_size: expected at least 2, got {conv_size}")
        tp, _ = _tp_world(tp_group)
        if num_k_heads % tp != 0:
            raise ValueError(f"tp_group: num_k_heads = {num_k_heads} is not divisible by the group size {tp}")
        fk = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_size = self.conv_kernel_size = conv_size
        self.norm_eps = norm_eps
        self.layer_idx = layer_idx
        self.projection = projection
        self.chunk_size = chunk_size
        self.tp_group = tp_group if tp > 1 else None
        self.tp_size = tp
        self.cp_group = cp_group
        self.local_num_k_heads, self.local_num_v_heads = num_k_heads // tp, num_v_heads // tp
        H, HV, K, V = self.local_num_k_heads, self.local_num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = H * K, HV * V
        self.conv_dim = 2 * self.key_dim + self.value_dim

        if projection == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **fk)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * HV, bias=False, **fk)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False, **fk)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False, **fk)
            self.in_proj_b = nn.Linear(hidden_size, HV, bias=False, **fk)
            self.in_proj_a = nn.Linear(hidden_size, HV, bias=False, **fk)
        # depthwise conv weight [conv_dim, 1, W] as in HF (only the parameter is used: the op takes [D, W])
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_size, groups=self.conv_dim, bias=conv_bias,
                                padding=conv_size - 1, **fk)
        self.A_log = nn.Parameter(torch.empty(HV, **fk))
        self.dt_bias = nn.Parameter(torch.empty(HV, **fk))
        self.norm = GatedRMSNorm(V, eps=norm_eps, **fk)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **fk)
        self.reset_gate_parameters()
        if self.tp_group is not None:  # the norm weight is shared by every head: sum its gradient over the group
            from ..distributed.tensor_parallel import allreduce_grad_in_backward

            allreduce_grad_in_backward(self.norm.weight, self.tp_group)

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 0.1, A_range=(1.0, 16.0)):
        """Mamba-2 style gate init: ``A ~ U(A_range)``, ``dt ~ logU(dt_min, dt_max)``, ``dt_bias = softplus^-1(dt)``."""
        HV = self.A_log.shape[0]
        A = torch.empty(HV, dtype=torch.float32).uniform_(*A_range)
        self.A_log.copy_(torch.log(A))
        dt = torch.exp(torch.rand(HV) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    @classmethod
    def from_hf(cls, hf_layer: nn.Module, **kwargs) -> "GatedDeltaNet":
        """A GatedDeltaNet with the weights of a Hugging Face ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``."""
        projection = "qwen3_next" if hasattr(hf_layer, "in_proj_qkvz") else "qwen3_5"
        w = hf_layer.A_log
        tp_group = kwargs.pop("tp_group", None)
        layer = cls(hf_layer.hidden_size, hf_layer.num_k_heads, hf_layer.num_v_heads, hf_layer.head_k_dim,
                    hf_layer.head_v_dim, conv_size=hf_layer.conv_kernel_size, norm_eps=hf_layer.layer_norm_epsilon,
                    layer_idx=getattr(hf_layer, "layer_idx", 0) or 0, projection=projection,
                    conv_bias=hf_layer.conv1d.bias is not None, device=w.device, dtype=w.dtype, **kwargs)
        layer.load_state_dict(hf_layer.state_dict())
        if tp_group is not None:  # full weights first, then this rank's shard of the heads
            from ..distributed.tensor_parallel import shard_gated_deltanet

            layer = shard_gated_deltanet(layer, tp_group)
        return layer

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads=(k {self.num_k_heads}, v {self.num_v_heads}), "
                f"head_dims=(k {self.head_k_dim}, v {self.head_v_dim}), conv_size={self.conv_size}, "
                f"projection={self.projection!r}, layer_idx={self.layer_idx}"
                + (f", tp={self.tp_size}" if self.tp_size > 1 else ""))

    # ------------------------------------------------------------------------------------------------------------------
    # pieces
    # ------------------------------------------------------------------------------------------------------------------
    @property
    def conv_weight(self) -> torch.Tensor:
        """``[conv_dim, W]`` view of the conv weight (what the ops take)."""
        return self.conv1d.weight.squeeze(1)

    def _project(self, x: torch.Tensor, dtype: Optional[torch.dtype] = None, packed: Optional[bool] = None):
        """``x [B, T, hidden]`` -> ``mixed_qkv [B, T, conv_dim]`` (Q|K|V channels), ``z [B, T, HV, V]``, ``b``, ``a``
        ``[B, T, HV]``. With ``dtype`` the weights are cast (the reference forward in float64). ``packed`` (qwen3_next):
        reorder the weight rows instead of the outputs; None = when there are at least ``hidden_size`` tokens (then
        the weight is the smaller tensor to move) and both in-projections are plain nn.Linear modules without hooks
        (else the modules are called); the oracle passes False (the plain unpacking)."""
        B, T = x.shape[:2]
        H, HV, K, V = self.local_num_k_heads, self.local_num_v_heads, self.head_k_dim, self.head_v_dim
        r = HV // H

        def lin(m):
            return m(x) if dtype is None else F.linear(x, m.weight.to(dtype))

        if packed is None:
            packed = B * T >= self.hidden_size and self.projection == "qwen3_next" and all(
                _plain_linear(m) for m in (self.in_proj_qkvz, self.in_proj_ba))
        if self.projection == "qwen3_next" and packed:
            # many tokens: gather the weight rows into Q|K|V|Z|B|A order, so one product comes out packed and is
            # split into views, instead of copying the activations into that order (_RowPermutedLinear: its backward
            # writes the weight gradients without concatenating the parts' gradients)
            pq, pba, ipq, ipba = self._packed_row_order(x.device)
            wq, wba = self.in_proj_qkvz.weight, self.in_proj_ba.weight
            if dtype is not None:
                wq, wba = wq.to(dtype), wba.to(dtype)
            if torch.compiler.is_compiling():
                mixed, z = torch.split(F.linear(x, wq.index_select(0, pq)), [self.conv_dim, HV * V], dim=-1)
                b, a = torch.split(F.linear(x, wba.index_select(0, pba)), [HV, HV], dim=-1)
            else:
                mixed, z, b, a = _RowPermutedLinear.apply(x, (pq, pba), (ipq, ipba), (self.conv_dim, HV * V, HV, HV),
                                                          wq, wba)
            return mixed, z.unflatten(-1, (HV, V)), b, a
        if self.projection == "qwen3_next" and dtype is None:
            # few tokens: the activations are put into Q|K|V|Z (and B|A) order: by one unpacking kernel without
            # autograd (decode steps), else by one index_select each (outputs are views; b, a strided)
            if not torch.is_grad_enabled() and use_triton(x.device):
                from ..kernels.unpack import unpack_qkvz_ba

                qkvz, ba = self._inference_projections(x)
                return unpack_qkvz_ba(qkvz.view(B, T, -1), ba.view(B, T, -1), H, HV, K, V)
            qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
            pq, pba = self._packed_row_order(x.device)[:2]
            mixed, z = torch.split(qkvz.index_select(-1, pq), [self.conv_dim, HV * V], dim=-1)
            b, a = torch.split(ba.index_select(-1, pba), [HV, HV], dim=-1)
            return mixed, z.unflatten(-1, (HV, V)), b, a
        if self.projection == "qwen3_next":   # the oracle's plain unpacking (float64)
            qkvz = lin(self.in_proj_qkvz).view(B, T, H, 2 * K + 2 * r * V)
            q, k, v, z = torch.split(qkvz, [K, K, r * V, r * V], dim=-1)
            mixed = torch.cat([q.reshape(B, T, H * K), k.reshape(B, T, H * K), v.reshape(B, T, HV * V)], dim=-1)
            b, a = torch.split(lin(self.in_proj_ba).view(B, T, H, 2 * r), [r, r], dim=-1)
            return mixed, z.reshape(B, T, HV, V), b.reshape(B, T, HV), a.reshape(B, T, HV)
        mixed = lin(self.in_proj_qkv)
        z = lin(self.in_proj_z).view(B, T, HV, V)
        return mixed, z, lin(self.in_proj_b), lin(self.in_proj_a)

    def _in_proj_modules(self) -> Tuple[nn.Module, ...]:
        if self.projection == "qwen3_next":
            return self.in_proj_qkvz, self.in_proj_ba
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def _inference_projections(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The in-projections of ``x [B, T, hidden]`` for an inference step (no autograd), each ``[B T, out]``
        (contiguous rows): one GEMM where the weights lie back to back in memory (:meth:`_packed_in_proj_weight`),
        else one call per module."""
        mods = self._in_proj_modules()
        x2 = x.reshape(-1, x.shape[-1])
        w = self._packed_in_proj_weight(mods)
        if w is None:
            return tuple(m(x2) for m in mods)
        return torch.split(F.linear(x2, w), [m.out_features for m in mods], dim=-1)

    def _packed_in_proj_weight(self, mods) -> Optional[torch.Tensor]:
        """``[sum out, hidden]`` view over the in-projection weights when they are stored back to back, so that a
        decode step runs one GEMM instead of two (four); the 2048 x 64 ``ba`` product alone costs ~5 us at N = 256.
        The first inference step (outside CUDA-graph capture) packs plain bias-free weights (one dtype and device,
        each owning its storage or in the buffer packed before: not a view into someone's flat parameter) into one
        buffer of which the Parameters' data become views: same Parameters, same values, no extra memory. A weight
        replaced later (``.to()``, loading with ``assign``) is packed again; None where the modules or weights do not
        allow it."""
        ws = [m.weight for m in mods]
        if torch.compiler.is_compiling() or not all(_plain_linear(m) and type(w) is nn.Parameter
                                                    for m, w in zip(mods, ws)):
            return None
        w0 = ws[0]
        if any(w.dtype != w0.dtype or w.device != w0.device or w.dim() != 2 or w.shape[1] != w0.shape[1]
               or not w.is_contiguous() for w in ws):
            return None
        rows, off = sum(w.shape[0] for w in ws), 0
        for w in ws:
            if w.data_ptr() != w0.data_ptr() + off * w0.element_size():
                break
            off += w.numel()
        else:
            if w0.untyped_storage().nbytes() >= w0.storage_offset() * w0.element_size() + off * w0.element_size():
                return torch.as_strided(w0.detach(), (rows, w0.shape[1]), (w0.shape[1], 1))
        ours = self.__dict__.get("_in_proj_storage")    # data_ptr of the buffer this method packed last
        owns = all(w.untyped_storage().data_ptr() == ours or (
            w.storage_offset() == 0 and w.untyped_storage().nbytes() == w.numel() * w.element_size()) for w in ws)
        if not owns or torch.is_grad_enabled() or (w0.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        buf = torch.cat([w.detach() for w in ws])
        off = 0
        for m, w in zip(mods, ws):
            m.weight.data = buf[off:off + w.shape[0]]
            off += w.shape[0]
        self.__dict__["_in_proj_storage"] = buf.untyped_storage().data_ptr()
        return buf

    def _packed_row_order(self, device) -> Tuple[torch.Tensor, ...]:
        """Row indices that reorder ``in_proj_qkvz`` (grouped per key head h: ``q_h | k_h | v_h | z_h``) into
        ``Q | K | V | Z`` (each head-major, as the unpacking in :meth:`_project` orders them) and ``in_proj_ba``
        (``b_h | a_h``) into ``B | A``, then their inverse permutations; cached per device in eager (a traced graph
        builds them: torch 2.11's dynamo cannot trace ``__dict__.setdefault``)."""
        if torch.compiler.is_compiling():
            return self._row_order(device)
        cache = self.__dict__.setdefault("_row_order_cache", {})
        if device not in cache:
            cache[device] = self._row_order(device)
        return cache[device]

    def _row_order(self, device) -> Tuple[torch.Tensor, torch.Tensor]:
        H, K, V = self.local_num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.local_num_v_heads // H
        blk = torch.arange(H, device=device)[:, None] * (2 * K + 2 * r * V)
        parts = [blk + off + torch.arange(n, device=device)[None, :] for off, n in
                 ((0, K), (K, K), (2 * K, r * V), (2 * K + r * V, r * V))]
        pq = torch.cat([p.reshape(-1) for p in parts])
        blk = torch.arange(H, device=device)[:, None] * (2 * r)
        pba = torch.cat([(blk + off + torch.arange(r, device=device)[None, :]).reshape(-1) for off in (0, r)])
        return pq, pba, torch.argsort(pq), torch.argsort(pba)

    def _split_qkv(self, y: torch.Tensor):
        """Strided q/k/v views (last dimension contiguous) of the packed conv output ``[B, T, conv_dim]``
        (:func:`gdn.ops.chunk.split_packed_qkv`)."""
        return split_packed_qkv(y, self.local_num_k_heads, self.head_k_dim, self.local_num_v_heads, self.head_v_dim)

    def _resolve_cache(self, cache, N: int) -> Optional[GDNCacheBatch]:
        if cache is None:
            return None
        if isinstance(cache, GDNCache):
            if N > cache.num_slots:
                raise ValueError(f"cache: {N} sequences but the cache has {cache.num_slots} slots; pass "
                                 "cache.batch(slots) with allocated slots")
            cache = cache.batch(torch.arange(N, dtype=torch.int32, device=cache.device))
        if not isinstance(cache, GDNCacheBatch):
            raise TypeError(f"cache: expected a GDNCache or GDNCacheBatch (GDNCache.batch(slots)), got "
                            f"{type(cache).__name__}")
        if cache.slots.shape[0] != N:
            raise ValueError(f"cache: expected slots for the {N} sequences of the batch, got shape "
                             f"{tuple(cache.slots.shape)}")
        c = cache.cache
        if (c.conv_dim, c.conv_size, c.num_v_heads, c.head_k_dim, c.head_v_dim) != (
                self.conv_dim, self.conv_size, self.local_num_v_heads, self.head_k_dim, self.head_v_dim):
            raise ValueError(f"cache: pools of shape conv_dim={c.conv_dim}, W={c.conv_size}, HV={c.num_v_heads}, "
                             f"K={c.head_k_dim}, V={c.head_v_dim} do not fit this layer (conv_dim={self.conv_dim}, "
                             f"W={self.conv_size}, HV={self.local_num_v_heads}, K={self.head_k_dim}, "
                             f"V={self.head_v_dim})")
        return cache

    # ------------------------------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, cache=None, cu_seqlens: Optional[torch.Tensor] = None, *,
                mode: Optional[str] = None) -> torch.Tensor:
        """``hidden_states [B, T, hidden]`` (varlen: ``B == 1`` and ``cu_seqlens [N + 1]``) -> ``[B, T, hidden]``.

        ``cache``: None (training / stateless: chunked op, differentiable), a :class:`GDNCache` (slots ``0..N-1``)
        or ``cache.batch(slots)``. A cached step is inference: it runs without autograd (the output does not require
        grad) and updates the cache's state pools in place. With a cache, ``mode`` picks the path: ``"prefill"``
        (chunked op), ``"decode"`` (recurrent op; any lengths, meant for a few tokens per sequence) or None: decode
        when every sequence has one token (``T == 1``, or ``T == N`` with ``cu_seqlens``), else prefill. 2-D slots
        always take the speculative path (recurrent op, per-token states).
        """
        x = hidden_states
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [B, T, {self.hidden_size}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        B, T = x.shape[:2]
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"cu_seqlens: varlen batches need B == 1 (sequences packed along T), got B = {B}")
        if mode not in (None, "prefill", "decode"):
            raise ValueError(f"mode: expected None, 'prefill' or 'decode', got {mode!r}")
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        batch = self._resolve_cache(cache, N)
        if batch is not None and torch.is_grad_enabled():
            with torch.no_grad():  # cached steps are inference: the state pools are updated in place
                return self._forward(x, batch, cu_seqlens, mode)
        return self._forward(x, batch, cu_seqlens, mode)

    def _forward(self, x, batch: Optional[GDNCacheBatch], cu_seqlens, mode):
        B, T = x.shape[:2]
        if self.tp_group is not None:
            from ..distributed.tensor_parallel import copy_to_tensor_parallel_region

            x = copy_to_tensor_parallel_region(x, self.tp_group)

        if batch is not None and self._fused_step(x, batch, cu_seqlens, mode):
            o = self._decode_step(x, batch)      # already through the gated norm
        else:
            o = self._mix(x, batch, cu_seqlens, mode)
        out = self.out_proj(o.reshape(B, T, self.value_dim))
        if self.tp_group is not None:
            from ..distributed.tensor_parallel import reduce_from_tensor_parallel_region

            out = reduce_from_tensor_parallel_region(out, self.tp_group)
        return out

    def _mix(self, x, batch: Optional[GDNCacheBatch], cu_seqlens, mode) -> torch.Tensor:
        """In-projections, conv, the gated delta rule (chunked / recurrent / verify / context-parallel) and the gated
        norm as separate kernels: the normed ``o [B, T, HV, V]``."""
        B, T = x.shape[:2]
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        mixed, z, b, a = self._project(x)
        w, bias = self.conv_weight, self.conv1d.bias
        if self.cp_group is not None:
            if batch is not None:
                raise ValueError("cache: a context-parallel layer (cp_group) runs training / stateless forwards only")
            o = self._cp_forward(mixed, a, b, cu_seqlens)
        elif batch is None:
            y = ops.causal_conv1d(mixed, w, bias, "silu", cu_seqlens=cu_seqlens)
            gb = self._zba_grad_buffer()
            o = self._chunk(y, a, b, cu_seqlens, None, None, gb)
            return self._norm(o, z, gb)
        elif batch.speculative:
            o = self._verify(mixed, a, b, batch, cu_seqlens)
        else:
            c, slots = batch.cache, batch.slots
            conv_pool, ssm_pool = c.conv_pool(self.layer_idx), c.ssm_pool(self.layer_idx)
            decode = mode == "decode" or (mode is None and (T == 1 if cu_seqlens is None else T == N))
            if decode and cu_seqlens is None:
                y = ops.causal_conv1d_update(mixed, conv_pool, w, bias, "silu", conv_state_indices=slots)
            else:
                y = ops.causal_conv1d(mixed, w, bias, "silu", cu_seqlens=cu_seqlens, conv_state=conv_pool,
                                      conv_state_indices=slots)
            if decode:
                q, k, v = self._split_qkv(y)
                o, _ = ops.fused_recurrent_gated_delta_rule(
                    q, k, v, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, initial_state=ssm_pool,
                    state_layout=c.state_layout, ssm_state_indices=slots, inplace_final_state=True,
                    A_log=self.A_log, a=a, dt_bias=self.dt_bias, b=b)
            else:
                o = self._chunk(y, a, b, cu_seqlens, ssm_pool, batch)
        return self.norm(o, z)

    def _fused_step(self, x, batch: GDNCacheBatch, cu_seqlens, mode) -> bool:
        """Whether this cached step runs as one fused kernel (:mod:`gdn.kernels.decode_step`): one token per sequence
        (``T == 1``, no ``cu_seqlens``), 1-D slots, the Triton backend, the layer's own gated norm, not traced by
        torch.compile, the ``decode_step`` tuning row's ``fused`` switch on (for the state's dtype and layout)."""
        if (x.shape[1] != 1 or cu_seqlens is not None or mode == "prefill" or batch.speculative
                or self.cp_group is not None or not isinstance(self.norm, GatedRMSNorm) or not use_triton(x.device)
                or torch.compiler.is_compiling()):   # traced programs keep the registered custom ops
            return False
        from ..kernels import tuning
        from ..kernels.decode_step import shape_class

        c = batch.cache
        cls = shape_class(c.ssm_pool(self.layer_idx).element_size(), c.state_layout == "k_last")
        return tuning.lookup("decode_step", x.device, cls).fused

    def _decode_step(self, x, batch: GDNCacheBatch) -> torch.Tensor:
        """One decode token per sequence through :func:`gdn.kernels.decode_step.layer_decode_step`: the projections
        are read in place (strided views of the GEMM outputs), conv + L2 norm + gates + state update + gated norm in
        one launch. Returns the normed ``o [N, HV, V]`` (the out-projection's input)."""
        from ..kernels.decode_step import layer_decode_step

        N = x.shape[0]
        H, HV, K, V = self.local_num_k_heads, self.local_num_v_heads, self.head_k_dim, self.head_v_dim
        r = HV // H
        proj = self._inference_projections(x)     # [N, out] row views of the GEMM output
        if self.projection == "qwen3_next":        # per key head: q_h | k_h | v_h | z_h and b_h | a_h
            q, k, v, z = torch.split(proj[0].view(N, H, -1), [K, K, r * V, r * V], dim=-1)
            b, a = torch.split(proj[1].view(N, H, -1), [r, r], dim=-1)
        else:                                      # Q | K | V, then z, b, a
            q, k, v = torch.split(proj[0], [H * K, H * K, HV * V], dim=-1)
            q, k, v = q.view(N, H, K), k.view(N, H, K), v.view(N, H, r * V)
            z, b, a = (t.view(N, H, -1) for t in proj[1:])
        c, slots = batch.cache, batch.slots
        y = torch.empty(N, HV, V, dtype=x.dtype, device=x.device)
        return layer_decode_step(q, k, v, z, b, a, self.conv_weight, self.conv1d.bias, c.conv_pool(self.layer_idx),
                                 self.A_log, self.dt_bias, self.norm.weight, slots, c.ssm_pool(self.layer_idx), y,
                                 c.step_counters, scale=K ** -0.5, eps=self.norm.eps,
                                 k_last=c.state_layout == "k_last")

    def _cp_forward(self, mixed, a, b, cu_seqlens):
        """This rank's slice of conv + gated delta rule under context parallelism (slice lengths found once)."""
        from ..distributed import cp_causal_conv1d, cp_chunk_gated_delta_rule
        from ..distributed._shards import shard_offsets

        offs = shard_offsets(mixed.shape[1], mixed.device, self.cp_group)
        lens = [e - s for s, e in zip(offs[:-1], offs[1:])]
        y = cp_causal_conv1d(mixed, self.conv_weight, self.conv1d.bias, "silu", cu_seqlens=cu_seqlens,
                             group=self.cp_group, shard_lengths=lens)
        q, k, v = self._split_qkv(y)
        g = ops.gdn_gate(a, self.A_log, self.dt_bias)
        o, _ = cp_chunk_gated_delta_rule(q, k, v, g, b.sigmoid(), use_qk_l2norm_in_kernel=True,
                                         cu_seqlens=cu_seqlens, group=self.cp_group, chunk_size=self.chunk_size,
                                         shard_lengths=lens)
        return o

    def _zba_grad_buffer(self) -> Optional[ColumnGradBuffer]:
        """Where a training step's backward writes the gradients of z, b and a side by side (their in-projection
        columns are adjacent: one product for the three in ``_RowPermutedLinear``'s backward): when the gated norm is
        this library's plain module (no hooks), outside torch.compile's tracing."""
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not _plain_module(self.norm, GatedRMSNorm):
            return None
        HV, V = self.local_num_v_heads, self.head_v_dim
        return ColumnGradBuffer({"z": HV * V, "b": HV, "a": HV})

    def _norm(self, o, z, grad_buffer):
        if grad_buffer is None:
            return self.norm(o, z)
        return gated_rms_norm(o, z, self.norm.weight, self.norm.eps, _grad_buffer=grad_buffer)

    def _chunk(self, y, a, b, cu_seqlens, ssm_pool, batch, grad_buffer=None):
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias, grad_buffer=grad_buffer)
        if batch is None:   # q|k|v kept packed: a training backward writes y's gradient as one tensor
            return chunk_gated_delta_rule_packed(y, self.local_num_k_heads, self.head_k_dim, self.local_num_v_heads,
                                                 self.head_v_dim, g, beta, cu_seqlens=cu_seqlens,
                                                 use_qk_l2norm_in_kernel=True, chunk_size=self.chunk_size)
        q, k, v = self._split_qkv(y)
        o, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=ssm_pool, output_final_state=True,
                                          cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
                                          state_layout=batch.cache.state_layout, ssm_state_indices=batch.slots,
                                          chunk_size=self.chunk_size)
        return o

    def _verify(self, mixed, a, b, batch: GDNCacheBatch, cu_seqlens):
        """Speculative step: T tokens per sequence, the state after token t written to slot column t.

        The recurrent op does this for the SSM state (2-D ``ssm_state_indices``, ``num_accepted_tokens``,
        ``inplace_final_state``). The conv state is kept the same way: the window of the last ``W - 1`` inputs after
        token t goes to ``conv_pool[slots[n, t]]``, and the step starts from ``conv_pool[slots[n, acc - 1]]``, so a
        rejected draft never has to be undone.
        """
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: speculative (2-D slot) steps take hidden_states [N, T, hidden] with the same "
                             "T for every sequence, not a varlen batch")
        c, slots, acc = batch.cache, batch.slots, batch.num_accepted_tokens
        N, T, D = mixed.shape
        S = slots.shape[1]
        if T > S:
            raise ValueError(f"cache: a speculative step of T = {T} tokens needs at least T slot columns, got "
                             f"slots of shape {tuple(slots.shape)} (prefill new requests with the 1-D slots[:, 0])")
        W1 = self.conv_size - 1
        conv_pool, ssm_pool = c.conv_pool(self.layer_idx), c.ssm_pool(self.layer_idx)
        rows = c._rows(slots)                                                    # int64, padding -> scratch row
        src = rows.gather(1, (acc.to(torch.int64) - 1).clamp(0, S - 1)[:, None]).squeeze(1)
        prev = conv_pool[src]                                                    # [N, D, W-1] (a copy)
        with torch.no_grad():
            xx = torch.cat([prev, mixed.detach().transpose(1, 2).to(prev.dtype)], dim=-1)   # [N, D, W-1+T]
            win = xx.unfold(2, W1, 1)[:, :, 1:]                                  # [N, D, T, W-1]
            conv_pool[rows[:, :T].reshape(-1)] = win.permute(0, 2, 1, 3).reshape(N * T, D, W1)
        y = ops.causal_conv1d_update(mixed, prev, self.conv_weight, self.conv1d.bias, "silu")
        q, k, v = self._split_qkv(y)
        o, _ = ops.fused_recurrent_gated_delta_rule(
            q, k, v, use_qk_l2norm_in_kernel=True, initial_state=ssm_pool, state_layout=c.state_layout,
            ssm_state_indices=slots, num_accepted_tokens=acc, inplace_final_state=True,
            A_log=self.A_log, a=a, dt_bias=self.dt_bias, b=b)
        return o


# ----------------------------------------------------------------------------------------------------------------------
# the oracle
# ----------------------------------------------------------------------------------------------------------------------
def gated_deltanet_ref(layer: GatedDeltaNet, hidden_states: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                       conv_state: Optional[torch.Tensor] = None, ssm_state: Optional[torch.Tensor] = None, *,
                       dtype: torch.dtype = torch.float64, state_layout: str = "v_last"):
    """The block in plain PyTorch (``gdn.reference``) with ``layer``'s weights, computed in ``dtype``.

    ``conv_state [N, conv_dim, W-1]`` and ``ssm_state [N, HV, K, V]`` are the states before each sequence (zeros when
    None). Returns ``(y [B, T, hidden] in dtype, final conv_state [N, conv_dim, W-1], final ssm_state [N, HV, K, V])``.
    Token-by-token recurrence (``recurrent_gated_delta_rule_ref``): independent of the chunked algorithm.
    """
    x = hidden_states.to(dtype)
    B, T = x.shape[:2]
    cast = (lambda t: None if t is None else t.to(dtype))  # noqa: E731
    mixed, z, b, a = layer._project(x, dtype=dtype, packed=False)
    y, conv_final = ref.causal_conv1d_ref(mixed, cast(layer.conv_weight), cast(layer.conv1d.bias), "silu",
                                          cu_seqlens=cu_seqlens, initial_conv_state=cast(conv_state))
    q, k, v = layer._split_qkv(y)
    g = ref.gdn_gate_ref(a, cast(layer.A_log), cast(layer.dt_bias))
    beta = torch.sigmoid(b)
    o, ssm_final = ref.recurrent_gated_delta_rule_ref(q, k, v, g, beta, None, cast(ssm_state), True, cu_seqlens, True,
                                                      state_layout=state_layout)
    o = ref.gated_rmsnorm_ref(o, z, cast(layer.norm.weight), layer.norm_eps)
    out = F.linear(o.reshape(B, T, layer.value_dim), cast(layer.out_proj.weight))
    return out, conv_final, ssm_final
