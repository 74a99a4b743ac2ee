"""Argument checks shared by the public ops.

Every check runs before any kernel launches and raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong
shape, value or device) whose message names the argument, what was received and what was expected.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
LAYOUTS = ("v_last", "k_last")


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def tensor(name: str, x, *, ndim: Optional[int] = None, dtypes: Optional[Iterable[torch.dtype]] = None,
           device: Optional[torch.device] = None, shape_doc: str = "") -> torch.Tensor:
    """Check that ``x`` is a tensor of rank ``ndim`` with a dtype in ``dtypes`` on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor{' ' + shape_doc if shape_doc else ''}, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {shape_doc}, got shape {tuple(x.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype in ({', '.join(_dt(d) for d in dtypes)}), got {_dt(x.dtype)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got {x.device}")
    return x


def shape(name: str, x: torch.Tensor, expected: Sequence[Optional[int]], doc: str) -> None:
    """``expected`` holds ints or None (any size)."""
    got = x.shape
    if len(got) == len(expected):
        for e, n in zip(expected, got):
            if e is not None and e != n:
                break
        else:
            return
    want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
    raise ValueError(f"{name}: expected shape {doc} = {want}, got {tuple(got)}")


def last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {tuple(x.stride())}")


def contiguous(name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(x.stride())} for shape "
                         f"{tuple(x.shape)}")


def layout(state_layout) -> str:
    if state_layout not in LAYOUTS:
        raise ValueError(f"state_layout: expected one of {LAYOUTS}, got {state_layout!r}")
    return state_layout


def state_shape(HV: int, K: int, V: int, state_layout: str) -> tuple:
    return (HV, K, V) if state_layout == "v_last" else (HV, V, K)


def state_doc(state_layout: str) -> str:
    return "[N, HV, K, V]" if state_layout == "v_last" else "[N, HV, V, K]"


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:  # pragma: no cover
        return False


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except Exception:  # pragma: no cover
        return False


def host_checks_allowed(device: torch.device) -> bool:
    """Whether value checks that read device memory (a host sync) may run now.

    They are skipped while a CUDA graph is being captured or torch.compile traces (the kernels then treat an
    out-of-range pool index as padding: nothing is read or written for it and its output is zeros), and when the user
    sets ``GDN_SKIP_VALUE_CHECKS=1`` to keep eager CUDA calls free of synchronisation.
    """
    import os

    if os.environ.get("GDN_SKIP_VALUE_CHECKS", "0") == "1":
        return False
    return not (_compiling() or _capturing(device))  # order matters: dynamo cannot trace the capture query


def cu_seqlens_host(name: str, host, cu: Optional[torch.Tensor]):
    """A host copy of ``cu_seqlens`` (CPU integer tensor or a sequence of ints) as a tuple of ints, or None."""
    if host is None:
        return None
    if cu is None:
        raise ValueError(f"{name}: given without cu_seqlens")
    if isinstance(host, torch.Tensor):
        if host.device.type != "cpu" or host.dtype not in INDEX_DTYPES or host.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D int32/int64 CPU tensor or a sequence of ints, got "
                            f"{host.dtype} on {host.device} with {host.dim()} dims")
        vals = tuple(int(x) for x in host.tolist())
    else:
        try:
            if isinstance(host, (str, bytes)):
                raise TypeError
            vals = tuple(int(x) for x in host)
        except (TypeError, ValueError):
            raise TypeError(f"{name}: expected a 1-D int32/int64 CPU tensor or a sequence of ints, got "
                            f"{type(host).__name__}") from None
    if len(vals) != cu.numel():
        raise ValueError(f"{name}: {len(vals)} values, but cu_seqlens has {cu.numel()}")
    return vals


def cu_seqlens(cu, B: int, T: int, device: torch.device) -> int:
    """Validate ``cu_seqlens`` and return N (number of sequences). ``cu`` may be a pair (device tensor, host tuple):
    the value checks then read the host copy (no device-to-host transfer)."""
    if cu is None:
        return B
    host = None
    if isinstance(cu, tuple):
        cu, host = cu
    tensor("cu_seqlens", cu, ndim=1, dtypes=INDEX_DTYPES, device=device, shape_doc="[N + 1]")
    if B != 1:
        raise ValueError(f"cu_seqlens: varlen batches need B == 1 (all sequences packed along T), got B = {B}")
    if cu.numel() < 1:
        raise ValueError("cu_seqlens: expected at least one element [N + 1], got an empty tensor")
    if host is not None and len(host) <= 256:   # a few sequences: checked in Python (~1 us, tensor ops ~15 us)
        first, last, decreasing = host[0], host[-1], any(b < a for a, b in itertools.pairwise(host))
    elif host is not None or host_checks_allowed(device):
        c = torch.tensor(host, dtype=torch.int64) if host is not None else cu.detach().to("cpu", torch.int64)
        first, last = int(c[0]), int(c[-1])
        decreasing = c.numel() > 1 and bool((c[1:] < c[:-1]).any())
    else:
        return cu.numel() - 1
    if first != 0:
        raise ValueError(f"cu_seqlens: must start at 0, got {first}")
    if decreasing:
        raise ValueError("cu_seqlens: must be non-decreasing")
    if last != T:
        raise ValueError(f"cu_seqlens: must end at T = {T} (the total number of tokens), got {last}")
    return cu.numel() - 1


def pool_indices(name: str, idx: torch.Tensor, N: int, P: int, device: torch.device, *, allow_2d: bool,
                 max_cols: Optional[int] = None) -> None:
    """Validate pool slot indices: ``[N]`` (or ``[N, cols]`` when ``allow_2d``), integer, values in [-1, P)."""
    tensor(name, idx, dtypes=INDEX_DTYPES, device=device, shape_doc="[N]" + (" or [N, T_max]" if allow_2d else ""))
    if idx.dim() not in ((1, 2) if allow_2d else (1,)):
        raise ValueError(f"{name}: expected shape [N]{' or [N, T_max]' if allow_2d else ''} with N = {N}, "
                         f"got {tuple(idx.shape)}")
    if idx.shape[0] != N:
        raise ValueError(f"{name}: expected {N} rows (one per sequence), got shape {tuple(idx.shape)}")
    if idx.dim() == 2 and max_cols is not None and idx.shape[1] < max_cols:
        raise ValueError(f"{name}: expected at least {max_cols} columns (one pool slot per token position), got "
                         f"shape {tuple(idx.shape)}")
    if idx.dim() == 2 and idx.stride(1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous, got strides {tuple(idx.stride())}")
    if host_checks_allowed(device) and idx.numel():
        hi = int(idx.max())
        if hi >= P:
            raise ValueError(f"{name}: index {hi} is out of range for a pool of {P} rows (expected -1 for padding or "
                             f"0 <= index < {P})")
        lo = int(idx.min())
        if lo < -1:
            raise ValueError(f"{name}: index {lo} is invalid (expected -1 for padding or 0 <= index < {P})")


def scale_value(scale, K: int) -> float:
    if scale is None:
        return K ** -0.5
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale: expected a number, got a tensor of shape {tuple(scale.shape)}")
        scale = float(scale)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    return float(scale)


def write_indices(name: str, out_idx, read_idx: torch.Tensor, read_name: str, P: int, device: torch.device,
                  read_rows: Optional[torch.Tensor] = None, extra: Sequence = ()) -> None:
    """Validate separate write rows (``output_state_indices``, serving state): the shape and dtype rules of the read
    indices ``read_idx``, values in [-1, P), and (host check) no pool row written by two sequences or written by one
    sequence and read by another (``read_rows`` [N]: the row each sequence reads, default ``read_idx`` 1-D / column
    0). ``extra``: further (name, [N, C] rows) written per sequence (checkpoints), taking part in the same checks."""
    tensor(name, out_idx, dtypes=INDEX_DTYPES, device=device, shape_doc=f"(the shape of {read_name})")
    if tuple(out_idx.shape) != tuple(read_idx.shape):
        raise ValueError(f"{name}: expected the shape of {read_name} {tuple(read_idx.shape)}, got "
                         f"{tuple(out_idx.shape)}")
    pool_indices(name, out_idx, read_idx.shape[0], P, device, allow_2d=out_idx.dim() == 2)
    writes = [(name, out_idx)] + list(extra)
    unique_write_rows(writes, read_idx if read_rows is None else read_rows, device)


def unique_write_rows(writes: Sequence, read_rows: Optional[torch.Tensor], device: torch.device) -> None:
    """Host check (skipped under capture / tracing): over all (name, rows [N] or [N, C]) in ``writes``, no
    non-negative row is written by two sequences, nor written by one sequence and read by another (``read_rows``
    [N] or [N, C], column 0 = the row read; None = no read check). One sequence may name a row twice (its writes are
    ordered)."""
    if not host_checks_allowed(device) or not writes or writes[0][1].shape[0] == 0:
        return
    vals, seqs, which = [], [], []
    for i, (name, rows) in enumerate(writes):
        r = rows.detach().to("cpu", torch.int64).reshape(rows.shape[0], -1)
        n_of = torch.arange(r.shape[0]).unsqueeze(1).expand_as(r)
        m = r >= 0
        vals.append(r[m]), seqs.append(n_of[m]), which.append(torch.full((int(m.sum()),), i))
    vals, seqs, which = torch.cat(vals), torch.cat(seqs), torch.cat(which)
    pairs, first = torch.unique(torch.stack([vals, seqs]), dim=1, return_inverse=True)
    src = torch.empty(pairs.shape[1], dtype=torch.int64).scatter_(0, first, which)  # a name per (row, sequence)
    dup = (pairs[0, 1:] == pairs[0, :-1]).nonzero()  # unique() sorts by row first: equal rows are adjacent
    if dup.numel():
        j = int(dup[0])
        raise ValueError(f"{writes[int(src[j + 1])][0]}: pool row {int(pairs[0, j])} is written by two sequences "
                         f"({int(pairs[1, j])} via {writes[int(src[j])][0]} and {int(pairs[1, j + 1])}); give each "
                         f"sequence its own write rows")
    if read_rows is not None and pairs.shape[1]:
        rr = read_rows.detach().to("cpu", torch.int64).reshape(read_rows.shape[0], -1)[:, 0]
        writer = dict(zip(pairs[0].tolist(), zip(pairs[1].tolist(), src.tolist())))
        for n, val in enumerate(rr.tolist()):
            if val >= 0 and val in writer and writer[val][0] != n:
                raise ValueError(f"{writes[writer[val][1]][0]}: pool row {val} is written by sequence "
                                 f"{writer[val][0]} and read by sequence {n} in the same call; the order would be "
                                 f"undefined")
