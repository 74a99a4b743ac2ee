"""What ``gdn bench`` measures: the cases (op x shape x state dtype) and the cost model of each.

The cost model gives, per case, the fewest bytes an implementation must move through device memory (every input read
once, every output written once) and the floating-point operations of the algorithm. Over the measured copy bandwidth
and bf16 matrix rate these are the two floors of METHOD.md; ``bench/NOTES.md`` prints the formulas.

FLOP counts of the chunked ops (per value head, chunk of ``C`` tokens; dense ``C x C`` tiles, as tensor cores compute
them; K, V the head dims)::

    forward   6 C K V  + 2 C^2 (3K + 2V) + (2/3) C^3
              (Gram K K^T, W = T K, U = T V, Q K^T, (QK^T) V_new: the C^2 terms; W S, K^T V_new, Q S: the C K V
              terms; the unit-lower-triangular inverse (I + A)^-1: the C^3 term)
    backward 16 C K V  + 2 C^2 (8K + 5V) + 4 C^3
              (recompute W, U and the chunk states; dv local; the reverse state pass dh; dq, dk, dw; the WY backward
              through the inverse: dA = -T^T dT T^T)

i.e. per token and value head at K = V = 128, C = 64: forward ~183 kFLOP, backward ~492 kFLOP. The recurrent forms
(decode, multi-token verify) are memory-bound by orders of magnitude (~7 K V FLOP per token and head against a state
of K V elements read and written), so their FLOPs are reported but the floor is bytes. So is one cached decode step of
the whole layer (``layer_decode``): every weight read once, each sequence's conv and recurrent state read and written,
the token in and out; its projections' FLOPs are reported beside.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

OPS = ("decode", "recurrent", "chunk_fwd", "chunk_fwd_bwd", "conv", "layer", "layer_decode")

#: label -> (H, HV): the model shapes of the issue (K = V = 128), plus the extra chunk shapes.
MODELS: Dict[str, tuple] = {
    "qwen3next-tp1": (16, 32),   # Qwen3-Next 80B, 16 q/k heads, 32 v heads
    "qwen3next-tp2": (8, 16),
    "qwen3next-tp4": (4, 8),
    "qwen35-397b": (16, 64),     # Qwen3.5 397B-A17B
    "h2-hv8": (2, 8),
    "h64-hv64": (64, 64),
}
HIDDEN = {"qwen3next-tp1": 2048, "qwen35-397b": 4096}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CHUNK = 64
CONV_WIDTH = 4


@dataclass(frozen=True)
class Case:
    op: str
    model: str
    batch: int          # sequences (decode: batch; recurrent: sequences N; chunk/conv/layer: B)
    seqlen: int         # tokens per sequence (decode, layer_decode: 1; recurrent: T of the verify step)
    H: int
    HV: int
    K: int = 128
    V: int = 128
    state_dtype: Optional[str] = None   # "fp32" / "bf16" for ops that carry a state
    dtype: str = "bf16"                 # activations
    hidden: Optional[int] = None        # layer, layer_decode only

    @property
    def key(self) -> str:
        return (f"{self.op}|{self.model}|B{self.batch}|T{self.seqlen}|H{self.H}|HV{self.HV}|K{self.K}|V{self.V}|"
                f"{self.state_dtype or '-'}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def conv_dim(self) -> int:
        """Channels of the packed Q|K|V conv input: 2 H K + HV V."""
        return 2 * self.H * self.K + self.HV * self.V

    def label(self) -> str:
        s = f"{self.op} {self.model} {self.batch}x{self.seqlen}"
        return s + (f" {self.state_dtype}" if self.state_dtype else "")

    def to_dict(self) -> dict:
        return asdict(self)


def case_from_dict(d: dict) -> Case:
    names = {f for f in Case.__dataclass_fields__}
    return Case(**{k: v for k, v in d.items() if k in names})


# ----------------------------------------------------------------------------------------------------------------------
# cost model
# ----------------------------------------------------------------------------------------------------------------------
def chunk_fwd_flops_per_token_head(K: int, V: int, C: int = CHUNK) -> float:
    return 6 * K * V + 2 * C * (3 * K + 2 * V) + (2 / 3) * C * C


def chunk_bwd_flops_per_token_head(K: int, V: int, C: int = CHUNK) -> float:
    return 16 * K * V + 2 * C * (8 * K + 5 * V) + 4 * C * C


def layer_proj_flops_fwd(tokens: int, hidden: int, H: int, HV: int, K: int, V: int) -> float:
    """In-projections (q, k: H K each; v, z: HV V each; a, b: HV each) and the out-projection (HV V -> hidden)."""
    n_in = 2 * H * K + 2 * HV * V + 2 * HV
    return 2.0 * tokens * hidden * n_in + 2.0 * tokens * HV * V * hidden


def cost(case: Case, variant: str = "gdn") -> Dict[str, Optional[float]]:
    """``{"bytes": ..., "flops": ...}`` (bytes None where no meaningful floor exists).

    ``variant="fla_recurrent"``: fla 0.6.0 has no state pool, so its multi-token step reads one state and writes one
    final state (gdn and FlashInfer read one and write T: the state after every token of the verify step).
    """
    c = case
    act = DTYPE_BYTES[c.dtype]
    sb = DTYPE_BYTES.get(c.state_dtype or "fp32", 4)
    state = c.HV * c.K * c.V  # elements per sequence
    if c.op in ("decode", "recurrent"):
        N, T = c.batch, c.seqlen
        tok = N * T
        io = tok * (2 * c.H * c.K + 2 * c.HV * c.V) * act      # q, k in; v in, o out
        io += tok * 2 * c.HV * act                              # raw gates a, b
        io += 2 * c.HV * 4                                      # A_log, dt_bias
        if c.op == "decode":
            st = 2 * N * state * sb                             # read + write in place
        elif variant == "fla_recurrent":
            st = N * state * sb + N * state * 4                 # read one, write the fp32 final state
        else:
            st = N * state * sb + tok * state * sb + tok * 4 + N * 4   # read one, write T; indices
        flops = 7.0 * tok * c.HV * c.K * c.V
        return {"bytes": float(io + st), "flops": flops}
    if c.op in ("chunk_fwd", "chunk_fwd_bwd"):
        tok = c.tokens
        qk = tok * c.H * c.K * act
        vv = tok * c.HV * c.V * act
        gates = tok * c.HV * (4 + act)                           # g fp32, beta in activation dtype
        states = c.batch * state * 4
        fwd_bytes = 2 * qk + 2 * vv + gates + 2 * states         # q, k, v, o; g, beta; h0 in, ht out
        fwd_flops = tok * c.HV * chunk_fwd_flops_per_token_head(c.K, c.V)
        if c.op == "chunk_fwd":
            return {"bytes": float(fwd_bytes), "flops": fwd_flops}
        # backward: read q, k, v, g, beta, h0, do, dht; write dq, dk, dv, dg, dbeta
        bwd_bytes = 2 * (2 * qk + 2 * vv + gates) + vv + 2 * states
        bwd_flops = tok * c.HV * chunk_bwd_flops_per_token_head(c.K, c.V)
        return {"bytes": float(fwd_bytes + bwd_bytes), "flops": fwd_flops + bwd_flops}
    if c.op == "conv":
        D = c.conv_dim
        return {"bytes": float(2 * c.tokens * D * act + D * CONV_WIDTH * act),
                "flops": 2.0 * c.tokens * D * CONV_WIDTH}
    if c.op == "layer":
        hidden = c.hidden or HIDDEN.get(c.model, 2048)
        proj = layer_proj_flops_fwd(c.tokens, hidden, c.H, c.HV, c.K, c.V)
        core = c.tokens * c.HV * (chunk_fwd_flops_per_token_head(c.K, c.V) + chunk_bwd_flops_per_token_head(c.K, c.V))
        return {"bytes": None, "flops": 3.0 * proj + core}     # backward of a matmul: twice its forward
    if c.op == "layer_decode":
        hidden = c.hidden or HIDDEN.get(c.model, 2048)
        D = c.conv_dim
        weights = hidden * (2 * c.H * c.K + 2 * c.HV * c.V + 2 * c.HV)   # in_proj: q, k, v, z, a, b
        weights += D * CONV_WIDTH + 2 * c.HV + c.V + c.HV * c.V * hidden  # conv; A_log, dt_bias; norm; out_proj
        # GDNCache keeps the conv state in the state dtype unless told otherwise (conv_dtype defaults to dtype)
        states = 2 * c.batch * (state + D * (CONV_WIDTH - 1)) * sb       # read + written in place
        io = 2 * c.tokens * hidden * act                                  # x in, y out
        flops = (layer_proj_flops_fwd(c.tokens, hidden, c.H, c.HV, c.K, c.V) + 2.0 * c.tokens * D * CONV_WIDTH
                 + 7.0 * c.tokens * c.HV * c.K * c.V)
        return {"bytes": float(weights * act + states + io), "flops": flops}
    raise ValueError(f"op: expected one of {OPS}, got {c.op!r}")


def floors_ms(case: Case, copy_GBps: float, bf16_TFLOPs: float, variant: str = "gdn") -> Dict[str, Optional[float]]:
    """``mem_floor_ms`` (bytes / copy bandwidth) and ``compute_floor_ms`` (FLOPs / bf16 matrix rate)."""
    cst = cost(case, variant)
    mem = cst["bytes"] / (copy_GBps * 1e9) * 1e3 if cst["bytes"] is not None and copy_GBps else None
    comp = cst["flops"] / (bf16_TFLOPs * 1e12) * 1e3 if cst["flops"] is not None and bf16_TFLOPs else None
    return {"bytes": cst["bytes"], "flops": cst["flops"], "mem_floor_ms": mem, "compute_floor_ms": comp}


# ----------------------------------------------------------------------------------------------------------------------
# case lists
# ----------------------------------------------------------------------------------------------------------------------
def _hh(model: str) -> tuple:
    return MODELS[model]


def _decode(models: Sequence[str], batches: Sequence[int], dtypes=("fp32", "bf16")) -> List[Case]:
    return [Case("decode", m, B, 1, *_hh(m), state_dtype=sd) for m in models for B in batches for sd in dtypes]


def _recurrent(models, Ns, Ts, dtypes=("fp32",)) -> List[Case]:
    return [Case("recurrent", m, N, T, *_hh(m), state_dtype=sd) for m in models for sd in dtypes for N in Ns
            for T in Ts]


def _chunk(op: str, specs: Sequence[tuple]) -> List[Case]:
    return [Case(op, m, B, T, *_hh(m), state_dtype="fp32") for (m, B, T) in specs]


def _conv(specs) -> List[Case]:
    return [Case("conv", m, B, T, *_hh(m)) for (m, B, T) in specs]


def _layer(specs) -> List[Case]:
    return [Case("layer", m, B, T, *_hh(m), hidden=HIDDEN[m]) for (m, B, T) in specs]


def _layer_decode(specs, state_dtypes=("fp32", "bf16")) -> List[Case]:
    """One cached decode step (1 token per sequence) with the layer's default cache layout, fp32 and bf16 states."""
    return [Case("layer_decode", m, B, 1, *_hh(m), state_dtype=sd, hidden=HIDDEN[m]) for (m, B) in specs
            for sd in state_dtypes]


