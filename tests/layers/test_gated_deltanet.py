"""GatedDeltaNet block: forward/backward vs the float64 reference block, cached prefill + decode == one full forward,
varlen batches over pool slots, padding, argument errors, and the training example as a smoke test."""
import importlib.util
import os
import pathlib

import pytest
import torch

from gdn.layers import GatedDeltaNet, GDNCache, gated_deltanet_ref
from gdn.testing import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def make_layer(projection="qwen3_next", H=2, HV=4, K=16, V=16, hidden=32, **kw):
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    layer = GatedDeltaNet(hidden, H, HV, K, V, projection=projection, **kw).to(DEV)
    with torch.no_grad():  # non-trivial norm weight and conv bias (when present)
        layer.norm.weight.uniform_(0.5, 1.5)
        if layer.conv1d.bias is not None:
            layer.conv1d.bias.normal_(0, 0.2)
    return layer


@pytest.mark.parametrize("projection,H,HV,conv_bias", [("qwen3_next", 2, 4, False), ("qwen3_5", 2, 2, True)])
def test_forward_matches_reference(projection, H, HV, conv_bias):
    layer = make_layer(projection, H=H, HV=HV, conv_bias=conv_bias)
    x = torch.randn(2, 19, 32, device=DEV)
    y = layer(x)
    y_ref, _, _ = gated_deltanet_ref(layer, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, y_ref) < 1e-4


def test_varlen_forward_matches_reference():
    layer = make_layer()
    cu = torch.tensor([0, 6, 6, 7, 30], dtype=torch.int32, device=DEV)  # includes empty and 1-token sequences
    x = torch.randn(1, 30, 32, device=DEV)
    y_ref, _, _ = gated_deltanet_ref(layer, x, cu)
    assert rel_err(layer(x, cu_seqlens=cu), y_ref) < 1e-4


def test_backward_matches_reference():
    layer = make_layer()
    x = torch.randn(2, 21, 32, device=DEV, requires_grad=True)
    dy = torch.randn(2, 21, 32, device=DEV)
    layer(x).backward(dy)
    ref_layer = make_layer()
    ref_layer.load_state_dict(layer.state_dict())
    x64 = x.detach().double().requires_grad_()
    y_ref, _, _ = gated_deltanet_ref(ref_layer, x64)
    y_ref.backward(dy.double())
    assert rel_err(x.grad, x64.grad) < 1e-4
    for (name, p), (_, p_ref) in zip(layer.named_parameters(), ref_layer.named_parameters()):
        assert p.grad is not None, name
        assert rel_err(p.grad, p_ref.grad) < 1e-4, name


@pytest.mark.parametrize("projection", ["qwen3_next", "qwen3_5"])
def test_prefill_then_decode_equals_full_forward(projection):
    layer = make_layer(projection)
    n, m = 13, 5
    x = torch.randn(2, n + m, 32, device=DEV)
    full = layer(x)
    cache = GDNCache.for_layers(layer, num_slots=2)
    outs = [layer(x[:, :n], cache=cache)]
    outs += [layer(x[:, t:t + 1], cache=cache) for t in range(n, n + m)]
    assert rel_err(torch.cat(outs, 1), full) < 1e-4
    # the cache holds the reference final states
    _, conv_ref, ssm_ref = gated_deltanet_ref(layer, x)
    assert rel_err(cache.conv_pool(0)[:2], conv_ref) < 1e-5
    assert rel_err(cache.ssm_pool(0)[:2], ssm_ref) < 1e-4


