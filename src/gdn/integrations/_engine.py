"""What the vLLM and SGLang entry points share: repointing an engine's module globals (and back), the raw gates with a
general softplus, pools whose rows are not packed, and per-token state buffers."""
from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


class Patcher:
    """Repoints module globals of one engine at gdn's functions and restores them.

    ``modules``: ``{module name: {attribute: shim}}``; modules in ``import_now`` are imported by :meth:`enable` (the
    kernel packages the engine's layers import from), the others are patched only when already imported (layer
    modules bind the names at their own import: patching the kernel packages first covers layers imported later).
    """

    def __init__(self, engine: str, modules: Dict[str, Dict[str, object]], import_now: Sequence[str]):
        self.engine = engine
        self.modules = modules
        self.import_now = tuple(import_now)
        self.saved: List[Tuple[object, str, object]] = []
        self.patched: List[str] = []

    def enable(self) -> List[str]:
        if self.patched:
            return list(self.patched)
        try:
            importlib.import_module(self.engine)
        except ImportError as e:
            raise ImportError(f"gdn.integrations.{self.engine}: {self.engine} is not importable") from e
        for name, attrs in self.modules.items():
            mod = sys.modules.get(name)
            if mod is None and name in self.import_now:
                try:
                    mod = importlib.import_module(name)
                except ImportError:
                    mod = None
            if mod is None:
                continue
            hit = False
            for attr, shim in attrs.items():
                if attr in vars(mod):
                    self.saved.append((mod, attr, vars(mod)[attr]))
                    setattr(mod, attr, shim)
                    hit = True
            if hit:
                self.patched.append(name)
        if not self.patched:
            raise RuntimeError(f"gdn.integrations.{self.engine}: none of {list(self.modules)} has GDN functions to "
                               f"patch")
        return list(self.patched)

    def disable(self) -> None:
        orig_of = {}  # id(shim) -> the engine function it replaced
        while self.saved:
            mod, attr, orig = self.saved.pop()
            orig_of[id(self.modules[mod.__name__][attr])] = orig
            setattr(mod, attr, orig)
        # layer modules imported while enabled bound the shims themselves: give them the originals too
        for name, attrs in self.modules.items():
            mod = sys.modules.get(name)
            for attr, shim in (attrs.items() if mod is not None else ()):
                if vars(mod).get(attr) is shim and id(shim) in orig_of:
                    setattr(mod, attr, orig_of[id(shim)])
        self.patched.clear()

    @contextlib.contextmanager
    def enabled(self):
        """``with enabled(): ...``: patched inside the block (restored afterwards if it was off before)."""
        was = bool(self.patched)
        if not was:
            self.enable()
        try:
            yield
        finally:
            if not was:
                self.disable()


def softplus_general(x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    """The engines' softplus: ``log(1 + exp(beta x)) / beta`` where ``beta x <= threshold``, else ``x``."""
    bx = beta * x
    return torch.where(bx <= threshold, F.softplus(bx, beta=1.0, threshold=float("inf")) / beta, x)


def raw_gates(A_log, a, dt_bias, b, softplus_beta: float, softplus_threshold: float,
              lower_bound: Optional[float] = None):
    """``(g, beta)`` fp32 for a general softplus (or the lower-bounded gate
    ``lower_bound * sigmoid(exp(A_log) (a + dt_bias))``); the kernels compute the default form themselves."""
    x = a.float() + dt_bias.float()
    if lower_bound is not None:
        g = lower_bound * torch.sigmoid(torch.exp(A_log.float()) * x)
    else:
        g = -torch.exp(A_log.float()) * softplus_general(x, softplus_beta, softplus_threshold)
    return g, torch.sigmoid(b.float())


def is_default_softplus(beta, threshold) -> bool:
    """beta = 1, threshold = 20 is torch's softplus, which gdn's kernels compute (gdn.kernels.common.softplus)."""
    return float(beta) == 1.0 and float(threshold) == 20.0


def packed_pool(pool: torch.Tensor) -> bool:
    return pool.is_contiguous()


def run_on_rows(pool: torch.Tensor, idx: torch.Tensor, run):
    """``run(pool_c, idx_c)`` on a contiguous pool. A pool whose rows are contiguous but not packed (engines' paged
    caches, ``stride(0)`` larger than a row) goes through a copy of just the rows ``idx`` names (any shape, -1 =
    padding); the rows are written back afterwards without a host sync (padding entries rewrite a row with the value
    that row gets anyway, so repeated targets carry equal values)."""
    if pool.is_contiguous():
        return run(pool, idx)
    if not pool[0].is_contiguous():
        raise ValueError(f"initial_state: each pool row must be contiguous, got strides {tuple(pool.stride())}")
    P = pool.shape[0]
    flat = idx.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < P)
    safe = flat.clamp(0, max(P - 1, 0))
    rows = pool.index_select(0, safe)
    pos = torch.arange(flat.numel(), device=flat.device)
    local = torch.where(valid, pos, torch.full_like(pos, -1)).view(idx.shape).to(idx.dtype)
    out = run(rows, local)
    j = torch.argmax(valid.to(torch.int32))  # the first valid entry (0 when none is)
    tgt = torch.where(valid, safe, safe[j])
    src = torch.where(valid, pos, pos[j])
    pool.index_copy_(0, tgt, rows.index_select(0, src))
    return out


