"""``gdn check``: every op against the float64 reference on the current device.

Each module listed in ``MODULES`` registers check functions with :func:`register`; a check takes the device and
returns a list of :class:`Result`. A module that fails to import counts as a failed check.
"""
from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass, field
from typing import Callable, List

import torch

MODULES = ["gate", "recurrent", "decode", "chunk", "chunk_backward", "conv", "norm", "layer", "serving"]


@dataclass
class Result:
    op: str
    case: str
    rel_err: float
    tol: float
    note: str = ""
    passed: bool = field(init=False)

    def __post_init__(self):
        self.passed = bool(self.rel_err <= self.tol)


_CHECKS: List[Callable[[torch.device], List[Result]]] = []


def register(fn):
    _CHECKS.append(fn)
    return fn


def run_all(device: torch.device, only=None, progress=None, names=None) -> List[Result]:
    """Every registered check of the modules in ``only`` (None: all) on ``device``; ``names``: only the check
    functions whose name contains one of these strings (None: all)."""
    results: List[Result] = []
    for name in MODULES:
        if only and name not in only:
            continue
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{name}":
                continue  # op not built yet
            results.append(Result(name, "import", float("inf"), 0.0, note=repr(e)))
        except Exception as e:  # pragma: no cover - reported as a failure
            results.append(Result(name, "import", float("inf"), 0.0, note=repr(e)))
    for fn in list(_CHECKS):
        mod = fn.__module__.rsplit(".", 1)[-1]
        if only and mod not in only:
            continue
        if names and not any(n in fn.__name__ for n in names):
            continue
        try:
            new = list(fn(device))
        except Exception as e:
            new = [Result(mod, fn.__name__, float("inf"), 0.0, note="".join(
                traceback.format_exception_only(type(e), e)).strip())]
        results.extend(new)
        if progress:
            progress(new)
    return results