def test_varlen_cached_prefill_and_decode_over_slots():
    """Several requests of different lengths prefilled into scattered pool slots (cu_seqlens), then decoded as a
    [N, 1] batch and as a varlen batch of one token each; equals a full forward of each request."""
    layer = make_layer()
    lens = [5, 1, 9]
    N, steps = len(lens), 3
    cache = GDNCache.for_layers(layer, num_slots=8)
    cache.allocate(2)                           # make the request slots non-trivial
    slots = cache.allocate(N)[torch.tensor([2, 0, 1])]
    seqs = [torch.randn(1, L + 2 * steps, 32, device=DEV) for L in lens]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    prompt = torch.cat([s[:, :L] for s, L in zip(seqs, lens)], 1)
    out = [[o] for o in layer(prompt, cache=cache.batch(slots), cu_seqlens=cu).split(lens, 1)]
    for t in range(steps):  # [N, 1, hidden] decode
        step = torch.cat([s[:, L + t:L + t + 1] for s, L in zip(seqs, lens)], 0)
        y = layer(step, cache=cache.batch(slots))
        for i in range(N):
            out[i].append(y[i:i + 1])
    cu1 = torch.arange(N + 1, dtype=torch.int32, device=DEV)
    for t in range(steps, 2 * steps):  # varlen decode: [1, N, hidden] with cu_seqlens
        step = torch.cat([s[:, L + t:L + t + 1] for s, L in zip(seqs, lens)], 1)
        y = layer(step, cache=cache.batch(slots), cu_seqlens=cu1)
        for i in range(N):
            out[i].append(y[:, i:i + 1])
    for i in range(N):
        assert rel_err(torch.cat(out[i], 1), layer(seqs[i])) < 1e-4, i


def test_decode_padding_slot_leaves_pools_untouched():
    layer = make_layer()
    cache = GDNCache.for_layers(layer, num_slots=4)
    slots = cache.allocate(3)
    layer(torch.randn(3, 6, 32, device=DEV), cache=cache.batch(slots))
    conv0, ssm0 = cache.conv_states.clone(), cache.ssm_states.clone()
    padded = slots.clone()
    padded[1] = -1
    x = torch.randn(3, 1, 32, device=DEV)
    y = layer(x, cache=cache.batch(padded))
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert torch.equal(cache.conv_pool(0)[slots[1].long()], conv0[0, slots[1].long()])
    assert torch.equal(cache.ssm_pool(0)[slots[1].long()], ssm0[0, slots[1].long()])
    unused = cache.num_slots - 1  # slot 3 was never allocated
    assert torch.equal(cache.ssm_states[:, unused], ssm0[:, unused])


def test_bf16_state_pool():
    layer = make_layer()
    x = torch.randn(2, 12, 32, device=DEV)
    full = layer(x)
    cache = GDNCache.for_layers(layer, num_slots=2, dtype=torch.bfloat16)
    outs = [layer(x[:, :9], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(9, 12)]
    assert cache.ssm_states.dtype == torch.bfloat16
    assert rel_err(torch.cat(outs, 1), full) < 2e-2


def test_argument_errors():
    layer = make_layer()
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(2, 3, 16, device=DEV))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(2, 3, 32, device=DEV), cu_seqlens=torch.tensor([0, 3], device=DEV))
    other = GDNCache(2, conv_dim=8, conv_size=4, num_v_heads=4, head_k_dim=16, head_v_dim=16, device=DEV)
    with pytest.raises(ValueError, match="cache"):
        layer(torch.randn(2, 3, 32, device=DEV), cache=other)
    cache = GDNCache.for_layers(layer, num_slots=2)
    with pytest.raises(ValueError, match="cache"):
        layer(torch.randn(3, 3, 32, device=DEV), cache=cache)
    with pytest.raises(TypeError, match="cache"):
        layer(torch.randn(2, 3, 32, device=DEV), cache=object())
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(32, 3, 4, 16, 16)
    with pytest.raises(ValueError, match="projection"):
        GatedDeltaNet(32, 2, 4, 16, 16, projection="llama")