def quick_cases() -> List[Case]:
    tp1 = "qwen3next-tp1"
    return (_decode([tp1], [1, 32, 512])
            + _recurrent([tp1], [64], [4])
            + _chunk("chunk_fwd", [(tp1, 1, 8192)])
            + _chunk("chunk_fwd_bwd", [(tp1, 1, 8192)])
            + _conv([(tp1, 1, 8192)])
            + _layer([(tp1, 4, 4096)])
            + _layer_decode([(tp1, 256)]))


def acceptance_cases() -> List[Case]:
    """The rows the issues' goals are stated for (decode batches, the five prefill shapes, the layer, its decode
    step)."""
    tp1 = "qwen3next-tp1"
    issue_shapes = [(tp1, 1, 8192), (tp1, 1, 32768), (tp1, 4, 4096), ("h2-hv8", 1, 65536), ("h64-hv64", 1, 32768)]
    return (_decode([tp1], [1, 32, 128, 512, 2048])
            + _chunk("chunk_fwd", issue_shapes)
            + _chunk("chunk_fwd_bwd", issue_shapes)
            + _layer([(tp1, 4, 4096)])
            + _layer_decode([(tp1, 256)]))


def full_cases() -> List[Case]:
    tp1, tp2, tp4, q35 = "qwen3next-tp1", "qwen3next-tp2", "qwen3next-tp4", "qwen35-397b"
    rest = (_decode([tp1, tp2, tp4, q35], [1, 4, 32, 128, 512, 2048])
            + _recurrent([tp1], [8, 64, 256], [2, 4, 8])
            + _recurrent([tp2, tp4, q35], [64], [4])
            + _recurrent([tp1], [64], [2, 4, 8], dtypes=("bf16",))
            + _chunk("chunk_fwd", [(tp1, 1, 8192), (tp1, 4, 4096), (tp1, 1, 32768), (tp1, 1, 16384),
                                   (tp1, 1, 65536), (tp2, 1, 8192), (tp4, 1, 8192), (q35, 1, 8192), (q35, 4, 4096),
                                   ("h2-hv8", 1, 65536), ("h64-hv64", 1, 32768)])
            + _chunk("chunk_fwd_bwd", [(tp1, 1, 8192), (tp1, 4, 4096), (tp1, 1, 32768), (tp1, 1, 65536),
                                       (tp2, 1, 8192), (tp4, 1, 8192), (q35, 1, 8192), ("h2-hv8", 1, 65536),
                                       ("h64-hv64", 1, 32768)])
            + _conv([(tp1, 1, 8192), (tp1, 4, 4096), (tp1, 1, 32768), (tp4, 1, 8192), (q35, 1, 8192)])
            + _layer([(tp1, 4, 4096)])
            + _layer_decode([(tp1, 256)]))
    # the quick set first, then the issues' acceptance rows, so that a run cut short by its time budget (one device
    # call is 10 minutes; continue with --resume-from) still holds the headline numbers
    out, seen = [], set()
    for c in quick_cases() + acceptance_cases() + rest:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


