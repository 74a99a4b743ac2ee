"""GDNCache: slot bookkeeping, multi-layer pools, and speculative decoding (verify T draft tokens with per-token states,
commit the accepted count) == plain decoding of the accepted tokens."""
import pytest
import torch
import torch.nn as nn

from gdn.layers import GatedDeltaNet, GDNCache
from gdn.testing import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_allocate_free_reset():
    c = GDNCache(5, conv_dim=8, conv_size=4, num_v_heads=2, head_k_dim=4, head_v_dim=4, num_layers=2, device=DEV)
    assert c.conv_states.shape == (2, 6, 8, 3) and c.ssm_states.shape == (2, 6, 2, 4, 4)  # + the scratch row
    c.conv_states.fill_(1.0)
    c.ssm_states.fill_(1.0)
    a = c.allocate(2)
    assert a.dtype == torch.int32 and a.shape == (2,) and c.num_free == 3
    assert (c.ssm_states[:, a.long()] == 0).all() and (c.conv_states[:, a.long()] == 0).all()
    b = c.allocate(1, width=3)
    assert b.shape == (1, 3) and c.num_free == 0
    assert len(set(a.tolist()) | set(b.reshape(-1).tolist())) == 5
    with pytest.raises(RuntimeError, match="free"):
        c.allocate(1)
    c.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        c.free(a)
    c.free(torch.tensor([-1]))  # padding ids are ignored
    assert c.num_free == 2
    again = c.allocate(2)
    assert (c.ssm_states[:, again.long()] == 0).all()
    with pytest.raises(ValueError, match="slots"):
        c.batch(torch.zeros(2, 2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="slots"):
        c.batch(torch.zeros(2))
    with pytest.raises(ValueError, match="num_accepted"):
        c.batch(again, num_accepted_tokens=torch.ones(2, dtype=torch.int32))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = GatedDeltaNet(32, 2, 4, 16, 16, layer_idx=0)
        self.b = GatedDeltaNet(32, 2, 4, 16, 16, layer_idx=3)

    def forward(self, x, cache=None):
        x = x + self.a(x, cache=cache)
        return x + self.b(x, cache=cache)


def test_multi_layer_cache_prefill_decode():
    model = TwoLayers().to(DEV)
    cache = GDNCache.for_layers(model, num_slots=3)
    assert cache.layer_ids == [0, 3]
    slots = cache.allocate(2)
    x = torch.randn(2, 10, 32, device=DEV)
    full = model(x)
    outs = [model(x[:, :8], cache=cache.batch(slots))]
    outs += [model(x[:, t:t + 1], cache=cache.batch(slots)) for t in range(8, 10)]
    assert rel_err(torch.cat(outs, 1), full) < 1e-4
    assert not torch.equal(cache.ssm_pool(0), cache.ssm_pool(3))
    with pytest.raises(KeyError):
        cache.ssm_pool(1)


def _plain_decode(layer, prompt, tokens_per_seq):
    """Fresh cache, prefill, then decode each sequence's own token list one token at a time."""
    N = prompt.shape[0]
    cache = GDNCache.for_layers(layer, num_slots=N)
    slots = cache.allocate(N)
    layer(prompt, cache=cache.batch(slots))
    outs = []
    for i, toks in enumerate(tokens_per_seq):
        outs.append([layer(t.view(1, 1, -1), cache=cache.batch(slots[i:i + 1])) for t in toks])
    return cache, slots, outs


def test_speculative_verify_and_commit_equal_plain_decoding():
    torch.manual_seed(1234)
    layer = GatedDeltaNet(32, 2, 4, 16, 16).to(DEV)
    N, S, n = 3, 4, 6
    prompt = torch.randn(N, n, 32, device=DEV)
    draft = torch.randn(N, S, 32, device=DEV)
    nxt = torch.randn(N, 2, 32, device=DEV)

    cache = GDNCache.for_layers(layer, num_slots=16)
    cache.allocate(1)
    slots = cache.allocate(N, width=S)
    layer(prompt, cache=cache.batch(slots[:, 0]))                     # prefill into column 0

    y_verify = layer(draft, cache=cache.batch(slots))                 # verify S draft tokens, per-token states
    plain_cache = GDNCache.for_layers(layer, num_slots=N)
    plain_slots = plain_cache.allocate(N)
    layer(prompt, cache=plain_cache.batch(plain_slots))
    y_plain = torch.cat([layer(draft[:, t:t + 1], cache=plain_cache.batch(plain_slots)) for t in range(S)], 1)
    assert rel_err(y_verify, y_plain) < 1e-4

    acc = torch.tensor([2, 4, 1], device=DEV)
    cache.commit(slots, acc)
    y_next = layer(nxt, cache=cache.batch(slots))                     # next verify starts after the accepted tokens
    toks = [torch.cat([draft[i, :int(acc[i])], nxt[i]]) for i in range(N)]
    ref_cache, ref_slots, plain = _plain_decode(layer, prompt, toks)
    for i in range(N):
        want = torch.cat(plain[i][int(acc[i]):], 1)
        assert rel_err(y_next[i:i + 1], want) < 1e-4, i

    # accept everything of the second step, compact into column 0, continue with 1-D slots (chunked prefill)
    cache.commit(slots, torch.full((N,), 2, device=DEV), compact=True)
    assert rel_err(cache.ssm_pool(0)[slots[:, 0].long()], ref_cache.ssm_pool(0)[ref_slots.long()]) < 1e-5
    assert rel_err(cache.conv_pool(0)[slots[:, 0].long()], ref_cache.conv_pool(0)[ref_slots.long()]) < 1e-6
    more = torch.randn(N, 5, 32, device=DEV)
    assert rel_err(layer(more, cache=cache.batch(slots[:, 0])), layer(more, cache=ref_cache.batch(ref_slots))) < 1e-4


def test_speculative_padding_row_and_errors():
    torch.manual_seed(99)
    layer = GatedDeltaNet(32, 2, 4, 16, 16).to(DEV)
    cache = GDNCache.for_layers(layer, num_slots=8)
    slots = cache.allocate(2, width=3)
    layer(torch.randn(2, 4, 32, device=DEV), cache=cache.batch(slots[:, 0]))
    ssm0 = cache.ssm_states.clone()
    padded = slots.clone()
    padded[1] = -1
    draft = torch.randn(2, 3, 32, device=DEV)
    y = layer(draft, cache=cache.batch(padded))
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert torch.equal(cache.ssm_states[:, slots[1].long()], ssm0[:, slots[1].long()])
    with pytest.raises(ValueError, match="slot columns"):
        layer(torch.randn(2, 4, 32, device=DEV), cache=cache.batch(slots))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(1, 4, 32, device=DEV), cache=cache.batch(slots[:1]),
              cu_seqlens=torch.tensor([0, 4], device=DEV))
    with pytest.raises(ValueError, match="slots"):
        cache.commit(slots[:, 0], torch.ones(2, dtype=torch.int32))
