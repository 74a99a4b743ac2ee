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
