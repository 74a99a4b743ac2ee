"""Run Hugging Face transformers' Qwen3-Next / Qwen3.5 GDN layers on gdn's kernels.

    import gdn.integrations.transformers as gdn_hf
    gdn_hf.enable()      # patch; models built before or after run their GDN layers on gdn
    ...
    gdn_hf.disable()     # restore the original functions exactly

    with gdn_hf.enabled():
        model.generate(...)

What is patched, per modeling module (``transformers.models.{qwen3_next, qwen3_5, qwen3_5_moe}``): the module-level
functions the GDN layer's ``forward`` calls (``causal_conv1d_fn``, ``causal_conv1d_update``,
``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``; in transformers 4.57 the layer stores them on
the instance, so the class gets data descriptors that take precedence), and, when gdn's fused norm is available and
``norm=True``, the ``forward`` of the gated RMSNorm class. The layer's own code (projections, gates, HF's cache
handling) is unchanged, so the model's cache and ``generate`` work as before. transformers is imported only here.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = ["enable", "disable", "is_enabled", "enabled", "DEFAULT_MODULES"]

DEFAULT_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)

_SUPPORTED_ACT = (None, "silu", "swish")
_MISSING = object()
# (owner object, attribute name, original value or _MISSING when the attribute was not in owner.__dict__)
_saved: List[Tuple[object, str, object]] = []
_patched_modules: List[str] = []


# ----------------------------------------------------------------------------------------------------------------------
# adapters: HF's call conventions -> gdn.ops
# ----------------------------------------------------------------------------------------------------------------------
def _cu(kwargs, batch: int):
    cu = kwargs.get("cu_seqlens")
    if cu is None:
        cu = kwargs.get("cu_seq_lens_q")
    return cu if (cu is not None and batch == 1) else None


def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    """Dao's ``causal_conv1d_fn`` convention: ``x [B, D, T]``, ``weight [D, W]`` -> ``[B, D, T]``."""
    from gdn import ops

    if activation not in _SUPPORTED_ACT or seq_idx is not None:
        return _original("causal_conv1d_fn")(x, weight, bias=bias, activation=activation, seq_idx=seq_idx, **kwargs)
    xt = x.transpose(1, 2)
    if xt.dtype != weight.dtype:
        xt = xt.to(weight.dtype)
    if xt.stride(-1) != 1:
        xt = xt.contiguous()
    y = ops.causal_conv1d(xt, weight, bias, activation, cu_seqlens=_cu(kwargs, x.shape[0]))
    return y.to(x.dtype).transpose(1, 2)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *args, **kwargs):
    """HF/Dao ``causal_conv1d_update``: ``x [B, D, T]``, ``conv_state [B, D, S]`` (S >= W - 1, updated in place to
    the last S inputs) -> ``[B, D, T]``."""
    from gdn import ops

    if activation not in _SUPPORTED_ACT or args or kwargs.get("cache_seqlens") is not None:
        return _original("causal_conv1d_update")(x, conv_state, weight, bias, activation, *args, **kwargs)
    W1 = weight.shape[-1] - 1
    S = conv_state.shape[-1]
    xt = x.transpose(1, 2)
    if xt.dtype != weight.dtype:
        xt = xt.to(weight.dtype)
    if xt.stride(-1) != 1:
        xt = xt.contiguous()
    if S == W1 and conv_state.is_contiguous():
        y = ops.causal_conv1d_update(xt, conv_state, weight, bias, activation)
    else:  # HF keeps W inputs (or a strided buffer): run on the last W-1, then roll the whole buffer like HF does
        tail = conv_state[..., S - W1:] if S >= W1 else F.pad(conv_state, (W1 - S, 0))
        tmp = tail.contiguous().clone()
        new_state = torch.cat([conv_state, x.to(conv_state.dtype)], dim=-1)[..., -S:]
        y = ops.causal_conv1d_update(xt, tmp, weight, bias, activation)
        conv_state.copy_(new_state)
    return y.to(x.dtype).transpose(1, 2)


def chunk_gated_delta_rule(query, key, value, g=None, beta=None, chunk_size=64, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, scale=None, **kwargs):
    """HF's ``torch_chunk_gated_delta_rule`` / fla's ``chunk_gated_delta_rule`` on gdn's chunked op."""
    from gdn import ops

    if isinstance(chunk_size, float) and scale is None:  # fla's positional order (q, k, v, g, beta, scale, ...)
        chunk_size, scale = 64, chunk_size
    if initial_state is not None and initial_state.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        initial_state = initial_state.float()
    o, final = ops.chunk_gated_delta_rule(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          cu_seqlens=_cu(kwargs, query.shape[0]),
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o.to(query.dtype), final


def recurrent_gated_delta_rule(query, key, value, g=None, beta=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, scale=None, **kwargs):
    """HF's ``torch_recurrent_gated_delta_rule`` / fla's ``fused_recurrent_gated_delta_rule`` on gdn."""
    from gdn import ops

    if isinstance(initial_state, float) and scale is None:  # fla's positional order (q, k, v, g, beta, scale, ...)
        initial_state, scale = None, initial_state
    o, final = ops.fused_recurrent_gated_delta_rule(query, key, value, g, beta, scale=scale,
                                                    initial_state=initial_state,
                                                    output_final_state=output_final_state,
                                                    cu_seqlens=_cu(kwargs, query.shape[0]),
                                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o.to(query.dtype), final


def _gated_norm_forward(self, hidden_states, gate=None):
    """``forward`` of HF's ``*RMSNormGated`` on gdn's fused gated RMSNorm."""
    from gdn.ops.norm import gated_rms_norm

    if gate is None or getattr(self, "activation", "silu") not in ("silu", "swish"):
        return _original_method(type(self), "forward")(self, hidden_states, gate)
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return gated_rms_norm(hidden_states, gate, self.weight, eps)


# module attribute -> adapter (5.x: the layer's forward calls these module functions by name)
_FUNCS = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
    "torch_recurrent_gated_delta_rule": recurrent_gated_delta_rule,
}
# 4.57: GatedDeltaNet.__init__ copies these onto the instance
_INSTANCE_ATTRS = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "recurrent_gated_delta_rule": recurrent_gated_delta_rule,
}


