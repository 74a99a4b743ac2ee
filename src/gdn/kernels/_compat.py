"""Differences between the Triton releases gdn supports (3.6 - 3.9), in one place; kernels contain no version checks.

The kernels themselves are written to the part of the language that every supported release accepts alike: masks
that combine a block with a scalar condition are written ``tl.where(cond, block_mask, False)`` (the interpreter of
every release splats a scalar comparison with its operands' integer dtype, so ``block_mask & cond`` is an int32
block there, which Triton >= 3.9's interpreter rejects as a mask; compiled code is the same select either way).

What is left here is a fix of Triton 3.6's interpreter (CPU, ``TRITON_INTERPRET=1``) for numpy >= 2.4: a loop bound
that is a runtime value (a loaded scalar or an int argument) is a 1-element array there, and 3.6 converts it with
``int(array)``, which numpy 2.4 no longer allows for arrays of ndim > 0 (numpy 2.3 warns). Triton 3.7 converts
``int(array.squeeze())``; :func:`apply` gives 3.6 the same conversion. It changes nothing on a GPU or with Triton
>= 3.7.
"""
from __future__ import annotations

import os


def _version(text: str) -> tuple:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def interpreter_index_fix_needed() -> bool:
    """True where Triton's interpreter calls ``int()`` on a 1-element array (Triton < 3.7)."""
    import triton

    return _version(triton.__version__) < (3, 7)


def apply() -> None:
    """Install the interpreter fix above where it is needed (idempotent; only under ``TRITON_INTERPRET=1``)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1" or not interpreter_index_fix_needed():
        return
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_gdn_index_fix", False):
        return

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._gdn_index_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


apply()
