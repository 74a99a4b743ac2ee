"""ColumnGradBuffer (one buffer per backward pass for adjacent column blocks) and merge_adjacent (adjacent blocks
of one storage become one [rows, width] view; anything else passes through)."""
import torch

from gdn.ops._grad_buffer import ColumnGradBuffer, merge_adjacent


def test_buffer_per_pass():
    gb = ColumnGradBuffer({"z": 8, "b": 2, "a": 2})
    z = gb.block("z", 5, torch.float32, "cpu")
    b = gb.block("b", 5, torch.float32, "cpu")
    assert gb._buf is not None   # "a" still pending
    a = gb.block("a", 5, torch.float32, "cpu")
    assert gb._buf is None       # released after the last block
    assert z.shape == (5, 8) and b.shape == (5, 2) and a.shape == (5, 2) and z.stride() == b.stride() == (12, 1)
    assert b.data_ptr() == z.data_ptr() + 8 * 4 and a.data_ptr() == b.data_ptr() + 2 * 4
    z2 = gb.block("z", 5, torch.float32, "cpu")   # a second pass: a new buffer, the first one's blocks untouched
    assert z2.untyped_storage().data_ptr() != z.untyped_storage().data_ptr()
    z3 = gb.block("z", 5, torch.float32, "cpu")   # "z" again before the others: a new buffer as well
    assert z3.untyped_storage().data_ptr() != z2.untyped_storage().data_ptr()
    b3 = gb.block("b", 6, torch.float32, "cpu")   # other rows: its own buffer
    assert b3.shape == (6, 2) and b3.untyped_storage().data_ptr() != z3.untyped_storage().data_ptr()


def test_merge_adjacent():
    buf = torch.randn(4, 3, 12)
    z, b, a = buf[..., :8].view(4, 3, 2, 4), buf[..., 8:10], buf[..., 10:]
    m = torch.randn(4, 3, 5)
    parts = merge_adjacent([m, z, b, a], [5, 8, 2, 2])
    assert [n for _, n in parts] == [5, 12]
    assert parts[0][0] is m
    assert torch.equal(parts[1][0], buf.view(12, 12))
    # a gap, another storage, another dtype, a None in between: no merge there
    other = torch.randn(4, 3, 2)
    assert [n for _, n in merge_adjacent([z, other, a], [8, 2, 2])] == [8, 2, 2]
    assert [n for _, n in merge_adjacent([z, a], [8, 2])] == [8, 2]
    assert [n for _, n in merge_adjacent([z, None, a], [8, 2, 2])] == [8, 2, 2]
    assert [n for _, n in merge_adjacent([z, b.to(torch.float64), a], [8, 2, 2])] == [8, 2, 2]
    assert [n for _, n in merge_adjacent([z, b], [8, 2])] == [10]
    # columns that would wrap into the next row are not adjacent blocks
    flat = torch.randn(24)
    left, right = flat[:20].view(10, 2), flat[2:22].view(10, 2)
    assert len(merge_adjacent([left, right], [2, 2])) == 2
