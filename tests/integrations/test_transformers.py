"""gdn.integrations.transformers: tiny randomly initialised Qwen3-Next / Qwen3.5 (built from a config, nothing
downloaded) give the same logits and greedy generations with gdn enabled; disable() restores everything exactly;
GatedDeltaNet.from_hf reproduces an HF GDN layer."""
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gdn  # noqa: E402
import gdn.integrations.transformers as gdn_hf  # noqa: E402
from gdn.layers import GatedDeltaNet  # noqa: E402
from gdn.testing import rel_err  # noqa: E402

QWEN3_NEXT = "transformers.models.qwen3_next.modeling_qwen3_next"
QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5"
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              layer_types=["linear_attention", "full_attention"], max_position_embeddings=128, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)


def _has(module):
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, **COMMON)
    return Qwen3NextForCausalLM(cfg)


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON))


MODELS = [pytest.param(_qwen3_next, marks=pytest.mark.skipif(not _has(QWEN3_NEXT), reason="no Qwen3-Next")),
          pytest.param(_qwen3_5, marks=pytest.mark.skipif(not _has(QWEN3_5), reason="no Qwen3.5 in this version"))]


@pytest.fixture(autouse=True)
def _always_disable():
    yield
    gdn_hf.disable()


class _Spy:
    """Counts calls of gdn.ops functions (proves the patched path runs)."""

    def __init__(self, monkeypatch, names):
        self.calls = {n: 0 for n in names}
        for n in names:
            orig = getattr(gdn.ops, n)

            def wrapped(*a, _n=n, _orig=orig, **k):
                self.calls[_n] += 1
                return _orig(*a, **k)

            monkeypatch.setattr(gdn.ops, n, wrapped)


@pytest.mark.parametrize("build", MODELS)
def test_logits_and_greedy_generation_match(build, monkeypatch):
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(3, 97, (2, 19))
    with torch.no_grad():
        logits0 = model(ids).logits
        gen0 = model.generate(ids, max_new_tokens=6, do_sample=False)
        spy = _Spy(monkeypatch, ["causal_conv1d", "causal_conv1d_update", "chunk_gated_delta_rule",
                                 "fused_recurrent_gated_delta_rule"])
        gdn_hf.enable()
        logits1 = model(ids).logits
        gen1 = model.generate(ids, max_new_tokens=6, do_sample=False)
        gdn_hf.disable()
        logits2 = model(ids).logits
    assert all(v > 0 for v in spy.calls.values()), spy.calls
    assert rel_err(logits1, logits0) < 1e-3
    assert torch.equal(gen1, gen0)
    assert torch.equal(logits2, logits0)


def _snapshot(mod):
    """Every module global and every attribute of the module's classes, by identity."""
    snap = {("mod", k): v for k, v in vars(mod).items()}
    for name, cls in vars(mod).items():
        if isinstance(cls, type) and cls.__module__ == mod.__name__:
            snap.update({(name, k): v for k, v in vars(cls).items()})
    return snap


def _same(a, b):
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


@pytest.mark.skipif(not _has(QWEN3_NEXT), reason="no Qwen3-Next")
def test_disable_restores_originals_exactly():
    mod = importlib.import_module(QWEN3_NEXT)
    before = _snapshot(mod)
    done = gdn_hf.enable()
    assert QWEN3_NEXT in done and gdn_hf.is_enabled()
    assert not _same(_snapshot(mod), before)
    assert gdn_hf.enable() == done  # idempotent
    gdn_hf.disable()
    assert not gdn_hf.is_enabled()
    assert _same(_snapshot(mod), before)
    with gdn_hf.enabled():
        assert gdn_hf.is_enabled()
    assert _same(_snapshot(mod), before)


@pytest.mark.parametrize("build", MODELS)
def test_from_hf_layer_matches(build):
    torch.manual_seed(1)
    model = build().eval()
    hf_layer = model.model.layers[0].linear_attn
    layer = GatedDeltaNet.from_hf(hf_layer)
    assert layer.projection == ("qwen3_next" if hasattr(hf_layer, "in_proj_qkvz") else "qwen3_5")
    x = torch.randn(2, 11, 64)
    with torch.no_grad():
        assert rel_err(layer(x), hf_layer(x)) < 1e-4
