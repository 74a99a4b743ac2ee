"""gdn check: fused_recurrent_gated_delta_rule (varlen, GVA, pools, speculative slots) vs the float64 reference."""
import torch

from ..ops import fused_recurrent_gated_delta_rule
from ..reference import recurrent_gated_delta_rule_ref
from ..testing import make_inputs, rel_err, to64
from . import Result, register


def _shapes(device):
    if device.type == "cuda":
        return dict(H=16, HV=32, K=128, V=128, lens=[1, 4, 8, 3, 0, 7])
    return dict(H=2, HV=4, K=32, V=16, lens=[1, 4, 0, 3])


@register
def recurrent_varlen(device):
    s = _shapes(device)
    out = []
    for layout in ("v_last", "k_last"):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1.5e-2)):
            lens = s["lens"]
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device)
            x = make_inputs(1, int(cu[-1]), s["H"], s["HV"], s["K"], s["V"], dtype=dtype, device=device)
            shape = (len(lens), s["HV"], s["K"], s["V"]) if layout == "v_last" else (len(lens), s["HV"], s["V"], s["K"])
            h0 = torch.randn(shape, device=device)
            o, st = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0,
                                                     output_final_state=True, cu_seqlens=cu,
                                                     use_qk_l2norm_in_kernel=True, state_layout=layout)
            ro, rs = recurrent_gated_delta_rule_ref(*to64(x.q, x.k, x.v, x.g, x.beta), initial_state=h0.double().cpu(),
                                                    output_final_state=True, cu_seqlens=cu.cpu(),
                                                    use_qk_l2norm_in_kernel=True, state_layout=layout)
            name = f"varlen {layout} {str(dtype)[6:]}"
            out += [Result("recurrent", name + " o", rel_err(o, ro), tol),
                    Result("recurrent", name + " state", rel_err(st, rs), tol)]
    return out


@register
def recurrent_spec_pool(device):
    """2-D slots + num_accepted_tokens, in-place per-token states, bf16 pool, padding rows untouched."""
    s = _shapes(device)
    N, P = 3, 16
    lens = [4, 2, 3]
    cu = torch.tensor([0, 4, 6, 9], device=device)
    x = make_inputs(1, 9, s["H"], s["HV"], s["K"], s["V"], dtype=torch.bfloat16, device=device)
    pool = torch.randn(P, s["HV"], s["V"], s["K"], device=device).to(torch.bfloat16)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [8, 9, 10, 11]], device=device, dtype=torch.int32)
    acc = torch.tensor([3, 1, 2], device=device, dtype=torch.int32)
    o, _ = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, cu_seqlens=cu,
                                            ssm_state_indices=idx, num_accepted_tokens=acc, inplace_final_state=True,
                                            state_layout="k_last", use_qk_l2norm_in_kernel=True)
    errs, serrs = [], []
    for n in range(N):
        st, en = int(cu[n]), int(cu[n + 1])
        h = before[int(idx[n, int(acc[n]) - 1])][None].double().cpu()
        q, k, v, g, beta = to64(x.q[:, st:en], x.k[:, st:en], x.v[:, st:en], x.g[:, st:en], x.beta[:, st:en])
        ro, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h, use_qk_l2norm_in_kernel=True,
                                               state_layout="k_last")
        errs.append(rel_err(o[:, st:en], ro))
        _, rs = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True, state_layout="k_last")
        serrs.append(rel_err(pool[int(idx[n, lens[n] - 1])].float(), rs[0]))
    touched = {int(r) for r in idx.flatten() if r >= 0}
    untouched = [r for r in range(P) if r not in touched]
    same = torch.equal(pool[untouched], before[untouched])
    return [Result("recurrent", "spec-decode o", max(errs), 1.5e-2),
            Result("recurrent", "spec-decode last state", max(serrs), 1.5e-2),
            Result("recurrent", "untouched pool rows", 0.0 if same else float("inf"), 0.0)]