def _original(name: str):
    """The unpatched module-level function ``name`` (for fallbacks on arguments gdn does not cover)."""
    for owner, attr, orig in _saved:
        if attr == name and not isinstance(owner, type) and orig is not _MISSING and orig is not None:
            return orig
    import sys

    for modname in _patched_modules:  # 4.57: module globals are not patched
        for cand in (name, "torch_" + name):
            fn = vars(sys.modules[modname]).get(cand)
            if callable(fn) and fn not in _INSTANCE_ATTRS.values():
                return fn
    raise NotImplementedError(f"gdn.integrations.transformers: no original {name} to fall back to")


def _original_method(cls, name: str):
    for owner, attr, orig in _saved:
        if attr == name and isinstance(owner, type) and issubclass(cls, owner) and orig is not _MISSING:
            return orig
    raise NotImplementedError(f"gdn.integrations.transformers: no original {cls.__name__}.{name}")


def _instance_descriptor(name: str, adapter):
    """Class-level data descriptor: reads give gdn's adapter, writes (from __init__) go to the instance dict, so
    ``disable()`` (which deletes the descriptor) leaves each instance with its original function."""

    def get(self):
        return adapter

    def set_(self, value):
        self.__dict__[name] = value

    return property(get, set_)


def _set(owner, attr: str, value) -> None:
    orig = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
    _saved.append((owner, attr, orig))
    setattr(owner, attr, value)


def _gdn_norm_available() -> bool:
    try:
        from gdn.ops.norm import gated_rms_norm  # noqa: F401
    except ImportError:
        return False
    return True


def enable(modules: Optional[Sequence[str]] = None, *, norm: bool = True) -> List[str]:
    """Patch the GDN layers of the given transformers modeling modules (default: Qwen3-Next, Qwen3.5, Qwen3.5-MoE,
    whichever the installed transformers has). Returns the modules patched. Calling it again is a no-op."""
    if _patched_modules:
        return list(_patched_modules)
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("gdn.integrations.transformers needs Hugging Face transformers: "
                          "pip install 'gdn[transformers]'") from e
    use_norm = norm and _gdn_norm_available()
    done = []
    for name in (DEFAULT_MODULES if modules is None else modules):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        hit = False
        # transformers 4.57: __init__ copies the functions onto the instance (and forward uses only those), so the
        # class gets descriptors and the module globals stay untouched (layers built while enabled keep the originals)
        legacy = "is_fast_path_available" in vars(mod)
        if not legacy:
            for attr, adapter in _FUNCS.items():
                if attr in vars(mod):
                    _set(mod, attr, adapter)
                    hit = True
        for cls in list(vars(mod).values()):
            if not isinstance(cls, type) or cls.__module__ != mod.__name__:
                continue
            if legacy and cls.__name__.endswith("GatedDeltaNet"):
                for attr, adapter in _INSTANCE_ATTRS.items():
                    _set(cls, attr, _instance_descriptor(attr, adapter))
                hit = True
            if use_norm and cls.__name__.endswith("RMSNormGated") and "forward" in cls.__dict__:
                _set(cls, "forward", _gated_norm_forward)
        if hit:
            done.append(name)
    if not done:
        _restore()
        names = list(DEFAULT_MODULES if modules is None else modules)
        raise RuntimeError(f"gdn.integrations.transformers: none of {names} has GDN functions to patch "
                           f"(transformers {transformers.__version__})")
    _patched_modules.extend(done)
    return list(done)


def _restore() -> None:
    while _saved:
        owner, attr, orig = _saved.pop()
        if orig is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, orig)


def disable() -> None:
    """Restore every patched function and method exactly."""
    _restore()
    _patched_modules.clear()


def is_enabled() -> bool:
    return bool(_patched_modules)


@contextlib.contextmanager
def enabled(modules: Optional[Sequence[str]] = None, *, norm: bool = True):
    """``with enabled(): ...`` runs the block with gdn patched in (restored afterwards if it was off)."""
    was = is_enabled()
    if not was:
        enable(modules, norm=norm)
    try:
        yield
    finally:
        if not was:
            disable()
