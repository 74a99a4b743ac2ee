"""State cache of the GDN block: conv-state and recurrent-state pools shared by all GDN layers of a model.

A request (sequence) owns one *slot* (or, for speculative decoding, one row of slots ``[S]``) that is valid in every
layer: the cache holds, per layer, a conv-state pool ``[P, conv_dim, W-1]`` (oldest input first) and a recurrent-state
pool ``[P, HV, K, V]`` (``v_last``) or ``[P, HV, V, K]`` (``k_last``). The GDN ops read and write these pools in
place through slot indices, so a batch is just a tensor of slot ids::

    cache = GDNCache.for_layers(layers, num_slots=64)
    slots = cache.allocate(3)                        # int32 [3], rows zeroed
    y = layer(x, cache=cache.batch(slots), cu_seqlens=cu)     # varlen prefill of 3 requests
    y = layer(x1, cache=cache.batch(slots))          # x1 [3, 1, hidden]: one decode step each
    cache.free(slots)

Speculative decoding (vLLM's scheme, seed 002): a request owns ``S = 1 + num_draft`` slots, ``allocate(n, width=S)``
returns ``[n, S]``. A *verify* step runs ``T <= S`` tokens per request with the 2-D slot rows: the state after token
``t`` (recurrent state and conv window) is written to slot column ``t``, and the step starts from column
``num_accepted - 1`` of the previous step. After sampling, ``commit(slots, num_accepted)`` records how many of the
``T`` tokens were accepted (1..T, the bonus/sampled token included); the next 2-D step starts from there without
copying any state. ``commit(..., compact=True)`` also copies the accepted states into column 0 (all layers at once)
so that 1-D steps on ``slots[:, 0]`` (e.g. a chunked-prefill continuation) may follow. Prefill a new speculative
request with the 1-D slots ``slots[:, 0]``.

Every pool has one extra row at index ``P`` (``scratch_slot``) that padding writes are routed to by the cache's own
gathers/scatters; the ops themselves see ``-1`` for padding (nothing read or written, output zeros).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

__all__ = ["GDNCache", "GDNCacheBatch"]


@dataclass
class GDNCacheBatch:
    """The cache together with the slots of the current batch (what a GDN layer's ``forward`` takes as ``cache``).

    ``slots``: ``[N]`` (prefill / decode: one slot per sequence) or ``[N, S]`` (speculative verify: one slot per token
    position). ``num_accepted_tokens``: ``[N]`` (2-D slots only): the step starts from column
    ``num_accepted_tokens[n] - 1``.
    """
    cache: "GDNCache"
    slots: torch.Tensor
    num_accepted_tokens: Optional[torch.Tensor] = None

    @property
    def speculative(self) -> bool:
        return self.slots.dim() == 2


class GDNCache:
    """Conv-state and recurrent-state pools for ``num_layers`` GDN layers and ``num_slots`` slots.

    Args:
        num_slots: P, the number of slots (requests, or request-token positions for speculative decoding).
        conv_dim: channels of the causal conv (``2 * H * K + HV * V``).
        conv_size: W, the conv kernel width (the pool keeps the last ``W - 1`` inputs).
        num_v_heads, head_k_dim, head_v_dim: HV, K, V of the recurrent state.
        layer_ids: the ``layer_idx`` of each GDN layer using this cache (default ``range(num_layers)``).
        num_layers: number of layers when ``layer_ids`` is not given.
        dtype: recurrent-state storage dtype (float32, bfloat16 or float16; arithmetic is always float32).
        conv_dtype: conv-state dtype (default: ``dtype``; use the activation dtype to store conv inputs exactly).
        state_layout: ``"v_last"`` (``[P, HV, K, V]``) or ``"k_last"`` (``[P, HV, V, K]``).
    """

    def __init__(self, num_slots: int, *, conv_dim: int, conv_size: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, layer_ids: Optional[Sequence[int]] = None, num_layers: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, conv_dtype: Optional[torch.dtype] = None, device=None,
                 state_layout: str = "v_last"):
        if layer_ids is None:
            layer_ids = list(range(1 if num_layers is None else int(num_layers)))
        layer_ids = [int(i) for i in layer_ids]
        if len(set(layer_ids)) != len(layer_ids) or not layer_ids:
            raise ValueError(f"layer_ids: expected distinct layer indices, got {layer_ids}")
        if num_slots < 1:
            raise ValueError(f"num_slots: expected at least 1, got {num_slots}")
        if conv_size < 2:
            raise ValueError(f"conv_size: expected at least 2, got {conv_size}")
        if state_layout not in ("v_last", "k_last"):
            raise ValueError(f"state_layout: expected 'v_last' or 'k_last', got {state_layout!r}")
        for name, dt in (("dtype", dtype), ("conv_dtype", conv_dtype)):
            if dt is not None and dt not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {dt}")
        self.num_slots = int(num_slots)
        self.conv_dim, self.conv_size = int(conv_dim), int(conv_size)
        self.num_v_heads, self.head_k_dim, self.head_v_dim = int(num_v_heads), int(head_k_dim), int(head_v_dim)
        self.state_layout = state_layout
        self.layer_ids: List[int] = layer_ids
        self._layer_pos: Dict[int, int] = {lid: i for i, lid in enumerate(layer_ids)}
        L, P1 = len(layer_ids), self.num_slots + 1
        state = ((self.num_v_heads, self.head_k_dim, self.head_v_dim) if state_layout == "v_last"
                 else (self.num_v_heads, self.head_v_dim, self.head_k_dim))
        self.conv_states = torch.zeros(L, P1, self.conv_dim, self.conv_size - 1, dtype=conv_dtype or dtype,
                                       device=device)
        self.ssm_states = torch.zeros((L, P1) + state, dtype=dtype, device=device)
        # per (slot, key head): arrivals of the fused decode step's programs (gdn.kernels.decode_step), counted
        # modulo the value heads per key head; never reset (every step adds a multiple of that), shared by the layers
        self.step_counters = torch.zeros(P1 * self.num_v_heads, dtype=torch.int64, device=device)
        # per slot (the first slot of a speculative row): accepted tokens of the last committed 2-D step
        self.num_accepted = torch.ones(P1, dtype=torch.int32, device=device)
        self._free: List[int] = list(range(self.num_slots))
        self._used = set()

    # ------------------------------------------------------------------------------------------------------------------
    # construction from layers
    # ------------------------------------------------------------------------------------------------------------------
    @classmethod
    def for_layers(cls, layers: Union[torch.nn.Module, Iterable[torch.nn.Module]], num_slots: int, *,
                   dtype: torch.dtype = torch.float32, conv_dtype: Optional[torch.dtype] = None, device=None,
                   state_layout: str = "v_last") -> "GDNCache":
        """A cache for the given GDN layers (or for every GatedDeltaNet inside a model), keyed by their layer_idx."""
        from .gated_deltanet import GatedDeltaNet

        if isinstance(layers, GatedDeltaNet):
            layers = [layers]
        elif isinstance(layers, torch.nn.Module):
            layers = [m for m in layers.modules() if isinstance(m, GatedDeltaNet)]
        layers = list(layers)
        if not layers:
            raise ValueError("layers: no GatedDeltaNet layer given")
        first = layers[0]
        for lyr in layers[1:]:
            if (lyr.conv_dim, lyr.conv_size, lyr.local_num_v_heads, lyr.head_k_dim, lyr.head_v_dim) != (
                    first.conv_dim, first.conv_size, first.local_num_v_heads, first.head_k_dim, first.head_v_dim):
                raise ValueError("layers: all GDN layers sharing a cache must have the same shapes")
        if device is None:
            device = first.A_log.device
        return cls(num_slots, conv_dim=first.conv_dim, conv_size=first.conv_size,
                   num_v_heads=first.local_num_v_heads, head_k_dim=first.head_k_dim, head_v_dim=first.head_v_dim,
                   layer_ids=[lyr.layer_idx for lyr in layers], dtype=dtype, conv_dtype=conv_dtype, device=device,
                   state_layout=state_layout)

    # ------------------------------------------------------------------------------------------------------------------
    # pools
    # ------------------------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.ssm_states.device

    @property
    def scratch_slot(self) -> int:
        """Row index ``P`` of every pool: where the cache's own scatters send padding rows."""
        return self.num_slots

    def _pos(self, layer_idx: int) -> int:
        try:
            return self._layer_pos[int(layer_idx)]
        except KeyError:
            raise KeyError(f"layer_idx {layer_idx} has no pool in this cache (layers {self.layer_ids})") from None

    def conv_pool(self, layer_idx: int) -> torch.Tensor:
        """``[P + 1, conv_dim, W - 1]`` conv states of one layer (row ``P`` is scratch)."""
        return self.conv_states[self._pos(layer_idx)]

    def ssm_pool(self, layer_idx: int) -> torch.Tensor:
        """``[P + 1, HV, K, V]`` (or ``k_last``) recurrent states of one layer (row ``P`` is scratch)."""
        return self.ssm_states[self._pos(layer_idx)]

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Slot ids as int64 rows, padding (-1) mapped to the scratch row."""
        s = slots.to(device=self.device, dtype=torch.int64)
        return torch.where(s < 0, torch.full_like(s, self.scratch_slot), s)

    # ------------------------------------------------------------------------------------------------------------------
    # slot management
    # ------------------------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, width: int = 1) -> torch.Tensor:
        """Hand out ``n * width`` free slots (zeroed). Returns int32 ``[n]`` (``width == 1``) or ``[n, width]``."""
        n, width = int(n), int(width)
        if n < 0 or width < 1:
            raise ValueError(f"allocate: expected n >= 0 and width >= 1, got n = {n}, width = {width}")
        need = n * width
        if need > len(self._free):
            raise RuntimeError(f"allocate: {need} slots requested, only {len(self._free)} of {self.num_slots} free")
        ids, self._free = self._free[:need], self._free[need:]
        self._used.update(ids)
        t = torch.tensor(ids, dtype=torch.int32, device=self.device)
        self.reset(t)
        return t if width == 1 else t.view(n, width)

    def free(self, slots) -> None:
        """Return slots to the free list (padding ids < 0 are ignored)."""
        ids = [int(i) for i in torch.as_tensor(slots).reshape(-1).tolist() if int(i) >= 0]
        bad = [i for i in ids if i not in self._used]
        if bad:
            raise ValueError(f"free: slots {bad} are not allocated")
        for i in ids:
            self._used.discard(i)
        self._free.extend(ids)

    @torch.no_grad()
    def reset(self, slots) -> None:
        """Zero the conv and recurrent states of ``slots`` (all layers) and their accepted counts."""
        rows = self._rows(torch.as_tensor(slots).reshape(-1))
        self.conv_states[:, rows] = 0
        self.ssm_states[:, rows] = 0
        self.num_accepted[rows] = 1

    # ------------------------------------------------------------------------------------------------------------------
    # steps
    # ------------------------------------------------------------------------------------------------------------------
    def batch(self, slots: torch.Tensor, num_accepted_tokens: Optional[torch.Tensor] = None) -> GDNCacheBatch:
        """Bind the slots of the current batch (``[N]`` or speculative ``[N, S]``) for the layers' forward.

        For 2-D slots ``num_accepted_tokens`` defaults to what the last :meth:`commit` recorded for each row.
        """
        slots = torch.as_tensor(slots, device=self.device)
        if slots.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slots: expected int32 or int64 slot ids, got {slots.dtype}")
        if slots.dim() not in (1, 2):
            raise ValueError(f"slots: expected [N] or [N, S], got shape {tuple(slots.shape)}")
        slots = slots.contiguous()  # the kernels index slot ids by position (e.g. slots[:, 0] is a strided view)
        if slots.dim() == 2:
            if num_accepted_tokens is None:
                num_accepted_tokens = self.num_accepted[self._rows(slots[:, 0])]
            num_accepted_tokens = torch.as_tensor(num_accepted_tokens, device=self.device).to(torch.int32)
            if num_accepted_tokens.shape != slots.shape[:1]:
                raise ValueError(f"num_accepted_tokens: expected shape [{slots.shape[0]}], got "
                                 f"{tuple(num_accepted_tokens.shape)}")
        elif num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens: only meaningful with 2-D (speculative) slots [N, S]")
        return GDNCacheBatch(self, slots, num_accepted_tokens)

    @torch.no_grad()
    def commit(self, slots: torch.Tensor, num_accepted_tokens: torch.Tensor, *, compact: bool = False) -> None:
        """After a speculative step on ``slots`` ``[N, S]``: ``num_accepted_tokens[n]`` (1..S) of its tokens were kept.

        The next 2-D step of request n starts from the state after its accepted tokens (slot column
        ``num_accepted_tokens[n] - 1``). With ``compact=True`` those states (conv and recurrent, every layer) are also
        copied to column 0 and the count reset to 1, so that 1-D steps on ``slots[:, 0]`` can follow.
        """
        slots = torch.as_tensor(slots, device=self.device)
        if slots.dim() != 2:
            raise ValueError(f"slots: expected the speculative slot rows [N, S], got shape {tuple(slots.shape)}")
        acc = torch.as_tensor(num_accepted_tokens, device=self.device).to(torch.int64).reshape(-1)
        if acc.shape[0] != slots.shape[0]:
            raise ValueError(f"num_accepted_tokens: expected shape [{slots.shape[0]}], got {tuple(acc.shape)}")
        rows = self._rows(slots)
        first = rows[:, 0]
        if compact:
            col = (acc - 1).clamp(0, slots.shape[1] - 1)
            src = rows.gather(1, col[:, None]).squeeze(1)
            self.conv_states[:, first] = self.conv_states[:, src]
            self.ssm_states[:, first] = self.ssm_states[:, src]
            self.num_accepted[first] = 1
        else:
            self.num_accepted[first] = acc.to(torch.int32)
        self.num_accepted[self.scratch_slot] = 1

    def __repr__(self) -> str:
        return (f"GDNCache(num_slots={self.num_slots}, layers={self.layer_ids}, conv={tuple(self.conv_states.shape)} "
                f"{self.conv_states.dtype}, ssm={tuple(self.ssm_states.shape)} {self.ssm_states.dtype}, "
                f"layout={self.state_layout}, free={self.num_free})")
