"""gdn check: the GatedDeltaNet block vs a pure-reference forward of the same weights (float64), its backward, and
the cached paths: prefill + decode == one full forward, speculative verify == plain decode."""
import torch

from ..kernels import tuning
from ..layers import GatedDeltaNet, GDNCache, gated_deltanet_ref
from ..testing import rel_err
from . import Result, register


def _cfg(device):
    if device.type == "cuda":
        return dict(hidden=512, H=4, HV=8, K=64, V=64, B=2, T=200, n=150, m=6, lens=[1, 63, 64, 65, 130])
    return dict(hidden=32, H=2, HV=4, K=16, V=16, B=2, T=20, n=14, m=3, lens=[1, 6, 0, 9])


def _layer(c, device, projection="qwen3_next", dtype=torch.float32, **kw):
    layer = GatedDeltaNet(c["hidden"], c["H"], c["HV"], c["K"], c["V"], projection=projection, **kw).to(device, dtype)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        if layer.conv1d.bias is not None:
            layer.conv1d.bias.normal_(0, 0.2)
    return layer


@register
def layer_forward(device):
    c = _cfg(device)
    out = []
    for projection in ("qwen3_next", "qwen3_5"):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            layer = _layer(c, device, projection, dtype)
            x = torch.randn(c["B"], c["T"], c["hidden"], device=device)
            with torch.no_grad():
                y = layer(x.to(dtype))
                y_ref, _, _ = gated_deltanet_ref(layer, x.to(dtype))
            out.append(Result("layer", f"forward {projection} {str(dtype)[6:]}", rel_err(y, y_ref), tol))
    layer = _layer(c, device)
    cu = torch.tensor([0] + list(torch.tensor(c["lens"]).cumsum(0)), device=device, dtype=torch.int32)
    x = torch.randn(1, int(cu[-1]), c["hidden"], device=device)
    with torch.no_grad():
        y_ref, _, _ = gated_deltanet_ref(layer, x, cu)
        out.append(Result("layer", "forward varlen fp32", rel_err(layer(x, cu_seqlens=cu), y_ref), 1e-4))
    return out


@register
def layer_backward(device):
    """Every parameter's gradient and dx of the block against float64 autograd of the reference block (same
    weights), fp32 and bf16 (bf16: the 16-bit chunked backward, on sm_90 its Gluon kernels); the worst one is
    reported."""
    c = _cfg(device)
    out = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        layer = _layer(c, device, dtype=dtype)
        x = torch.randn(c["B"], c["T"], c["hidden"], device=device).to(dtype).requires_grad_()
        dy = torch.randn(c["B"], c["T"], c["hidden"], device=device).to(dtype)
        layer(x).backward(dy)
        ref_layer = _layer(c, "cpu").double()
        ref_layer.load_state_dict({k: v.detach().cpu().double() for k, v in layer.state_dict().items()})
        x64 = x.detach().cpu().double().requires_grad_()
        y_ref, _, _ = gated_deltanet_ref(ref_layer, x64)
        y_ref.backward(dy.cpu().double())
        worst, name = rel_err(x.grad, x64.grad), "dx"
        for (n, p), (_, pr) in zip(layer.named_parameters(), ref_layer.named_parameters()):
            e = rel_err(p.grad, pr.grad) if p.grad is not None else float("inf")
            if e > worst:
                worst, name = e, n
        out.append(Result("layer", f"backward {str(dtype)[6:]} (worst grad)", worst, tol, note=f"worst: {name}"))
    return out


@register
def layer_prefill_decode(device):
    c = _cfg(device)
    out = []
    for state_dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        layer = _layer(c, device)
        n, m = c["n"], c["m"]
        x = torch.randn(c["B"], n + m, c["hidden"], device=device)
        with torch.no_grad():
            full = layer(x)
            cache = GDNCache.for_layers(layer, num_slots=c["B"] + 2, dtype=state_dtype)
            slots = cache.allocate(c["B"] + 2)[2:]
            ys = [layer(x[:, :n], cache=cache.batch(slots))]
            ys += [layer(x[:, t:t + 1], cache=cache.batch(slots)) for t in range(n, n + m)]
        out.append(Result("layer", f"prefill+decode == full ({str(state_dtype)[6:]} state)",
                          rel_err(torch.cat(ys, 1), full), tol))
    return out


