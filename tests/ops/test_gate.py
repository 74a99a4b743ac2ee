"""gdn_gate forward and backward against float64 autograd of the reference."""
import pytest
import torch

from gdn.ops import gdn_gate
from gdn.reference import gdn_gate_ref
from gdn.testing import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,rows", [(torch.float32, (3, 5)), (torch.bfloat16, (3, 5)), (torch.float32, (4, 300))])
def test_gate_forward_and_backward(dtype, rows):
    """(4, 300): 1200 rows, several programs of the backward (and a partial last one) whose per-head partial sums
    of the A_log / dt_bias gradients are added up after the kernel."""
    HV = 6
    a = (torch.randn(*rows, HV, device=DEV) * 8).to(dtype)  # spans softplus's threshold (20) and the far negative side
    a[0, 0, 0], a[0, 0, 1] = 25.0, -40.0
    A_log = torch.randn(HV, device=DEV)
    dt_bias = torch.randn(HV, device=DEV)
    leaves = [t.clone().requires_grad_() for t in (a, A_log, dt_bias)]
    g = gdn_gate(*leaves)
    assert g.dtype == torch.float32 and g.shape == a.shape and (g <= 0).all()
    dg = torch.randn_like(g)
    g.backward(dg)
    ref_leaves = [t.detach().double().requires_grad_() for t in (a, A_log, dt_bias)]
    gr = gdn_gate_ref(*ref_leaves)
    gr.backward(dg.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(g, gr) < 1e-5
    for x, r in zip(leaves, ref_leaves):
        assert rel_err(x.grad, r.grad) < tol


def test_gate_validation():
    a = torch.randn(2, 4, device=DEV)
    with pytest.raises(ValueError, match="A_log"):
        gdn_gate(a, torch.randn(3, device=DEV), torch.randn(4, device=DEV))
    with pytest.raises(ValueError, match="dt_bias"):
        gdn_gate(a, torch.randn(4, device=DEV), torch.randn(2, 2, device=DEV))
    with pytest.raises(TypeError, match="a:"):
        gdn_gate(torch.ones(2, 4, dtype=torch.int32, device=DEV), torch.randn(4, device=DEV),
                 torch.randn(4, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("into_buffer", [False, True])
def test_gates_from_strided_columns(dtype, into_buffer):
    """gdn_gates (the layer's g and beta in one kernel each way) on a and b read as column slices of one wider
    tensor (the in-projection output), against float64 autograd of the reference gate and sigmoid; with a
    ColumnGradBuffer the backward writes db / da into its "b" / "a" blocks (poisoned first) and returns views of
    them, leaving the buffer's other block untouched."""
    from gdn.ops._grad_buffer import ColumnGradBuffer
    from gdn.ops.gate import gdn_gates

    HV, T = 6, 37
    y = (torch.randn(2, T, 5 + 2 * HV, device=DEV) * 6).to(dtype)
    y[0, 0, 5], y[0, 1, 5 + HV] = 25.0, -40.0
    A_log, dt_bias = torch.randn(HV, device=DEV), torch.randn(HV, device=DEV)
    leaves = [t.clone().requires_grad_() for t in (y, A_log, dt_bias)]
    gb = ColumnGradBuffer({"z": 5, "b": HV, "a": HV}) if into_buffer else None
    if gb is not None:   # the pass's buffer, as the norm's backward allocates it first; b and a still pending
        zblk = gb.block("z", 2 * T, dtype, DEV)
        gb._buf.fill_(float("nan"))
        zblk.fill_(7.0)
    b, a = leaves[0][..., 5:5 + HV], leaves[0][..., 5 + HV:]
    g, beta = gdn_gates(a, b, leaves[1], leaves[2], grad_buffer=gb)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == a.shape
    dg, dbeta = torch.randn_like(g), torch.randn_like(beta)
    got = torch.autograd.grad((g, beta), (b, a, leaves[1], leaves[2]), (dg, dbeta))
    ref = [t.detach().double().requires_grad_() for t in (y, A_log, dt_bias)]
    rb, ra = ref[0][..., 5:5 + HV], ref[0][..., 5 + HV:]
    gr, betar = gdn_gate_ref(ra, ref[1], ref[2]), rb.sigmoid()
    want = torch.autograd.grad((gr, betar), (rb, ra, ref[1], ref[2]), (dg.double(), dbeta.double()))
    assert rel_err(g, gr) < 1e-5 and rel_err(beta, betar) < (1e-6 if dtype == torch.float32 else 1e-2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for x, r in zip(got, want):
        assert torch.isfinite(x).all() and rel_err(x, r) < tol
    if gb is not None:   # db, da are the buffer's blocks, and z's block kept its values
        db, da = got[0], got[1]
        assert gb._buf is None   # every block handed out: released
        assert da.data_ptr() == db.data_ptr() + HV * db.element_size() == zblk.data_ptr() + (5 + HV) * zblk.element_size()
        assert (zblk == 7.0).all()
