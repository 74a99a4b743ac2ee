"""Backend selection: ``GDN_BACKEND`` = ``auto`` (default) | ``triton`` | ``torch``.

``auto`` runs the Triton kernels on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` (Triton's interpreter
runs the same kernel code on the CPU); otherwise the PyTorch reference path. ``triton`` on CPU tensors without the
interpreter is an error.
"""
from __future__ import annotations

import os

import torch

_CHOICES = ("auto", "triton", "torch")


def backend_name() -> str:
    name = os.environ.get("GDN_BACKEND", "auto").strip().lower() or "auto"
    if name not in _CHOICES:
        raise ValueError(f"GDN_BACKEND: expected one of {_CHOICES}, got {name!r}")
    return name


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the machine
        return False
    return True


def use_triton(device: torch.device) -> bool:
    """True when the op should launch its Triton kernel for tensors on ``device``."""
    name = backend_name()
    if name == "torch":
        return False
    if device.type == "cuda":
        if name == "triton" and not _triton_importable():
            raise RuntimeError("GDN_BACKEND=triton but triton cannot be imported")
        return _triton_importable() or name == "triton"
    if triton_interpreting() and _triton_importable():
        return True
    if name == "triton":
        raise RuntimeError(
            f"GDN_BACKEND=triton with {device.type} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before importing gdn, or use GDN_BACKEND=auto/torch"
        )
    return False