@register
def layer_decode_step(device):
    """The fused decode step (:mod:`gdn.kernels.decode_step`, one launch after the in-projections) of a prefilled
    cache against the float64 block over the whole sequence and against the unfused kernels, for both projections,
    state dtypes and layouts; a padding sequence (slot -1) in every step must output zeros and leave every pool row
    it does not own bitwise unchanged."""
    c = _cfg(device)
    B, n, m = c["B"], c["n"], c["m"]
    out = []
    for projection, bias in (("qwen3_next", False), ("qwen3_5", True)):
        for state_dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            for layout in ("v_last", "k_last"):
                layer = _layer(c, device, projection, conv_bias=bias)
                x = torch.randn(B, n + m, c["hidden"], device=device)
                pad = torch.randn(1, m, c["hidden"], device=device)
                caches, ys = [], []
                for fused in (True, False):
                    cache = GDNCache.for_layers(layer, num_slots=B + 2, dtype=state_dtype, state_layout=layout)
                    slots = cache.allocate(B + 2)[[3, 0]][:B]
                    step_slots = torch.cat([slots, slots.new_full((1,), -1)])
                    with torch.no_grad(), tuning.override("decode_step", fused=fused):
                        layer(x[:, :n], cache=cache.batch(slots))
                        before = (cache.conv_states.clone(), cache.ssm_states.clone())
                        y = [layer(torch.cat([x[:, t:t + 1], pad[:, t - n:t - n + 1]]), cache=cache.batch(step_slots))
                             for t in range(n, n + m)]
                    caches.append((cache, before, slots))
                    ys.append(torch.cat(y, 1))
                with torch.no_grad():
                    y_ref, _, _ = gated_deltanet_ref(layer, x)
                name = f"{projection} {str(state_dtype)[6:]} {layout}"
                out.append(Result("layer", f"decode step fused vs float64 ({name})", rel_err(ys[0][:B], y_ref[:, n:]),
                                  tol))
                out.append(Result("layer", f"decode step fused == unfused ({name})", rel_err(ys[0], ys[1]), tol))
                out.append(Result("layer", f"decode step conv pool fused == unfused, bitwise ({name})",
                                  0.0 if torch.equal(caches[0][0].conv_states, caches[1][0].conv_states) else 1.0,
                                  0.0))
                cache, (conv0, ssm0), slots = caches[0]
                others = [i for i in range(cache.num_slots + 1) if i not in slots.tolist()]
                same = (torch.equal(cache.conv_states[:, others], conv0[:, others])
                        and torch.equal(cache.ssm_states[:, others], ssm0[:, others])
                        and not ys[0][B:].any())
                out.append(Result("layer", f"decode step padding: zeros, other rows untouched ({name})",
                                  0.0 if same else 1.0, 0.0))
    return out


@register
def layer_speculative(device):
    """Verify T draft tokens with 2-D slots, commit a per-request accepted count, verify again: equals decoding only
    the accepted tokens one by one."""
    c = _cfg(device)
    layer = _layer(c, device)
    N, S, n = 3, 4, c["n"]
    acc = [2, 4, 1]
    prompt = torch.randn(N, n, c["hidden"], device=device)
    draft = torch.randn(N, S, c["hidden"], device=device)
    nxt = torch.randn(N, 2, c["hidden"], device=device)
    with torch.no_grad():
        cache = GDNCache.for_layers(layer, num_slots=N * S)
        slots = cache.allocate(N, width=S)
        layer(prompt, cache=cache.batch(slots[:, 0]))
        y1 = layer(draft, cache=cache.batch(slots))
        cache.commit(slots, torch.tensor(acc, device=device))
        y2 = layer(nxt, cache=cache.batch(slots))
        plain = GDNCache.for_layers(layer, num_slots=N)
        ps = plain.allocate(N)
        layer(prompt, cache=plain.batch(ps))
        p1 = torch.cat([layer(draft[:, t:t + 1], cache=plain.batch(ps)) for t in range(S)], 1)
        e1 = rel_err(y1, p1)
        e2 = 0.0
        for i in range(N):
            replay = GDNCache.for_layers(layer, num_slots=1)
            rs = replay.allocate(1)
            layer(prompt[i:i + 1], cache=replay.batch(rs))
            for t in range(acc[i]):
                layer(draft[i:i + 1, t:t + 1], cache=replay.batch(rs))
            want = torch.cat([layer(nxt[i:i + 1, t:t + 1], cache=replay.batch(rs)) for t in range(2)], 1)
            e2 = max(e2, rel_err(y2[i:i + 1], want))
    return [Result("layer", "speculative verify == decode", e1, 1e-4),
            Result("layer", "speculative commit + verify == decode accepted", e2, 1e-4)]
