"""One gradient buffer shared by the backward functions of several inputs that are adjacent column blocks of one
tensor (the GatedDeltaNet layer's in-projection output: z | b | a).

Each backward asks :meth:`ColumnGradBuffer.block` for the destination of its block and writes its gradient there;
the consumer of the gradients (the in-projection's backward) then finds the blocks adjacent in memory with one row
stride and runs one product over all of them instead of one per block (``merge_adjacent``). The first block asked
for in a pass allocates the buffer; the last one releases it (the buffer is not held past the pass). Any other
order, a block not asked for, or a gradient that autograd sums with another one is still correct: such gradients
are separate tensors and the consumer treats them separately.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch


class ColumnGradBuffer:
    """``widths``: the blocks' names and column counts in the source tensor's column order."""

    def __init__(self, widths: Dict[str, int]):
        self.widths = dict(widths)
        self.offsets, off = {}, 0
        for name, n in self.widths.items():
            self.offsets[name] = off
            off += n
        self.width = off
        self._buf: Optional[torch.Tensor] = None
        self._pending: set = set()

    def block(self, name: str, rows: int, dtype: torch.dtype, device) -> torch.Tensor:
        """``[rows, widths[name]]`` view (row stride ``width``) of this pass's buffer for block ``name``."""
        buf, dev = self._buf, torch.device(device)
        if (buf is None or name not in self._pending or buf.shape[0] != rows or buf.dtype != dtype
                or buf.device.type != dev.type or (dev.index is not None and buf.device.index != dev.index)):
            buf = self._buf = torch.empty(rows, self.width, dtype=dtype, device=device)
            self._pending = set(self.widths)
        self._pending.discard(name)
        if not self._pending:
            self._buf = None
        off = self.offsets[name]
        return buf[:, off:off + self.widths[name]]


def _rows2d(g: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """``[rows, n]`` view of g (None where that needs a copy or the columns are strided)."""
    try:
        g2 = g.view(-1, n)
    except RuntimeError:
        return None
    return g2 if n == 1 or g2.stride(1) == 1 else None


def merge_adjacent(grads: Sequence[Optional[torch.Tensor]], sizes: Sequence[int]
                   ) -> List[Tuple[Optional[torch.Tensor], int]]:
    """(gradient, width) parts from per-block gradients: runs of consecutive blocks whose gradients are adjacent
    column blocks of one storage (same dtype and row stride, each starting where the previous one ends) become one
    ``[rows, sum of widths]`` view; other gradients pass through as they are."""
    out: List[Tuple[Optional[torch.Tensor], int]] = []
    run: Optional[torch.Tensor] = None       # the current run as a [rows, w] view
    run_w = 0
    for g, n in zip(grads, sizes):
        g2 = _rows2d(g, n) if g is not None else None
        if (run is not None and g2 is not None and g2.dtype == run.dtype and g2.shape[0] == run.shape[0]
                and g2.stride(0) == run.stride(0) and run.stride(0) >= run_w + n
                and g2.untyped_storage().data_ptr() == run.untyped_storage().data_ptr()
                and g2.data_ptr() == run.data_ptr() + run_w * run.element_size()):
            run_w += n
            run = run.as_strided((run.shape[0], run_w), (run.stride(0), 1))
            out[-1] = (run, run_w)
            continue
        out.append((g, n))
        run, run_w = (g2, n) if g2 is not None else (None, 0)
    return out


__all__ = ["ColumnGradBuffer", "merge_adjacent"]
