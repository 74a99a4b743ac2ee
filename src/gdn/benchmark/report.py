"""Rows, the JSON record and the terminal table of ``gdn bench``.

The JSON record (``bench/results/<gpu-name>.json``)::

    {"device": "NVIDIA H200", "copy_GBps": 4270.0, "bf16_TFLOPs": 788.0, "torch": "2.11.0", "triton": "3.6.0",
     ..., "rows": [row, ...]}

One row per measurement; the fields every row has are ``ROW_FIELDS`` (null where absent):

- the case: ``op`` (decode, recurrent, chunk_fwd, chunk_fwd_bwd, conv, layer, layer_decode), ``model``, ``batch``,
  ``seqlen``, ``H``, ``HV``, ``K``, ``V``, ``state_dtype``, ``dtype``, ``hidden``, ``key``;
- times: ``gdn_ms``, ``fla_ms``, ``flashinfer_ms`` (median per call), ``speedup_vs_fla`` and
  ``speedup_vs_flashinfer`` (peer time / gdn time: above 1, gdn is faster), ``timing`` (per implementation: graph or
  eager, spread, samples), ``n_sets`` (buffer sets rotated); for the eager-timed chunk_fwd, chunk_fwd_bwd and layer
  rows also ``<impl>_device_ms`` (device time per call with the host kept ahead: what the call costs the GPU,
  whatever the host's speed), ``speedup_vs_<peer>_device`` and ``<impl>_host_ms`` (the host's time to enqueue one
  call, the GPU idle: near ``<impl>_ms``, the row is bound by that machine's host);
- the floors: ``bytes``, ``flops``, ``mem_floor_ms`` (bytes / copy bandwidth), ``compute_floor_ms`` (FLOPs / bf16
  matrix rate), ``bound`` (the larger), ``frac_of_copy_bw`` and ``frac_of_matmul`` (floor / gdn time: the fraction of
  each limit gdn reaches), ``frac_of_limit`` (the larger floor over gdn time), and per peer ``<peer>_frac_of_limit``;
- correctness: ``gdn_err``, ``fla_err``, ``flashinfer_err`` (largest relative error of the outputs named in
  ``err_detail``, measured as ``err_what`` says), ``gdn_vs_<peer>`` where full-size outputs were compared;
- memory (chunk_fwd, chunk_fwd_bwd, layer, on CUDA): ``<impl>_peak_MB``, the peak memory one call allocates above
  what was allocated before it (scratch, saved activations, outputs); ``<impl>_held_MB``, what the implementation
  still holds after its calls of the row (process-wide scratch kept between calls, e.g. FlashInfer's context-parallel
  workspaces, which the per-call peak does not see: its process-wide scratch is dropped before the row's first
  call); a call's memory is the sum of the two;
- ``errors`` (implementation -> reason it has no number, e.g. ``NotImplementedError: ...``), ``notes``, ``skipped``.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from typing import Iterable, List, Optional

from .cases import OPS, case_from_dict, floors_ms

PEER_NAMES = ("fla", "flashinfer")
ROW_FIELDS = (
    "op", "model", "batch", "seqlen", "H", "HV", "K", "V", "state_dtype", "dtype", "hidden", "key",
    "gdn_ms", "fla_ms", "flashinfer_ms", "speedup_vs_fla", "speedup_vs_flashinfer",
    "gdn_device_ms", "fla_device_ms", "flashinfer_device_ms", "speedup_vs_fla_device", "speedup_vs_flashinfer_device",
    "gdn_host_ms", "fla_host_ms", "flashinfer_host_ms",
    "bytes", "flops", "mem_floor_ms", "compute_floor_ms", "bound", "frac_of_copy_bw", "frac_of_matmul",
    "frac_of_limit", "fla_frac_of_limit", "flashinfer_frac_of_limit",
    "gdn_err", "fla_err", "flashinfer_err", "err_what", "err_detail", "gdn_vs_fla", "gdn_vs_flashinfer",
    "n_sets", "timing", "errors", "notes", "skipped",
)
ERR_WARN = 5e-2   # a relative error above this is flagged in the table (bf16 results land near 1e-3 .. 1e-2)


def result_stem(device_name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "unknown-device"


def _num(x) -> Optional[float]:
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def finalize_row(row: dict, copy_GBps: Optional[float], bf16_TFLOPs: Optional[float]) -> dict:
    """Add the floors, the fractions of each limit and the speedups to a row of raw timings."""
    case = case_from_dict(row)
    fl = floors_ms(case, copy_GBps or 0.0, bf16_TFLOPs or 0.0)
    row.update(bytes=fl["bytes"], flops=fl["flops"], mem_floor_ms=fl["mem_floor_ms"],
               compute_floor_ms=fl["compute_floor_ms"])
    mem, comp = fl["mem_floor_ms"], fl["compute_floor_ms"]
    floor = max([f for f in (mem, comp) if f is not None], default=None)
    row["bound"] = None if floor is None else ("memory" if mem is not None and mem >= (comp or 0) else "compute")
    gdn = _num(row.get("gdn_ms"))
    row["frac_of_copy_bw"] = mem / gdn if gdn and mem is not None else None
    row["frac_of_matmul"] = comp / gdn if gdn and comp is not None else None
    row["frac_of_limit"] = floor / gdn if gdn and floor is not None else None
    for peer in PEER_NAMES:
        t = _num(row.get(f"{peer}_ms"))
        row[f"speedup_vs_{peer}"] = t / gdn if t and gdn else None
        pfloor = floor
        if peer == "fla" and case.op == "recurrent":   # fla moves fewer state bytes there (no per-token states)
            pf = floors_ms(case, copy_GBps or 0.0, bf16_TFLOPs or 0.0, variant="fla_recurrent")
            pfloor = max([f for f in (pf["mem_floor_ms"], pf["compute_floor_ms"]) if f is not None], default=None)
        row[f"{peer}_frac_of_limit"] = pfloor / t if t and pfloor is not None else None
        gd, td = _num(row.get("gdn_device_ms")), _num(row.get(f"{peer}_device_ms"))
        row[f"speedup_vs_{peer}_device"] = td / gd if td and gd else None
    for f in ROW_FIELDS:
        row.setdefault(f, None)
    return row


def skipped_row(case, reason: str) -> dict:
    from .runners import new_row

    row = new_row(case)
    row["skipped"] = reason
    return row


# ----------------------------------------------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------------------------------------------
def _clean(x):
    """JSON without NaN/Infinity (not valid JSON): non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: str, header: dict, rows: List[dict]) -> str:
    """Write atomically (a run killed mid-write leaves the previous file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = dict(header)
    doc["rows"] = rows
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(_clean(doc), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------------------------------
# terminal table
# ----------------------------------------------------------------------------------------------------------------------
def _f(x, fmt: str, none: str = "-") -> str:
    if isinstance(x, str):        # "inf" / "nan" from JSON
        return x
    return none if x is None else format(x, fmt)


def _ms(x) -> str:
    """Milliseconds with about four significant digits (decode runs in microseconds, the layer in milliseconds)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return _f(x, "")
    return format(x, ".1f" if x >= 100 else ".3f" if x >= 1 else ".4f" if x >= 0.01 else ".5f")