def select(cases: Sequence[Case], ops: Optional[Sequence[str]] = None, match: Optional[str] = None) -> List[Case]:
    """Filter by op (keeping the order of ``cases``) and by substrings of the case label or key: ``match`` is one
    substring or several separated by commas (any of them; a key's own '|' is plain text, e.g. 'B4|T4096')."""
    alts = [m for m in match.split(",") if m] if match else []
    out = []
    for c in cases:
        if ops and c.op not in ops:
            continue
        if alts and not any(m in c.key or m in c.label() for m in alts):
            continue
        out.append(c)
    return out


def floors_table(cases: Sequence[Case], copy_GBps: float, bf16_TFLOPs: float) -> str:
    """Markdown table of both floors per case (``gdn bench --floors``; the numbers in bench/NOTES.md)."""
    lines = [f"floors at copy {copy_GBps:.0f} GB/s, bf16 {bf16_TFLOPs:.0f} TFLOP/s",
             "| case | MB moved | GFLOP | bytes floor (us) | FLOP floor (us) | bound |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for c in cases:
        f = floors_ms(c, copy_GBps, bf16_TFLOPs)
        mb = f"{f['bytes'] / 1e6:.2f}" if f["bytes"] is not None else "-"
        mem = f"{f['mem_floor_ms'] * 1e3:.2f}" if f["mem_floor_ms"] is not None else "-"
        comp = f"{f['compute_floor_ms'] * 1e3:.2f}"
        bound = "memory" if (f["mem_floor_ms"] or 0) >= f["compute_floor_ms"] else "compute"
        lines.append(f"| {c.label()} ({c.H}/{c.HV}) | {mb} | {f['flops'] / 1e9:.3f} | {mem} | {comp} | {bound} |")
    return "\n".join(lines)


__all__ = ["OPS", "MODELS", "Case", "case_from_dict", "cost", "floors_ms", "quick_cases", "acceptance_cases", "full_cases", "select",
           "floors_table", "chunk_fwd_flops_per_token_head", "chunk_bwd_flops_per_token_head"]
