"""The PNG of ``gdn bench`` (matplotlib, when importable): per row, gdn's speedup over each peer (log scale, 1 = parity)
and the fraction of the hardware limit (the larger floor over the time) that gdn and each peer reach."""
from __future__ import annotations

import math
from typing import List, Optional

COLORS = {"fla": "#1f77b4", "flashinfer": "#d62728", "gdn": "#2ca02c"}


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def write_plot(rows: List[dict], path: str, title: str = "") -> Optional[str]:
    """Write the plot; returns the path, or None when matplotlib is missing or no row has a time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    rows = [r for r in rows if not r.get("skipped") and any(_ok(r.get(f"{n}_ms")) for n in ("gdn", "fla",
                                                                                              "flashinfer"))]
    if not rows:
        return None
    from .report import by_op

    rows = by_op(rows)
    labels = [f"{r['op']} {r['model']} {r['batch']}x{r['seqlen']}" + (f" {r['state_dtype']}" if r.get("state_dtype")
                                                                       else "") for r in rows]
    n = len(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 1.2 + 0.22 * n), sharey=True)
    y = list(range(n))
    h = 0.38
    for j, peer in enumerate(("fla", "flashinfer")):
        vals = [r.get(f"speedup_vs_{peer}") for r in rows]
        ys = [yy + (j - 0.5) * h for yy, v in zip(y, vals) if _ok(v)]
        xs = [v for v in vals if _ok(v)]
        if xs:
            ax1.barh(ys, xs, height=h, color=COLORS[peer], label=f"vs {peer}")
    ax1.axvline(1.0, color="k", lw=0.8)
    ax1.set_xscale("log")
    ax1.set_xlabel("speedup of gdn (peer time / gdn time)")
    ax1.legend(loc="lower right", fontsize=8)
    hh = 0.27
    for j, name in enumerate(("gdn", "fla", "flashinfer")):
        key = "frac_of_limit" if name == "gdn" else f"{name}_frac_of_limit"
        vals = [r.get(key) for r in rows]
        ys = [yy + (j - 1) * hh for yy, v in zip(y, vals) if _ok(v)]
        xs = [v for v in vals if _ok(v)]
        if xs:
            ax2.barh(ys, xs, height=hh, color=COLORS[name], label=name)
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("fraction of the hardware limit (max(bytes/copy BW, FLOPs/bf16 rate) / time)")
    ax2.legend(loc="lower right", fontsize=8)
    ax1.set_yticks(y)
    ax1.set_yticklabels(labels, fontsize=7)
    ax1.invert_yaxis()
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["write_plot"]