def per_token_view(buf: torch.Tensor, name: str, HV: int, K: int, V: int, steps: int) -> torch.Tensor:
    """A per-token state buffer as ``[S, steps, HV, V, K]`` (k_last): slot pitch ``buf.stride(0)``, token pitch
    ``HV*V*K``, each slot's tokens packed (the engines' intermediate-state buffers)."""
    row = HV * V * K
    if buf.dim() < 2 or buf.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous-last-dim buffer [S, steps, HV, V, K], got shape "
                         f"{tuple(buf.shape)}")
    if buf.numel() // buf.shape[0] < row or buf.stride(0) % row:
        raise ValueError(f"{name}: each slot must hold whole states of HV*V*K = {row} elements, got shape "
                         f"{tuple(buf.shape)} with strides {tuple(buf.stride())}")
    if buf.dim() == 5 and tuple(buf.shape[2:]) != (HV, V, K):
        raise ValueError(f"{name}: expected [S, steps, HV={HV}, V={V}, K={K}] (k_last), got {tuple(buf.shape)}")
    if buf.dim() == 5 and buf.shape[1] > 1 and (buf.stride(1) != row or not buf[0, 0].is_contiguous()):
        raise ValueError(f"{name}: the states of a slot must be packed (token stride HV*V*K), got strides "
                         f"{tuple(buf.stride())}")
    return buf.as_strided((buf.shape[0], steps, HV, V, K), (buf.stride(0), row, V * K, K, 1), buf.storage_offset())


def as_btv(x: torch.Tensor, B: int, T: int, HV: int, name: str) -> torch.Tensor:
    """Gate input ``[T, HV]`` or ``[B, T, HV]`` (any strides) as ``[B, T, HV]``."""
    if x.numel() != B * T * HV:
        raise ValueError(f"{name}: expected [B*T, HV] or [B, T, HV] with B={B}, T={T}, HV={HV}, got "
                         f"{tuple(x.shape)}")
    return x.reshape(B, T, HV)


def max_len(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> Optional[int]:
    """Longest sequence (a host read of cu_seqlens; None when that is not allowed: graph capture, compile)."""
    from gdn.ops import _validate as V_

    if cu_seqlens is None:
        return T
    if cu_seqlens.numel() < 2 or not V_.host_checks_allowed(cu_seqlens.device):
        return None
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def recurrent(q, k, v, *, scale, state, idx, num_accepted, cu_seqlens, l2norm, write: bool, g=None, beta=None,
              A_log=None, a=None, dt_bias=None, b=None, cache=None, cache_idx=None, parent=None,
              names=("initial_state", "ssm_state_indices")):
    """gdn's multi-token recurrent op on a k_last state / pool (``idx`` None: ``state`` is ``[N, HV, V, K]``);
    ``write``: final state (1-D idx) or per-token states (2-D idx) in place. ``cache``/``cache_idx``/``parent``: the
    per-token state buffer and tree verification of :func:`gdn.ops.recurrent.run_recurrent`; ``names``: the
    engine's names of the state and index arguments (error messages). Returns o."""
    from gdn.ops.recurrent import plan_recurrent, run_recurrent

    def go(st, ix):
        plan = plan_recurrent(q, k, v, g, beta, scale, st, False, cu_seqlens, "k_last", ix, num_accepted,
                              write and st is not None, A_log, a, dt_bias, b, state_name=names[0],
                              indices_name=names[1])
        o, _ = run_recurrent(q, k, v, plan, g=g, beta=beta, A_log=A_log, a=a, dt_bias=dt_bias, b=b, initial_state=st,
                             ssm_state_indices=ix, num_accepted_tokens=num_accepted, cu_seqlens=cu_seqlens,
                             l2norm=l2norm, cache=cache, cache_idx=cache_idx, parent=parent)
        return o

    if state is None or idx is None:
        return go(state, idx)
    return run_on_rows(state, idx, go)


def packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, pool, out, idx, l2norm) -> None:
    """One decode token per sequence with q|k|v sliced in place from the packed conv output ``mixed_qkv``
    ``[B, 2*H*K + HV*V]``; a, b ``[B, HV]``; pool ``[P, HV, V, K]`` updated at rows ``idx`` (gdn's convention, -1 =
    padding); ``out`` ``[B, 1, HV, V]`` written."""
    from gdn import ops

    if mixed_qkv.dim() != 2:
        raise ValueError(f"mixed_qkv: expected [B, 2*H*K + HV*V], got shape {tuple(mixed_qkv.shape)}")
    if pool.dim() != 4:
        raise ValueError(f"initial_state: expected a pool [P, HV, V, K], got shape {tuple(pool.shape)}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a, b: expected [B, HV], got {tuple(a.shape)} and {tuple(b.shape)}")
    if idx.dim() != 1:
        raise ValueError(f"ssm_state_indices: expected [B], got shape {tuple(idx.shape)}")
    HV, Vd, K = pool.shape[1:]
    width = mixed_qkv.shape[1]
    qk = width - HV * Vd
    if qk <= 0 or qk % (2 * K):
        raise ValueError(f"mixed_qkv: last dim {width} is not 2*H*K + HV*V for HV={HV}, V={Vd}, K={K}")
    H = qk // (2 * K)
    q = mixed_qkv[:, : H * K].unflatten(-1, (1, H, K))
    k = mixed_qkv[:, H * K: 2 * H * K].unflatten(-1, (1, H, K))
    v = mixed_qkv[:, 2 * H * K:].unflatten(-1, (1, HV, Vd))

    def go(st, ix):
        ops.gated_delta_rule_decode(q, k, v, st, A_log, a.unsqueeze(1), dt_bias, b.unsqueeze(1), scale,
                                    use_qk_l2norm=l2norm, state_indices=ix, output=out, state_layout="k_last")

    run_on_rows(pool, idx, go)
