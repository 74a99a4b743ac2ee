"""Bad input raises ValueError/TypeError naming the argument, before any kernel runs, leaving buffers untouched."""
import pytest
import torch

from gdn.ops import fused_recurrent_gated_delta_rule as fr
from gdn.ops import gated_delta_rule_decode as dec
from gdn.testing import make_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def x():
    return make_inputs(2, 3, 2, 4, 16, 16, device=DEV)


def _pool(P=5, HV=4, K=16, V=16):
    return torch.randn(P, HV, K, V, device=DEV)


CASES = [
    ("q", lambda x: dict(q=x.q[0])),
    ("k", lambda x: dict(k=x.k[:, :2])),
    ("v", lambda x: dict(v=x.v[:, :, :3])),  # HV not a multiple of H
    ("k", lambda x: dict(k=x.k.double())),
    ("g", lambda x: dict(g=x.g[..., :2])),
    ("beta", lambda x: dict(beta=x.beta[:, :1])),
    ("g", lambda x: dict(g=None)),
    ("g", lambda x: dict(A_log=x.A_log)),  # both forms
    ("state_layout", lambda x: dict(state_layout="kv")),
    ("cu_seqlens", lambda x: dict(cu_seqlens=torch.tensor([0, 3], device=DEV))),  # B != 1
    ("initial_state", lambda x: dict(initial_state=torch.randn(2, 4, 16, 8, device=DEV))),
    ("initial_state", lambda x: dict(initial_state=torch.randn(2, 4, 16, 16, device=DEV, dtype=torch.float64))),
    ("ssm_state_indices", lambda x: dict(initial_state=_pool(), ssm_state_indices=torch.tensor([0, 5], device=DEV))),
    ("ssm_state_indices", lambda x: dict(initial_state=_pool(), ssm_state_indices=torch.tensor([0, -2], device=DEV))),
    ("ssm_state_indices", lambda x: dict(initial_state=_pool(), ssm_state_indices=torch.tensor([0.0, 1.0]))),
    ("ssm_state_indices", lambda x: dict(initial_state=_pool(), ssm_state_indices=torch.tensor([0], device=DEV))),
    ("initial_state", lambda x: dict(ssm_state_indices=torch.tensor([0, 1], device=DEV))),
    ("num_accepted_tokens", lambda x: dict(initial_state=_pool(), ssm_state_indices=torch.tensor([0, 1], device=DEV),
                                           num_accepted_tokens=torch.tensor([1, 1], device=DEV))),
    ("num_accepted_tokens", lambda x: dict(initial_state=_pool(),
                                           ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, -1]], device=DEV),
                                           num_accepted_tokens=torch.tensor([1, 4], device=DEV))),
    ("inplace_final_state", lambda x: dict(inplace_final_state=True)),
    ("scale", lambda x: dict(scale="0.5")),
]


@pytest.mark.parametrize("name,change", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_recurrent_rejects_bad_input(x, name, change):
    kw = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    kw.update(change(x))
    buffers = [t for t in kw.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    before = [t.clone() for t in buffers]
    with pytest.raises((ValueError, TypeError), match=name):
        fr(**kw)
    for t, b in zip(buffers, before):
        assert torch.equal(t, b) or (t.isnan() == b.isnan()).all()


def test_decode_rejects_bad_input():
    x = make_inputs(2, 1, 2, 4, 16, 16, device=DEV)
    st = torch.randn(2, 4, 16, 16, device=DEV)
    before = st.clone()
    with pytest.raises(ValueError, match="q"):
        dec(x.q.expand(2, 2, 2, 16), x.k, x.v, st, x.A_log, x.a, x.dt_bias, x.b)
    with pytest.raises(ValueError, match="state_indices"):
        dec(x.q, x.k, x.v, st, x.A_log, x.a, x.dt_bias, x.b, state_indices=torch.tensor([0, 2], device=DEV))
    with pytest.raises(ValueError, match="output"):
        dec(x.q, x.k, x.v, st, x.A_log, x.a, x.dt_bias, x.b, output=torch.empty(2, 1, 4, 8, device=DEV))
    with pytest.raises(ValueError, match="state"):
        dec(x.q, x.k, x.v, st[:1], x.A_log, x.a, x.dt_bias, x.b)
    with pytest.raises(ValueError, match="dt_bias"):
        dec(x.q, x.k, x.v, st, x.A_log, x.a, x.dt_bias[:2], x.b)
    assert torch.equal(st, before)


def test_non_contiguous_last_dim_rejected(x):
    q = x.q.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match="q"):
        fr(q, x.k, x.v, x.g, x.beta)


@pytest.mark.parametrize("n", [3, 300])   # the host checks of a few sequences (Python) and of many (tensor ops)
@pytest.mark.parametrize("fault", ["start", "order", "end", None])
def test_cu_seqlens_host_copy_values(n, fault):
    """cu_seqlens checked through its host copy: a bad start, order or end raises ValueError before anything runs."""
    from gdn.ops import chunk_gated_delta_rule

    lens = torch.randint(0, 3, (n,))
    lens[0] = 2
    cu = [0] + torch.cumsum(lens, 0).tolist()
    T = cu[-1]
    x = make_inputs(1, T, 1, 1, 16, 16, device=DEV)
    host = list(cu)
    if fault == "start":
        host[0] = 1
    elif fault == "order":
        host[1], host[2] = host[2] + 1, host[1]
    elif fault == "end":
        host[-1] = T + 1
    cu_d = torch.tensor(cu, dtype=torch.int32, device=DEV)
    call = lambda: chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, cu_seqlens=cu_d, cu_seqlens_cpu=host)  # noqa: E731
    if fault is None:
        assert call()[0].shape == x.v.shape
    else:
        with pytest.raises(ValueError, match={"start": "start at 0", "order": "non-decreasing",
                                              "end": "end at T"}[fault]):
            call()
