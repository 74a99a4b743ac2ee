"""Environment settings of gdn: the one module that reads them (kernel modules never read ``os.environ``).

Tuning overrides (every field of the tables in :mod:`gdn.kernels.tuning`)::

    GDN_TUNE="family.key=value,family.key=value,..."

    GDN_TUNE=chunk_fwd.state_stages=3,chunk_bwd.dh_stages=3
    GDN_TUNE=decode.BV=32,decode.warps=2,decode.stages=3,decode.tiles=4

``family`` is one of ``chunk_fwd``, ``chunk_bwd``, ``decode``, ``recurrent``, ``decode_step``; ``value`` is converted
to the type of the field's default (integer, float, ``true``/``false``, or a word such as ``tf32``). The variable is
read at every launch (parsed once per distinct value), so a process may change it between calls. A malformed item, an
unknown family or key, or a value of the wrong type raises ValueError naming ``GDN_TUNE`` and the item before any
kernel runs.
In Python, :func:`gdn.kernels.tuning.override` does the same for a ``with`` block.

Other variables (not tuning): ``GDN_BACKEND`` (:mod:`gdn.backend`), ``GDN_SKIP_VALUE_CHECKS``
(:mod:`gdn.ops._validate`), ``TRITON_INTERPRET`` (Triton's interpreter; :func:`triton_interpret`).
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

ENV = "GDN_TUNE"
FAMILIES = ("chunk_fwd", "chunk_bwd", "decode", "recurrent", "decode_step")

_PARSED: Dict[str, Dict[str, Dict[str, str]]] = {}


def triton_interpret() -> bool:
    """True when Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``, set before the first kernel import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def parse_tune(raw: str) -> Dict[str, Dict[str, str]]:
    """``"family.key=value,..."`` -> ``{family: {key: value-string}}`` (types are checked against the tables by
    :mod:`gdn.kernels.tuning`). Raises ValueError naming GDN_TUNE and the bad item."""
    out: Dict[str, Dict[str, str]] = {}
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        family, dot, key = name.strip().partition(".")
        if not eq or not dot or not key.strip() or not value.strip():
            raise ValueError(f"{ENV}: bad item {item!r}; expected family.key=value (e.g. chunk_fwd.state_BV=32)")
        if family not in FAMILIES:
            raise ValueError(f"{ENV}: unknown family {family!r} in {item!r}; known: {', '.join(FAMILIES)}")
        out.setdefault(family, {})[key.strip()] = value.strip()
    return out


# os.environ keeps its items in ``_data`` under encoded keys; reading that dict directly costs ~0.1 us against ~1-2 us
# for os.environ.get (which encodes the key and decodes the value), and tuning lookups read GDN_TUNE at every launch
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV) if _ENV_DATA is not None and hasattr(os.environ, "encodekey") else None


def tune_raw():
    """GDN_TUNE as set now, undecoded (bytes or str; empty when unset): a cheap value to compare with the last one."""
    if _ENV_KEY is not None:
        return _ENV_DATA.get(_ENV_KEY, b"")
    return os.environ.get(ENV, "")


def tune_overrides(family: str) -> Tuple[str, Dict[str, str]]:
    """(the raw GDN_TUNE string, its ``{key: value-string}`` items for ``family``)."""
    raw = os.environ.get(ENV, "").strip()
    parsed = _PARSED.get(raw)
    if parsed is None:
        parsed = parse_tune(raw)
        if len(_PARSED) > 64:
            _PARSED.clear()
        _PARSED[raw] = parsed
    return raw, parsed.get(family, {})


__all__ = ["ENV", "FAMILIES", "parse_tune", "tune_raw", "tune_overrides", "triton_interpret"]