def test_train_example_loss_decreases(monkeypatch):
    """examples/train_associative_recall.py as a smoke test: a few steps, the loss goes down."""
    monkeypatch.setenv("GDN_BACKEND", "torch")  # the torch path of the ops: fast on CPU (the kernels are tested above)
    spec = importlib.util.spec_from_file_location("train_associative_recall",
                                                  ROOT / "examples" / "train_associative_recall.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    try:  # one thread: CI's 2 cores are shared by 2 pytest workers (oversubscribed intra-op threads crawl)
        losses = mod.main(["--steps", "12", "--device", DEV, "--quiet", "--seed", "0", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


@pytest.mark.parametrize("used", [(0, 1, 2, 3), (0, 2), (0, 1), (3,)])
def test_packed_projection_equals_grouped_unpacking(used):
    """qwen3_next with many tokens reorders the weight rows (Q|K|V|Z, B|A) instead of the outputs (one product,
    ``_RowPermutedLinear``): same mixed_qkv, z, b, a as the per-key-head unpacking, and the same input and weight
    gradients (GVA 3, K != V), also when some outputs take no part in the loss (their gradients are None; b and a,
    whose gradients the backward merges into one product, both or one of them)."""
    layer = make_layer(H=2, HV=6, K=8, V=12, hidden=16)
    x0 = torch.randn(2, 9, 16, device=DEV, dtype=torch.float64)
    layer = layer.double()
    outs = {}
    for packed in (True, False):
        layer.zero_grad()
        x = x0.clone().requires_grad_(True)
        parts = layer._project(x, packed=packed)
        sum((parts[i] * torch.linspace(-1, 1, parts[i].numel(), device=DEV, dtype=x.dtype).view_as(parts[i])).sum()
            for i in used).backward()
        grads = [x.grad] + [w.grad if w.grad is not None else torch.zeros_like(w)   # unused weight: None or zeros
                            for w in (layer.in_proj_qkvz.weight, layer.in_proj_ba.weight)]
        outs[packed] = ([p.detach().clone() for p in parts], [g.clone() for g in grads])
    for a, b in zip(outs[True][0] + outs[True][1], outs[False][0] + outs[False][1]):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # both against the oracle's per-key-head unpacking (float64 weights: the explicit split / reshape / cat)
    with torch.no_grad():
        plain = layer._project(x, dtype=torch.float64, packed=False)
    for a, b in zip(outs[False][0], plain):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_wrapped_or_hooked_projections_are_called():
    """A LoRA-style wrapper (``.weight`` is the frozen base weight, forward adds a low-rank term) or a forward hook on
    an in-projection changes what it computes: with many tokens the layer must still call the modules, not take their
    weights (the packed projection path is only for plain bias-free nn.Linear)."""
    import torch.nn as nn

    class LoRA(nn.Module):
        def __init__(self, base, r=2):
            super().__init__()
            self.base_layer = base
            self.A = nn.Parameter(torch.randn(r, base.in_features, device=DEV) * 0.3)
            self.B = nn.Parameter(torch.randn(base.out_features, r, device=DEV) * 0.3)

        @property
        def weight(self):
            return self.base_layer.weight

        def forward(self, x):
            return self.base_layer(x) + x @ self.A.t() @ self.B.t()

    layer = make_layer()
    x = torch.randn(2, 20, 32, device=DEV)          # 40 tokens >= hidden 32: the packed path would apply
    layer.in_proj_qkvz = LoRA(layer.in_proj_qkvz)
    mixed = layer._project(x)[0]
    assert rel_err(mixed, layer._project(x, packed=False)[0]) < 1e-6
    y = layer(x)
    y.sum().backward()
    assert layer.in_proj_qkvz.A.grad is not None and layer.in_proj_qkvz.A.grad.abs().sum() > 0
    layer2 = make_layer()
    layer2.in_proj_ba.register_forward_hook(lambda m, i, o: o * 0)
    b = layer2._project(x)[2]
    assert torch.count_nonzero(b) == 0


@pytest.mark.parametrize("H,HV,K,V", [(2, 6, 8, 12), (1, 1, 16, 16), (3, 3, 4, 8)])
def test_unpack_kernel_equals_plain_unpacking(H, HV, K, V):
    """The decode path's unpacking kernel (no autograd) puts every column where the per-key-head split / reshape /
    cat puts it (bitwise: pure data movement), for GVA ratios 3 and 1 and K != V, on strided projection outputs."""
    from gdn.kernels.unpack import unpack_qkvz_ba

    layer = make_layer(H=H, HV=HV, K=K, V=V, hidden=16)
    x = torch.randn(3, 5, 16, device=DEV)
    with torch.no_grad():
        plain = layer._project(x, dtype=torch.float32, packed=False)
        wide = torch.randn(3, 5, layer.in_proj_qkvz.out_features + 7, device=DEV)
        qkvz = wide[..., 3:3 + layer.in_proj_qkvz.out_features]        # a strided view, last dim contiguous
        qkvz.copy_(layer.in_proj_qkvz(x))
        got = unpack_qkvz_ba(qkvz, layer.in_proj_ba(x), H, HV, K, V)
    for g, p in zip(got, plain):
        assert g.shape == p.shape and g.is_contiguous()
        assert torch.equal(g, p)


@pytest.mark.parametrize("projection,H,HV,K,V,W,conv_bias,state_dtype,layout", [
    ("qwen3_next", 2, 4, 16, 16, 4, False, torch.float32, "v_last"),
    ("qwen3_next", 1, 4, 32, 16, 2, True, torch.float32, "k_last"),
    ("qwen3_5", 2, 2, 16, 32, 3, True, torch.bfloat16, "k_last"),
    ("qwen3_next", 2, 6, 16, 24, 4, False, torch.bfloat16, "v_last"),   # V not a power of two, 3 heads per key head
])
def test_fused_decode_step_equals_unfused(projection, H, HV, K, V, W, conv_bias, state_dtype, layout):
    """The one-launch decode step (gdn.kernels.decode_step) against the separate conv / decode / norm kernels from
    equal pools: outputs and recurrent pools to rounding, conv pools bitwise; a padding sequence outputs zeros and
    every row it does not own stays bitwise untouched; and against the float64 block over the whole sequence."""
    from gdn.kernels import tuning

    layer = make_layer(projection, H=H, HV=HV, K=K, V=V, conv_size=W, conv_bias=conv_bias)
    n, m = 7, 3
    x = torch.randn(2, n + m, 32, device=DEV)
    pad_x = torch.randn(1, m, 32, device=DEV)
    runs = []
    for fused in (True, False):
        cache = GDNCache.for_layers(layer, num_slots=5, dtype=state_dtype, state_layout=layout)
        slots = cache.allocate(5)[torch.tensor([3, 1])]
        step_slots = torch.cat([slots[:1], slots.new_full((1,), -1), slots[1:]])
        with tuning.override("decode_step", fused=fused):
            layer(x[:, :n], cache=cache.batch(slots))
            conv0, ssm0 = cache.conv_states.clone(), cache.ssm_states.clone()
            ys = [layer(torch.cat([x[:1, t:t + 1], pad_x[:, t - n:t - n + 1], x[1:, t:t + 1]]),
                        cache=cache.batch(step_slots)) for t in range(n, n + m)]
        runs.append((torch.cat(ys, 1), cache, conv0, ssm0))
    (y, cache, conv0, ssm0), (y_u, cache_u, _, _) = runs
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    assert rel_err(y, y_u) < tol
    assert rel_err(cache.ssm_states, cache_u.ssm_states) < tol
    assert torch.equal(cache.conv_states, cache_u.conv_states)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    others = [i for i in range(cache.num_slots + 1) if i not in (1, 3)]
    assert torch.equal(cache.conv_states[:, others], conv0[:, others])
    assert torch.equal(cache.ssm_states[:, others], ssm0[:, others])
    y_ref, _, _ = gated_deltanet_ref(layer, x)
    assert rel_err(y[[0, 2]], y_ref[:, n:]) < (1e-4 if state_dtype == torch.float32 else 2e-2)


def test_inference_steps_pack_the_in_projections():
    """The first inference step stores the in-projection weights back to back (one GEMM per step): the same
    Parameters and values, state_dict unchanged; a weight replaced later is packed again; a hooked projection is
    called instead (never packed)."""
    layer = make_layer()
    params = dict(layer.named_parameters())
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(3, 1, 32, device=DEV)
    cache = GDNCache.for_layers(layer, num_slots=3)
    y = layer(x, cache=cache)
    wq, wba = layer.in_proj_qkvz.weight, layer.in_proj_ba.weight
    assert wba.data_ptr() == wq.data_ptr() + wq.numel() * wq.element_size()
    assert dict(layer.named_parameters()) == params
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())
    with torch.no_grad():
        layer.in_proj_ba.weight.data = layer.in_proj_ba.weight.detach().clone()   # replaced: no longer adjacent
    cache.conv_states.zero_(), cache.ssm_states.zero_()   # the same step again from the same (zero) states
    y1 = layer(x, cache=cache)
    wq, wba = layer.in_proj_qkvz.weight, layer.in_proj_ba.weight
    assert wba.data_ptr() == wq.data_ptr() + wq.numel() * wq.element_size()
    assert rel_err(y1, y) < 1e-6
    calls = []
    layer.in_proj_ba.register_forward_hook(lambda m, i, o: calls.append(1))
    layer(x, cache=cache)
    assert calls == [1]


def _graph_names(t):
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def test_training_call_keeps_qkv_packed():
    """A training forward on the Triton backend runs the chunked op on the packed conv output (its backward
    writes one gradient of q|k|v: no concatenation of three); under no_grad nothing changes."""
    from gdn.backend import use_triton

    layer = make_layer()
    x = torch.randn(2, 21, 32, device=DEV, requires_grad=True)
    names = _graph_names(layer(x))
    if use_triton(x.device):
        assert "ChunkGatedDeltaRulePackedFunctionBackward" in names
        assert "ChunkGatedDeltaRuleFunctionBackward" not in names
    else:   # the torch path: autograd through the reference
        assert not any("ChunkGatedDeltaRule" in n for n in names)


@pytest.mark.parametrize("projection,T", [("qwen3_next", 21), ("qwen3_next", 7), ("qwen3_5", 21)])
def test_training_backward_takes_z_b_a_as_one_block(monkeypatch, projection, T):
    """A training step's backward writes the gradients of z (gated norm), b and a (gates) side by side into one
    buffer, and the in-projection's backward runs one product over the three (a part of width HV V + 2 HV); the
    gradients equal those of the step without the buffer (three products), and a second backward through the
    retained graph gives them again (a new buffer per pass). Fewer tokens than hidden (the outputs unpacked, no
    in-projection Function) and separate projections (qwen3_5: z contiguous, the norm keeps its own dz) are right
    as well."""
    import gdn.layers.gated_deltanet as mod
    from gdn.backend import use_triton

    triton = use_triton(torch.device(DEV))   # else: the torch backend, its norm and gates without the buffer
    H, HV, V = 2, 4, 16
    layer = make_layer(projection, H=H, HV=HV, V=V)
    x = torch.randn(2, T, 32, device=DEV, requires_grad=True)
    dy = torch.randn(2, T, 32, device=DEV)
    fused = triton and projection == "qwen3_next" and 2 * T >= 32
    widths, real = [], mod.merge_adjacent

    def recording(grads, sizes):   # the parts the in-projection's backward runs its products over
        parts = real(grads, sizes)
        widths.append([n for _, n in parts])
        return parts

    monkeypatch.setattr(mod, "merge_adjacent", recording)

    def grads(buffer: bool, twice: bool = False):
        monkeypatch.setattr(mod.GatedDeltaNet, "_zba_grad_buffer",
                            mod.GatedDeltaNet._zba_grad_buffer if buffer else (lambda self: None))
        params = [x] + list(layer.parameters())
        y = layer(x)
        out = [torch.autograd.grad(y, params, dy, retain_graph=twice)]
        if twice:
            out.append(torch.autograd.grad(y, params, dy))
        return out

    widths.clear()
    (merged,) = grads(True)
    if fused:
        assert widths == [[layer.conv_dim, HV * V + 2 * HV]]
    widths.clear()
    (plain,) = grads(False)
    assert widths == ([[layer.conv_dim, HV * V, HV, HV]] if fused or (projection == "qwen3_next" and 2 * T >= 32)
                      else [])
    for m, p in zip(merged, plain):
        assert rel_err(m, p) < 1e-5
    first, second = grads(True, twice=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