def _why(row: dict) -> str:
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    errs = row.get("errors") or {}
    parts = []
    if row.get("gdn_ms") is None:
        e = errs.get("gdn") or errs.get("case")
        parts.append(f"gdn: {e}" if e else "gdn: no time")
    err = row.get("gdn_err")
    if isinstance(err, str) or (err is not None and err > ERR_WARN):
        parts.append("gdn error above 5e-2")
    return "; ".join(parts)


TABLE_COLS = ("op", "model", "shape", "state", "gdn ms", "fla ms", "fi ms", "x fla", "x fi", "x fi dev", "lim%",
              "bound", "gdn err", "fla err", "fi err", "note")


def by_op(rows: Iterable[dict]) -> List[dict]:
    """Rows grouped by op (in ``OPS`` order), keeping their order within an op (display only: the JSON keeps the
    order of measurement)."""
    order = {op: i for i, op in enumerate(OPS)}
    return sorted(rows, key=lambda r: order.get(r.get("op"), len(order)))


def table_rows(rows: Iterable[dict]) -> List[List[str]]:
    out = []
    for r in by_op(rows):
        shape = f"{r.get('batch')}x{r.get('seqlen')} {r.get('H')}/{r.get('HV')}"
        out.append([
            str(r.get("op")), str(r.get("model")), shape, r.get("state_dtype") or "-",
            _ms(r.get("gdn_ms")), _ms(r.get("fla_ms")), _ms(r.get("flashinfer_ms")),
            _f(r.get("speedup_vs_fla"), ".2f"), _f(r.get("speedup_vs_flashinfer"), ".2f"),
            _f(r.get("speedup_vs_flashinfer_device"), ".2f"),
            _f(None if r.get("frac_of_limit") is None else 100 * r["frac_of_limit"], ".0f"),
            (r.get("bound") or "-")[:3], _f(r.get("gdn_err"), ".1e"), _f(r.get("fla_err"), ".1e"),
            _f(r.get("flashinfer_err"), ".1e"), _why(r),
        ])
    return out


def format_table(rows: Iterable[dict], cols=TABLE_COLS) -> str:
    body = table_rows(rows)
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])   # the note column is not padded
    left = {0, 1, 2, 3, cols.index("bound"), len(cols) - 1}

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(b) for b in body]).rstrip()


def geomean(xs: Iterable[float]) -> Optional[float]:
    xs = [x for x in xs if isinstance(x, (int, float)) and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary_lines(rows: List[dict]) -> List[str]:
    """Per op: rows timed, geometric-mean speedup over each peer, median fraction of the limit, worst gdn error."""
    lines = []
    for op in [o for o in OPS if any(r.get("op") == o for r in rows)]:
        rs = [r for r in rows if r.get("op") == op]
        timed = [r for r in rs if _num(r.get("gdn_ms"))]
        parts = [f"{op}: gdn timed {len(timed)}/{len(rs)}"]
        for peer, short in (("fla", "fla"), ("flashinfer", "fi")):
            gm = geomean(r.get(f"speedup_vs_{peer}") for r in rs)
            if gm is not None:
                n = sum(1 for r in rs if _num(r.get(f"speedup_vs_{peer}")))
                parts.append(f"x{short} {gm:.2f} (geomean of {n})")
            gd = geomean(r.get(f"speedup_vs_{peer}_device") for r in rs)
            if gd is not None:
                parts.append(f"x{short} {gd:.2f} on the device")
        fr = sorted(r["frac_of_limit"] for r in timed if _num(r.get("frac_of_limit")))
        if fr:
            parts.append(f"limit {100 * fr[len(fr) // 2]:.0f}% median")
        errs = [r.get("gdn_err") for r in rs if r.get("gdn_err") is not None]
        if errs:
            worst = max(float(e) if not isinstance(e, str) else float("inf") for e in errs)
            parts.append(f"worst gdn err {worst:.1e}")
        lines.append(", ".join(parts))
    return lines


__all__ = ["ROW_FIELDS", "finalize_row", "skipped_row", "write_json", "load_json", "format_table", "summary_lines",
           "result_stem", "geomean", "by_op", "ERR_WARN"]
