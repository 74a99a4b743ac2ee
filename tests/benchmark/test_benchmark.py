"""``gdn bench`` on CPU: the cost model, the row schema, the JSON / table / plot writers, the command line, the
no-CUDA exit, and the runners end to end with reference-backed stand-ins for gdn's ops and the peers (a host timer
instead of CUDA events), so that the input conventions and the correctness columns are exercised without a GPU."""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

import gdn.ops
from gdn import benchmark as B
from gdn.benchmark import cases as C
from gdn.benchmark import peers as P
from gdn.benchmark import report, runners
from gdn.benchmark.plot import write_plot
from gdn.benchmark.progress import Progress
from gdn.benchmark.timing import HostTimer, Timing, retime_noisy, rotation_sets
from gdn.reference import causal_conv1d_ref, chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from gdn.testing import rel_err

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------------------------------------------------
# stand-ins: gdn's ops and the peers' calling conventions, computed by the reference in float32
# ----------------------------------------------------------------------------------------------------------------------
def fake_decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, *, use_qk_l2norm=False, state_indices=None,
                output=None, state_layout="k_last"):
    o, st = recurrent_gated_delta_rule_ref(q.float(), k.float(), v.float(), scale=scale, initial_state=state.float(),
                                           output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                           state_layout=state_layout, A_log=A_log, a=a.float(), dt_bias=dt_bias,
                                           b=b.float())
    state.copy_(st)
    return o.to(torch.bfloat16), state


def fake_recurrent(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                   cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, state_layout="v_last", ssm_state_indices=None,
                   num_accepted_tokens=None, inplace_final_state=False, A_log=None, a=None, dt_bias=None, b=None):
    N, T = q.shape[:2]
    o, pool = torch.empty_like(v), initial_state
    for n in range(N):
        S = pool[int(ssm_state_indices[n, int(num_accepted_tokens[n]) - 1])].float()[None]
        for t in range(T):
            sl = (slice(n, n + 1), slice(t, t + 1))
            ot, S = recurrent_gated_delta_rule_ref(q[sl].float(), k[sl].float(), v[sl].float(), initial_state=S,
                                                   output_final_state=True,
                                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                   state_layout=state_layout, A_log=A_log, a=a[sl].float(),
                                                   dt_bias=dt_bias, b=b[sl].float())
            o[n, t] = ot[0, 0]
            pool[int(ssm_state_indices[n, t])] = S[0].to(pool.dtype)
    return o, pool


def fake_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
               use_qk_l2norm_in_kernel=False, *, state_layout="v_last", ssm_state_indices=None, chunk_size=64):
    o, ht = chunk_gated_delta_rule_ref(q.float(), k.float(), v.float(), g.float(), beta.float(), scale, initial_state,
                                       output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                                       state_layout=state_layout, chunk_size=chunk_size)
    return o.to(v.dtype), ht


def fake_conv(x, weight, bias=None, activation="silu", *, cu_seqlens=None, conv_state=None, conv_state_indices=None):
    return causal_conv1d_ref(x.float(), weight.float(), bias, activation)[0].to(x.dtype)


def fake_fla_recurrent(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                       output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                       dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                       cu_seqlens=None):
    assert use_gate_in_kernel and use_beta_sigmoid_in_kernel   # g / beta are the raw a / b
    o, st = recurrent_gated_delta_rule_ref(q.float(), k.float(), v.float(), scale=scale,
                                           initial_state=initial_state.float(), output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                           state_layout="k_last" if state_v_first else "v_last", A_log=A_log,
                                           a=g.float(), dt_bias=dt_bias, b=beta.float())
    return o.to(v.dtype), st


def fake_fla_conv(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None):
    return fake_conv(x, weight, bias, activation), None


def fake_fi_decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True, **kw):
    return fake_decode(q, k, v, state, A_log, a, dt_bias, b, scale, use_qk_l2norm=use_qk_l2norm)


def fake_fi_mtp(q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale=None, output=None,
                intermediate_states_buffer=None, ssm_state_indices=None, disable_state_update=None,
                use_qk_l2norm=True):
    assert disable_state_update is False and ssm_state_indices.dtype == torch.int32
    acc = torch.tensor([int((ssm_state_indices[n] == initial_state_indices[n]).nonzero()[0]) + 1
                        for n in range(q.shape[0])])
    return fake_recurrent(q, k, v, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm,
                          state_layout="k_last", ssm_state_indices=ssm_state_indices, num_accepted_tokens=acc,
                          A_log=A_log, a=a, dt_bias=dt_bias, b=b)


def fake_fi_prefill(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, use_qk_l2norm_in_kernel=False, **kw):
    """FlashInfer's convention: packed [total, heads, dim], LINEAR decay alpha, k-last states."""
    assert q.dim() == 3 and g.dtype == torch.float32 and bool((g > 0).all()) and cu_seqlens is not None
    o, ht = chunk_gated_delta_rule_ref(q[None].float(), k[None].float(), v[None].float(), torch.log(g)[None],
                                       beta[None], scale, initial_state, output_final_state, cu_seqlens,
                                       use_qk_l2norm_in_kernel, state_layout="k_last")
    return o[0].to(v.dtype), ht


@pytest.fixture
def fakes(monkeypatch):
    for name, fn in [("gated_delta_rule_decode", fake_decode), ("fused_recurrent_gated_delta_rule", fake_recurrent),
                     ("chunk_gated_delta_rule", fake_chunk), ("causal_conv1d", fake_conv)]:
        monkeypatch.setattr(gdn.ops, name, fn)
    for name, fn in [("fla_recurrent", fake_fla_recurrent), ("fla_chunk", fake_chunk), ("fla_conv", fake_fla_conv),
                     ("flashinfer_decode", fake_fi_decode), ("flashinfer_mtp", fake_fi_mtp),
                     ("flashinfer_prefill", fake_fi_prefill)]:
        monkeypatch.setattr(P, name, lambda fn=fn: fn)


def _ctx(peers=("fla", "flashinfer"), check_tokens=24):
    return runners.Ctx(torch.device("cpu"), HostTimer(target_s=0.0, min_samples=1, max_samples=1), 1 << 13,
                       frozenset(peers), check_tokens=check_tokens, check_seqs=4)


TINY = dict(H=2, HV=4, K=16, V=16)


def _case(op, batch, seqlen, state=None, **kw):
    return C.Case(op, "tiny", batch, seqlen, state_dtype=state, **{**TINY, **kw})


# ----------------------------------------------------------------------------------------------------------------------
# cost model and cases
# ----------------------------------------------------------------------------------------------------------------------
def test_flop_counts_at_model_dims():
    assert C.chunk_fwd_flops_per_token_head(128, 128) == pytest.approx(6 * 128 * 128 + 128 * 640 + 2 / 3 * 64 * 64)
    assert C.chunk_bwd_flops_per_token_head(128, 128) == 16 * 128 * 128 + 128 * (8 * 128 + 5 * 128) + 4 * 64 * 64
    c = C.Case("chunk_fwd", "m", 1, 8192, 16, 32, state_dtype="fp32")
    assert C.cost(c)["flops"] == pytest.approx(8192 * 32 * C.chunk_fwd_flops_per_token_head(128, 128))


def test_decode_bytes_read_and_write_the_state():
    c = C.Case("decode", "m", 4, 1, 16, 32, state_dtype="bf16")
    state = 2 * 4 * 32 * 128 * 128 * 2
    io = 4 * (2 * 16 * 128 + 2 * 32 * 128) * 2 + 4 * 2 * 32 * 2 + 2 * 32 * 4
    assert C.cost(c)["bytes"] == state + io
    f = C.floors_ms(c, 4270.0, 790.0)
    assert f["mem_floor_ms"] == pytest.approx((state + io) / 4270e9 * 1e3)


def test_recurrent_bytes_count_every_written_state_and_fla_variant_fewer():
    c = C.Case("recurrent", "m", 8, 4, 16, 32, state_dtype="fp32")
    gdn, fla = C.cost(c)["bytes"], C.cost(c, "fla_recurrent")["bytes"]
    assert gdn - fla == pytest.approx(8 * 3 * 32 * 128 * 128 * 4 + 8 * 4 * 4 + 8 * 4)


def test_layer_decode_bytes_are_the_weights_once_plus_the_cached_states_and_the_token():
    from gdn.layers import GatedDeltaNet, GDNCache

    hidden, N = 32, 3
    c = C.Case("layer_decode", "tiny", N, 1, state_dtype="fp32", hidden=hidden, **TINY)
    layer = GatedDeltaNet(hidden, TINY["H"], TINY["HV"], TINY["K"], TINY["V"], dtype=torch.bfloat16)
    cache = GDNCache.for_layers(layer, num_slots=N)      # the layer's default cache: what the case's state_dtype says
    assert cache.ssm_states.dtype == cache.conv_states.dtype == torch.float32
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    states = cache.conv_states[0, :N].nbytes + cache.ssm_states[0, :N].nbytes
    assert C.cost(c)["bytes"] == weights + 2 * states + 2 * N * hidden * 2
    full = [x for x in C.full_cases() if x.op == "layer_decode"]
    assert [(x.batch, x.seqlen, x.H, x.HV, x.hidden, x.state_dtype) for x in full] == [
        (256, 1, 16, 32, 2048, "fp32"), (256, 1, 16, 32, 2048, "bf16")]
    f = C.floors_ms(full[0], 4270.0, 790.0)
    assert f["bytes"] == pytest.approx(1193.6e6, rel=1e-4) and f["mem_floor_ms"] > 10 * f["compute_floor_ms"]


def test_case_lists():
    quick, full = C.quick_cases(), C.full_cases()
    assert {c.op for c in quick} == set(C.OPS) == {c.op for c in full}
    assert [c.key for c in full[:len(quick)]] == [c.key for c in quick]      # headline cases first
    assert len({c.key for c in full}) == len(full)
    keys = {(c.op, c.batch, c.seqlen, c.H, c.HV) for c in full}
    for need in [("chunk_fwd", 1, 65536, 2, 8), ("chunk_fwd", 1, 32768, 64, 64), ("chunk_fwd", 4, 4096, 16, 32),
                 ("decode", 2048, 1, 16, 64), ("decode", 1, 1, 4, 8), ("recurrent", 64, 8, 16, 32),
                 ("layer_decode", 256, 1, 16, 32)]:
        assert need in keys
    assert {c.state_dtype for c in full if c.op == "decode"} == {"fp32", "bf16"}
    assert C.select(full, ["conv"], "qwen35") == [c for c in full if c.op == "conv" and "qwen35" in c.key]


def test_select_takes_comma_separated_alternatives():
    """--match 'B4|T4096,B1|T8192': cases containing either text (a key's '|' is plain text), in the cases' order."""
    full = C.full_cases()
    two = C.select(full, ["chunk_fwd"], "B4|T4096,B1|T8192")
    want = [c for c in full if c.op == "chunk_fwd" and ("B4|T4096" in c.key or "B1|T8192" in c.key)]
    assert two == want and len(want) == 6
    assert {c.batch for c in two} == {1, 4}
    assert C.select(full, ["chunk_fwd"], "B4|T4096") == [c for c in want if c.batch == 4]
    assert C.select(full, ["chunk_fwd"], "B4|T8192") == []      # not an alternation: no key holds that text


def test_retime_noisy_keeps_the_least_noisy_measurement():
    """A noisy measurement is taken again, at most twice more, and the least noisy one is kept and marked; a clean
    one is taken once."""
    def series(spreads):
        it = iter(spreads)

        def measure():
            s = next(it)
            return Timing(1.0 + s, 1.0, 1.0 + s, 10, 1, "eager")     # spread (p80 - p20) / median
        return measure

    clean = retime_noisy(series([0.02]))
    assert clean.mode == "eager" and clean.median_ms == 1.02
    fixed = retime_noisy(series([0.3, 0.05, 0.9]))                    # stops once one is clean
    assert fixed.median_ms == 1.05 and fixed.mode == "eager (least noisy of 2)"
    stuck = retime_noisy(series([0.3, 0.5, 0.2, 0.01]))               # three at most
    assert stuck.median_ms == 1.2 and stuck.mode == "eager (least noisy of 3)"


def test_rotation_sets():
    assert rotation_sets(1e9, 50 << 20) == 1
    assert rotation_sets(10 << 20, 50 << 20) == 10
    assert rotation_sets(1, 50 << 20) == 128
    assert rotation_sets(None, 50 << 20) == 1


# ----------------------------------------------------------------------------------------------------------------------
# rows, JSON, table, plot
# ----------------------------------------------------------------------------------------------------------------------
def _synthetic_rows():
    rows = []
    for c, (g, f, fi, err) in zip(
            [C.Case("decode", "qwen3next-tp1", 32, 1, 16, 32, state_dtype="fp32"),
             C.Case("chunk_fwd", "qwen3next-tp1", 1, 8192, 16, 32, state_dtype="fp32"),
             C.Case("recurrent", "qwen3next-tp1", 64, 4, 16, 32, state_dtype="fp32"),
             C.Case("layer", "qwen3next-tp1", 4, 4096, 16, 32, hidden=2048)],
            [(0.04, 0.05, 0.035, 2e-3), (0.2, 0.3, 0.25, 4e-3), (None, 0.1, 0.2, None),
             (6.0, 7.5, None, float("inf"))]):
        row = runners.new_row(c)
        row.update(gdn_ms=g, fla_ms=f, flashinfer_ms=fi, gdn_err=err)
        if g is None:
            row["errors"]["gdn"] = "NotImplementedError: not yet"
        rows.append(report.finalize_row(row, 4270.0, 790.0))
    rows.append(report.finalize_row(report.skipped_row(C.Case("conv", "m", 1, 8192, 16, 32), "time budget"),
                                    4270.0, 790.0))
    return rows


def test_row_schema_speedups_and_fractions():
    rows = _synthetic_rows()
    for r in rows:
        assert set(report.ROW_FIELDS) <= set(r)
        json.dumps(report._clean(r), allow_nan=False)
    dec, chunk, rec, layer, skipped = rows
    assert dec["speedup_vs_fla"] == pytest.approx(0.05 / 0.04)
    assert dec["speedup_vs_flashinfer"] == pytest.approx(0.035 / 0.04)
    assert dec["bound"] == "memory" and dec["frac_of_limit"] == pytest.approx(dec["frac_of_copy_bw"])
    assert dec["frac_of_copy_bw"] == pytest.approx(dec["mem_floor_ms"] / 0.04)
    assert chunk["bound"] == "compute" and chunk["frac_of_matmul"] == pytest.approx(chunk["compute_floor_ms"] / 0.2)
    assert rec["gdn_ms"] is None and rec["speedup_vs_fla"] is None and rec["frac_of_limit"] is None
    assert rec["fla_frac_of_limit"] < rec["flashinfer_frac_of_limit"] * 2   # fla's own (smaller) byte count
    assert layer["bytes"] is None and layer["frac_of_copy_bw"] is None and layer["frac_of_matmul"] > 0
    assert skipped["skipped"] == "time budget" and skipped["gdn_ms"] is None


def test_json_roundtrip_without_nan(tmp_path):
    rows = _synthetic_rows()
    path = report.write_json(str(tmp_path / "sub" / "dev.json"), {"device": "X", "copy_GBps": 1.0,
                                                                   "bf16_TFLOPs": float("nan")}, rows)
    text = open(path).read()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert doc["device"] == "X" and doc["bf16_TFLOPs"] == "nan" and len(doc["rows"]) == len(rows)
    assert doc["rows"][3]["gdn_err"] == "inf"
    assert report.load_json(path)["rows"][0]["key"] == rows[0]["key"]
    assert report.load_json(str(tmp_path / "missing.json")) is None
    assert report.result_stem("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_device_time_speedups():
    """``<impl>_device_ms`` -> ``speedup_vs_<peer>_device`` (peer / gdn), its table column and summary part."""
    rows = _synthetic_rows()
    row = runners.new_row(C.Case("chunk_fwd", "qwen3next-tp2", 1, 8192, 8, 16, state_dtype="fp32"))
    row.update(gdn_ms=0.30, flashinfer_ms=0.24, gdn_device_ms=0.18, flashinfer_device_ms=0.19, gdn_err=3e-3)
    row = report.finalize_row(row, 4270.0, 790.0)
    assert row["speedup_vs_flashinfer"] == pytest.approx(0.8)
    assert row["speedup_vs_flashinfer_device"] == pytest.approx(0.19 / 0.18) and row["speedup_vs_fla_device"] is None
    assert rows[1]["speedup_vs_flashinfer_device"] is None          # no device times: no device speedup
    text = report.format_table(rows + [row])
    head = text.splitlines()[0].split("  ")
    assert "x fi dev" in [h.strip() for h in head]
    assert "1.06" in [l for l in text.splitlines() if "qwen3next-tp2" in l][0]
    assert "xfi 1.06 on the device" in "\n".join(report.summary_lines(rows + [row]))


def test_table_and_summary():
    rows = _synthetic_rows()
    text = report.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["op", "model", "shape"] and len(lines) == 2 + len(rows)
    assert [l.split()[0] for l in lines[2:]] == ["decode", "recurrent", "chunk_fwd", "conv", "layer"]   # by op
    line = {l.split()[0]: l for l in lines[2:]}
    assert "1.25" in line["decode"] and "NotImplementedError" in line["recurrent"]
    assert "skipped: time budget" in line["conv"] and "gdn error above 5e-2" in line["layer"]
    # a JSON record read back (non-finite numbers as strings) formats too
    assert report.format_table(json.loads(json.dumps(report._clean(rows))))
    summ = "\n".join(report.summary_lines(rows))
    assert "decode: gdn timed 1/1" in summ and "recurrent: gdn timed 0/1" in summ


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_plot(_synthetic_rows(), str(tmp_path / "p.png"), title="t")
    assert path and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert write_plot([], str(tmp_path / "none.png")) is None


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import fails
    assert write_plot(_synthetic_rows(), str(tmp_path / "p.png")) is None


def test_progress_text_fallback(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    buf = io.StringIO()
    p = Progress(4, desc="b", file=buf)
    for i in range(4):
        p.update(f"case {i}")
    p.close()
    out = buf.getvalue().splitlines()
    assert len(out) == 4 and out[-1].startswith("b [" + "#" * 30 + "] 4/4") and "case 3" in out[-1]


# ----------------------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------------------
def _args(argv):
    p = argparse.ArgumentParser()
    B.add_arguments(p)
    return p.parse_args(argv)


def test_argument_parsing():
    a = _args([])
    assert a.ops == ",".join(C.OPS) and a.out == os.path.join("bench", "results") and a.device == "cuda"
    assert not a.quick and not a.no_peers and a.budget_s is None
    a = _args(["--quick", "--ops", "decode,chunk_fwd", "--out", "x", "--no-peers", "--device", "cuda:1",
               "--budget-s", "30", "--resume-from", "r.json", "--tag", "v1"])
    assert (a.quick, a.ops, a.out, a.no_peers, a.device, a.budget_s, a.resume_from, a.tag) == \
        (True, "decode,chunk_fwd", "x", True, "cuda:1", 30.0, "r.json", "v1")


def test_cli_list_floors_and_bad_ops(capsys):
    from gdn.cli import main as cli

    assert cli(["bench", "--quick", "--list", "--ops", "decode"]) == 0
    out = capsys.readouterr().out.split()
    assert out and all(k.startswith("decode|") for k in out)
    assert cli(["bench", "--floors", "--quick", "--ops", "chunk_fwd"]) == 0
    assert "chunk_fwd qwen3next-tp1 1x8192" in capsys.readouterr().out
    assert cli(["bench", "--ops", "decode,warp"]) == 2
    assert "unknown warp" in capsys.readouterr().err


def test_no_cuda_exits_cleanly(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert B.main(_args(["--quick"])) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err


def test_no_cuda_exits_cleanly_from_the_command_line(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.path.join(REPO, "src"))
    p = subprocess.run([sys.executable, "-m", "gdn.cli", "bench", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "no CUDA device" in p.stderr and "Traceback" not in p.stderr
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------------------------------
# runners end to end (host timer, stand-ins)
# ----------------------------------------------------------------------------------------------------------------------
def _check_row(row, impls, tol=1e-2):
    for name in impls:
        assert row[f"{name}_ms"] is not None and row[f"{name}_ms"] > 0, (name, row["errors"])
        assert row[f"{name}_err"] is not None and row[f"{name}_err"] < tol, (name, row["err_detail"])


@pytest.mark.parametrize("sd", ["fp32", "bf16"])
def test_decode_runner(fakes, sd):
    row = runners.run_case(_case("decode", 5, 1, sd), _ctx())
    _check_row(row, ["gdn", "fla", "flashinfer"])
    assert set(row["err_detail"]["gdn"]) == {"o", "state"} and not row["errors"]


def test_recurrent_runner(fakes):
    row = runners.run_case(_case("recurrent", 5, 3, "fp32"), _ctx())
    _check_row(row, ["gdn", "fla", "flashinfer"])
    assert set(row["err_detail"]["gdn"]) == {"o", "states"}
    assert any(n.startswith("fla: no state pool") for n in row["notes"])
    row = runners.run_case(_case("recurrent", 3, 2, "bf16"), _ctx())
    _check_row(row, ["gdn", "fla"])
    assert row["flashinfer_ms"] is None and "float32 pool" in row["errors"]["flashinfer"]


def test_chunk_runners(fakes):
    row = runners.run_case(_case("chunk_fwd", 2, 40, "fp32"), _ctx())
    _check_row(row, ["gdn", "fla", "flashinfer"])
    assert row["gdn_vs_fla"] == 0.0 and row["gdn_vs_flashinfer"] < 1e-2   # bf16 rounding apart
    # the eager-timed chunk rows also carry a device time per implementation (the host timer's stand-in here)
    for name in ("gdn", "fla", "flashinfer"):
        assert row[f"{name}_device_ms"] > 0 and "device_spread" in row["timing"][name]
    assert "first 24 tokens" in row["err_what"]
    row = runners.run_case(_case("chunk_fwd_bwd", 1, 40, "fp32"), _ctx())
    _check_row(row, ["gdn", "fla"])
    assert set(row["err_detail"]["gdn"]) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta"}
    assert "no GDN backward" in row["errors"]["flashinfer"]
    # peak memory is recorded per implementation (CUDA only: None here)
    assert row["gdn_peak_MB"] is None and row["fla_peak_MB"] is None


def test_conv_runner(fakes):
    row = runners.run_case(_case("conv", 2, 50), _ctx())
    _check_row(row, ["gdn", "fla"])


def test_layer_decode_runner(monkeypatch):
    """The real block and its cache (Triton interpreter on CPU): two buffer sets (own slots each), checked against the
    float64 block from the cached states; a step that leaves the conv state stale shows in ``err_detail``."""
    c = _case("layer_decode", 3, 1, "fp32", hidden=32)
    ctx = runners.Ctx(torch.device("cpu"), HostTimer(target_s=0.0, min_samples=1, max_samples=1),
                      int(C.cost(c)["bytes"]), frozenset(("fla", "flashinfer")), check_seqs=2)
    row = report.finalize_row(runners.run_case(c, ctx), 100.0, 1.0)
    assert row["gdn_ms"] is not None and math.isfinite(row["gdn_ms"]) and row["gdn_ms"] > 0, row["errors"]
    assert row["n_sets"] == 2 and row["timing"]["gdn"]["calls_per_sample"] == 2
    assert set(row["err_detail"]["gdn"]) == {"out", "conv_state", "ssm_state"} and row["gdn_err"] < 2e-2
    assert row["frac_of_copy_bw"] == pytest.approx(C.cost(c)["bytes"] / 100e9 * 1e3 / row["gdn_ms"])
    assert row["fla_ms"] is None and "not timed" in row["errors"]["fla"]
    assert row["flashinfer_ms"] is None and "no GDN layer" in row["errors"]["flashinfer"]
    assert "16-token prefill" in row["notes"][0] and "fp32 recurrent and conv states" in row["notes"][0]
    # a step that does not write the conv state back, in the fused step (the default here) and in the separate kernels
    from gdn.kernels import decode_step, tuning

    step = decode_step.layer_decode_step
    monkeypatch.setattr(decode_step, "layer_decode_step",
                        lambda *a, **k: step(*a[:8], a[8].clone(), *a[9:], **k))   # a[8]: the conv pool
    update = gdn.ops.causal_conv1d_update
    monkeypatch.setattr(gdn.ops, "causal_conv1d_update", lambda x, st, *a, **k: update(x, st.clone(), *a, **k))
    for fused in (True, False):
        with tuning.override("decode_step", fused=fused):
            row = runners.run_case(c, runners.Ctx(torch.device("cpu"), ctx.timer, 1 << 13, frozenset(), check_seqs=2))
        det = row["err_detail"]["gdn"]
        assert row["n_sets"] == 1 and det["conv_state"] > 0.1 and det["out"] < 2e-2 and det["ssm_state"] < 2e-2


def test_wrong_result_shows_in_the_error_column(fakes, monkeypatch):
    def off_by_a_bit(*a, **k):
        o, st = fake_decode(*a, **k)
        return o * 1.1, st
    monkeypatch.setattr(gdn.ops, "gated_delta_rule_decode", off_by_a_bit)
    row = runners.run_case(_case("decode", 5, 1, "fp32"), _ctx(peers=()))
    assert row["err_detail"]["gdn"]["o"] == pytest.approx(0.1, rel=0.05)


def test_not_implemented_and_broken_peer_are_recorded(fakes, monkeypatch):
    def nyi(*a, **k):
        raise NotImplementedError("chunk_gated_delta_rule is not implemented yet")

    def bad_signature(q, k, v, g, beta, nonsense):   # a peer whose signature changed
        raise AssertionError("unreachable")
    monkeypatch.setattr(gdn.ops, "chunk_gated_delta_rule", nyi)
    monkeypatch.setattr(P, "fla_chunk", lambda: bad_signature)
    row = report.finalize_row(runners.run_case(_case("chunk_fwd", 1, 40, "fp32"), _ctx()), 100.0, 1.0)
    assert row["gdn_ms"] is None and row["errors"]["gdn"].startswith("NotImplementedError: chunk_gated")
    assert row["fla_ms"] is None and row["errors"]["fla"].startswith("TypeError")
    assert row["flashinfer_ms"] > 0 and row["speedup_vs_flashinfer"] is None


def test_dev_rel_err_matches_testing_rel_err():
    x, y = torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(3, 5)
    assert runners.dev_rel_err(x, y) == pytest.approx(rel_err(x, y))
    assert runners.dev_rel_err(torch.full((2,), float("nan")), torch.ones(2)) == math.inf


def test_fla_guard_bypass(monkeypatch):
    mod = types.ModuleType("fla.ops.common.chunk_o")
    mod.IS_NVIDIA_HOPPER, mod.TRITON_ABOVE_3_4_0, mod.TRITON_ABOVE_3_7_1 = True, True, False
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", mod)
    with P.fla_bwd_guard_bypassed() as active:
        assert active and mod.TRITON_ABOVE_3_7_1 is True
    assert mod.TRITON_ABOVE_3_7_1 is False


class _FakeDevice:
    """The CPU in place of the GPU for ``_run``: a host timer and made-up ceilings."""

    def __init__(self, dev, quick, target_s):
        self.dev, self.name, self.l2_bytes, self.info = dev, "Fake GPU", 1 << 13, {"sm_count": 0}
        self.timer = HostTimer(target_s=0.0, min_samples=1, max_samples=1)

    def ceilings(self):
        return 100.0, 1.0


def test_bench_run_writes_record_and_resumes(fakes, monkeypatch, tmp_path, capsys):
    cases = [_case("decode", 3, 1, "fp32"), _case("chunk_fwd", 1, 40, "fp32"), _case("conv", 1, 30)]
    args = _args(["--out", str(tmp_path), "--no-plot", "--check-tokens", "24"])
    assert B._run(args, cases, [], torch.device("cpu"), device_cls=_FakeDevice) == 0
    out = capsys.readouterr().out
    doc = json.load(open(tmp_path / "fake-gpu.json"))
    assert doc["device"] == "Fake GPU" and doc["copy_GBps"] == 100.0 and doc["bf16_TFLOPs"] == 1.0
    assert [r["key"] for r in doc["rows"]] == [c.key for c in cases]
    assert all(r["gdn_ms"] > 0 and r["gdn_err"] < 1e-2 for r in doc["rows"])
    assert "decode" in out and "wrote" in out
    # resume from that record: measured rows are kept, a skipped one is measured
    doc["rows"][2]["skipped"], doc["rows"][2]["gdn_ms"] = "time budget", None
    json.dump(doc, open(tmp_path / "prev.json", "w"))
    calls = []
    monkeypatch.setattr(gdn.ops, "gated_delta_rule_decode", lambda *a, **k: calls.append(1) or fake_decode(*a, **k))
    args = _args(["--out", str(tmp_path / "r"), "--no-plot", "--resume-from", str(tmp_path / "prev.json"), "--tag",
                  "again"])
    assert B._run(args, cases, [], torch.device("cpu"), device_cls=_FakeDevice) == 0
    doc2 = json.load(open(tmp_path / "r" / "fake-gpu-again.json"))
    assert not calls and doc2["rows"][0] == doc["rows"][0] and doc2["rows"][2]["gdn_ms"] > 0
    # resuming with a narrower selection keeps the record's other rows (and measures nothing already measured)
    args = _args(["--out", str(tmp_path / "r2"), "--no-plot", "--resume-from", str(tmp_path / "r" /
                                                                                  "fake-gpu-again.json")])
    assert B._run(args, cases[1:2], [], torch.device("cpu"), device_cls=_FakeDevice) == 0
    doc3 = json.load(open(tmp_path / "r2" / "fake-gpu.json"))
    assert sorted(r["key"] for r in doc3["rows"]) == sorted(c.key for c in cases) and not calls


def test_bench_run_cut_off_keeps_resumed_rows_of_later_cases(fakes, monkeypatch, tmp_path):
    """Every write during a resumed run holds the whole record: resumed rows of cases the loop has not reached yet
    are not dropped when the run is killed after its first measured case (a device call's time limit)."""
    cases = [_case("conv", 1, 30), _case("decode", 3, 1, "fp32"), _case("conv", 2, 30)]
    args = _args(["--out", str(tmp_path), "--no-plot"])
    assert B._run(args, cases, [], torch.device("cpu"), device_cls=_FakeDevice) == 0
    doc = json.load(open(tmp_path / "fake-gpu.json"))
    doc["rows"][0]["skipped"], doc["rows"][0]["gdn_ms"] = "time budget", None
    json.dump(doc, open(tmp_path / "prev.json", "w"))
    writes = []
    real_write = report.write_json
    monkeypatch.setattr(report, "write_json", lambda path, header, rows: writes.append([r["key"] for r in rows])
                        or real_write(path, header, rows))
    args = _args(["--out", str(tmp_path / "r"), "--no-plot", "--resume-from", str(tmp_path / "prev.json")])
    assert B._run(args, cases, [], torch.device("cpu"), device_cls=_FakeDevice) == 0
    assert len(writes) == 2 and all(sorted(w) == sorted(c.key for c in cases) for w in writes)


def test_bench_run_budget_skips(fakes, tmp_path, capsys):
    cases = [_case("conv", 1, 30), _case("conv", 2, 30)]
    args = _args(["--out", str(tmp_path), "--no-plot", "--budget-s", "0"])
    assert B._run(args, cases, [], torch.device("cpu"), device_cls=_FakeDevice) == 0
    rows = json.load(open(tmp_path / "fake-gpu.json"))["rows"]
    assert [r["skipped"] for r in rows] == ["time budget", "time budget"]


def test_bench_run_budget_counts_from_the_first_case(fakes, tmp_path):
    """--budget-s counts from the first case: slow ceilings (as a GPU's copy and matmul measurement, ~10 s) do not
    eat a small budget before any case has run."""
    import time as _time

    class SlowCeilings(_FakeDevice):
        def ceilings(self):
            _time.sleep(0.5)
            return 100.0, 1.0

    cases = [_case("conv", 1, 30)]
    args = _args(["--out", str(tmp_path), "--no-plot", "--budget-s", "0.3"])
    assert B._run(args, cases, [], torch.device("cpu"), device_cls=SlowCeilings) == 0
    rows = json.load(open(tmp_path / "fake-gpu.json"))["rows"]
    assert rows[0].get("skipped") is None and rows[0]["gdn_ms"] > 0


# ----------------------------------------------------------------------------------------------------------------------
# the GPU session script (its stage machinery, on CPU)
# ----------------------------------------------------------------------------------------------------------------------
def _session_module():
    spec = importlib.util.spec_from_file_location("gpu_session", os.path.join(REPO, "bench", "gpu_session.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_session_runs_a_sweep_command_and_summarizes(tmp_path, capsys):
    gs = _session_module()
    sweep = json.dumps({"variants": [{"name": "v1", "env": {"GDN_X": "7"},
                                      "cmd": [sys.executable, "-c", "import os, sys; print('X', os.environ['GDN_X'], "
                                                                    "os.environ['OUT'], sys.argv[1])", "{out}/f"]},
                                     {"name": "fails", "cmd": [sys.executable, "-c", "raise SystemExit(4)"]}]})
    rc = gs.main(["--out", str(tmp_path), "--stages", "sweep", "--sweep", sweep, "--budget-s", "60"])
    out = capsys.readouterr().out
    assert rc == 1   # one variant failed
    vdir = str(tmp_path / "sweep" / "v1")
    assert f"X 7 {vdir} {vdir}/f" in open(tmp_path / "sweep" / "v1" / "log.txt").read()
    assert "session summary" in out and "1/2 ok" in out and "fails: exit 4" in out
    assert (tmp_path / "summary.txt").exists() and json.load(open(tmp_path / "summary.json"))["stages"]


def test_gpu_session_tabulates_profile_variants(tmp_path, capsys):
    """Sweep variants that run ``gdn profile --out {out}/profile.json`` appear in the summary: gdn's device time and
    kernel sum per shape, one column per variant (a peer's rows and a variant without the file left out)."""
    gs = _session_module()

    def writer(dev, tot):
        rows = [dict(peer="gdn", shape="1x8192:16/32", mode="fwd varlen", total_us=tot, device_us=dev, kernels=[]),
                dict(peer="fla", shape="1x8192:16/32", mode="fwd varlen", total_us=1.0, device_us=1.0, kernels=[])]
        return [sys.executable, "-c", f"import json, sys; json.dump({rows!r}, open(sys.argv[1], 'w'))",
                "{out}/profile.json"]

    sweep = json.dumps({"variants": [{"name": "a", "cmd": writer(258.6, 314.2)},
                                     {"name": "b", "cmd": writer(240.8, 239.2)},
                                     {"name": "none", "cmd": [sys.executable, "-c", "pass"]}]})
    assert gs.main(["--out", str(tmp_path), "--stages", "sweep", "--sweep", sweep, "--budget-s", "60"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("1x8192:16/32 fwd varlen"))
    assert line.split()[-2:] == ["258.6/314.2", "240.8/239.2"], line
    assert "gdn profile, device us per call / kernel sum us" in out and "1.0/1.0" not in out


def test_gpu_session_resumes_a_bench_that_lost_its_cuda_context(tmp_path, monkeypatch, capsys):
    gs = _session_module()
    log = tmp_path / "argv.txt"
    script = ("import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + '\\n'); "
              "sys.exit(0 if '--resume' in sys.argv else 3)")
    monkeypatch.setattr(gs, "_bench_cmd", lambda out, extra, budget: [sys.executable, "-c", script, str(log)] + extra)
    rc = gs.main(["--out", str(tmp_path), "--stages", "bench", "--budget-s", "200",
                  "--bench-args=--ops decode --resume-from old.json"])
    calls = log.read_text().splitlines()
    assert rc == 0 and calls == ["--ops decode --resume-from old.json", "--ops decode --resume"]
    assert "bench   ok" in capsys.readouterr().out


def test_profile_host_times_rows(monkeypatch):
    """``gdn profile --host`` (CUDA calls stood in for on CPU; the op runs on the interpreter): one row per shape and
    mode with positive host and wall times, written to --out; forward + backward takes longer than the forward; the
    host plans the calls made (the forward's, and the backward's too) and none given up, then with a recording that
    fails (an operator the recorder does not follow) that function named with what stopped it."""
    import json
    import tempfile

    import gdn.benchmark.profile as P
    from gdn.kernels import host_plan

    made = P._inputs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda n: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(P, "_inputs", lambda N, T, H, HV, device: made(N, T, H, HV, "cpu", K=32, V=32))
    monkeypatch.setattr(host_plan, "PLAN_CPU", True)
    monkeypatch.setattr(host_plan, "ENABLED", True)
    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/host.json"
        rows = P.host_times("2x33:1/2", iters=1, forward_only=True, out=out, print_fn=lambda *a: None)
        rows += P.host_times("2x33:1/2", iters=1, forward_only=False, print_fn=lambda *a: None)
        assert json.load(open(out)) == rows[:1]
    assert [(r["shape"], r["mode"]) for r in rows] == [("2x33:1/2", "fwd"), ("2x33:1/2", "fwd+bwd")]
    assert all(r["host_ms"] > 0 and r["wall_ms"] > 0 for r in rows)
    assert rows[1]["wall_ms"] > rows[0]["wall_ms"]
    assert rows[0]["planned"] >= 1 and rows[1]["planned"] > rows[0]["planned"]
    assert rows[0]["unplanned"] == {} and rows[1]["unplanned"] == {}
    from gdn.kernels.chunk import forward
    real_prepare = forward.chunk_fwd_prepare

    def prepare_after_a_computation(*args, **kwargs):
        torch.zeros(1).add_(1.0)        # an operator the recorder does not replay
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(forward, "chunk_fwd_prepare", prepare_after_a_computation)
    row, = P.host_times("2x33:1/2", iters=1, forward_only=True, print_fn=lambda *a: None)
    assert row["planned"] == 0 and any("add" in why for why in row["unplanned"].values()), row


def test_profile_varlen_packs_the_sequences(monkeypatch):
    """``gdn profile --varlen``: the op is called on one packed row with cu_seqlens (and its host copy) over the
    N sequences, the same tokens as the batched call's rows; the rows' mode says so; the batched call passes none."""
    import gdn.ops
    import gdn.benchmark.profile as P

    made = P._inputs
    calls = []
    real = gdn.ops.chunk_gated_delta_rule

    def op(q, k, v, g, beta, **kw):
        calls.append((q.detach().clone(), kw.get("cu_seqlens"), kw.get("cu_seqlens_cpu")))
        return real(q, k, v, g, beta, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gdn.ops, "chunk_gated_delta_rule", op)
    monkeypatch.setattr(P, "_inputs", lambda N, T, H, HV, device: made(N, T, H, HV, "cpu", K=32, V=32))
    monkeypatch.setattr(P, "kernel_times", lambda fn, iters: (fn(), [("k", 2.0, 1.0)])[1])
    monkeypatch.setattr(P, "_device_ms", lambda step: 0.003)
    rows = P.run("3x20:1/2", iters=1, forward_only=True, print_fn=lambda *a: None, varlen=True)
    rows += P.run("3x20:1/2", iters=1, forward_only=True, print_fn=lambda *a: None)
    assert [(r["shape"], r["mode"], r["total_us"], r["device_us"]) for r in rows] == [
        ("3x20:1/2", "fwd varlen", 2.0, 3.0), ("3x20:1/2", "fwd", 2.0, 3.0)]
    (qp, cu, cu_cpu), (qb, cu_b, cu_cpu_b) = calls
    assert qp.shape == (1, 60, 1, 32) and qb.shape == (3, 20, 1, 32)
    assert cu.tolist() == cu_cpu.tolist() == [0, 20, 40, 60] and cu_b is None and cu_cpu_b is None
    assert torch.equal(qp[0], qb.reshape(60, 1, 32))


def test_profile_flashinfer_runs_the_same_problem(monkeypatch):
    """``gdn profile --flashinfer``: FlashInfer's prefill (here a float64 stand-in on its conventions: packed rows,
    linear decay, k-last states, cu_seqlens always) is profiled on the same problem as gdn, batched and varlen alike:
    its output and final state equal gdn's; without --forward it is not profiled (no backward)."""
    import gdn.ops
    import gdn.benchmark.profile as P
    from gdn.benchmark import peers as PE

    made = P._inputs
    outs = {}
    real = gdn.ops.chunk_gated_delta_rule

    def gdn_op(*a, **kw):
        outs.setdefault("gdn", []).append(real(*a, **kw))
        return outs["gdn"][-1]

    call = PE.flashinfer_prefill_call

    def fi_call(*a, **kw):
        outs.setdefault("flashinfer", []).append(call(*a, **kw))
        return outs["flashinfer"][-1]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gdn.ops, "chunk_gated_delta_rule", gdn_op)
    monkeypatch.setattr(PE, "flashinfer_prefill", lambda: fake_fi_prefill)
    monkeypatch.setattr(PE, "flashinfer_prefill_call", fi_call)
    monkeypatch.setattr(P, "_inputs", lambda N, T, H, HV, device: made(N, T, H, HV, "cpu", K=32, V=32))
    monkeypatch.setattr(P, "kernel_times", lambda fn, iters: (fn(), [("k", 2.0, 1.0)])[1])
    monkeypatch.setattr(P, "_device_ms", lambda step: 0.003)
    for varlen in (False, True):
        outs.clear()
        rows = P.run("2x40:1/2", iters=1, forward_only=True, print_fn=lambda *a: None, varlen=varlen,
                     flashinfer=True)
        assert [r["peer"] for r in rows] == ["gdn", "flashinfer"]
        (og, hg), = outs["gdn"]
        (of, hf), = outs["flashinfer"]
        assert of.shape == og.shape and hf.shape == hg.shape == (2, 2, 32, 32)
        assert rel_err(of.float(), og.float()) < 2e-2 and rel_err(hf.float(), hg.float()) < 2e-2
    outs.clear()
    rows = P.run("2x40:1/2", iters=1, forward_only=False, print_fn=lambda *a: None, flashinfer=True)
    assert [r["peer"] for r in rows] == ["gdn"] and "flashinfer" not in outs


def test_chunk_reference_is_built_before_the_implementations_run(fakes, monkeypatch):
    """The chunk rows' float64 reference exists before the first implementation's calls, so that no implementation's
    ``<impl>_held_MB`` counts it (built lazily by the first check it was all of gdn's "held" on the H200)."""
    import gdn.reference

    made = []
    real_ref = gdn.reference.chunk_gated_delta_rule_ref
    monkeypatch.setattr(gdn.reference, "chunk_gated_delta_rule_ref",
                        lambda *a, **kw: made.append(1) or real_ref(*a, **kw))
    real_measure = runners.measure
    seen = []

    def measure(row, impls, n_sets, ctx):
        seen.append(len(made))
        return real_measure(row, impls, n_sets, ctx)

    monkeypatch.setattr(runners, "measure", measure)
    row = runners.run_case(_case("chunk_fwd", 2, 40, "fp32"), _ctx())
    assert seen == [1] and len(made) == 1
    _check_row(row, ["gdn", "fla", "flashinfer"])


def test_held_scratch_shows_a_peers_process_wide_workspace(monkeypatch):
    """A peer that keeps a workspace in a process-wide cache between calls (FlashInfer's context-parallel GDN
    prefill: ``flashinfer.utils._cache_buf``) shows it as ``<impl>_held_MB``: the cache (here holding a larger,
    earlier row's buffer) is dropped before the row's first call, the row's calls allocate their own again, and the
    per-call peak, measured after them, sees only the transient scratch; an implementation that holds nothing shows
    0. Device memory is simulated (a CPU machine)."""
    import sys
    import types

    from gdn.benchmark import runners
    from gdn.benchmark.timing import HostTimer

    MB = 2 ** 20
    fu = types.ModuleType("flashinfer.utils")
    fu._cache_buf, fu._cache_buf_retired = {"earlier row": 100 * MB}, [object()]
    pkg = types.ModuleType("flashinfer")
    pkg.utils = fu
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.utils", fu)
    mem = {"live": 7 * MB, "peak": 0}

    def allocated(*a):
        return mem["live"] + sum(fu._cache_buf.values())

    def scratch(nbytes):
        mem["peak"] = max(mem["peak"], allocated() + nbytes)

    def reset_peak(*a):
        mem["peak"] = allocated()

    def fi_run(i):
        fu._cache_buf.setdefault("gdn_cp_workspace", 24 * MB)   # kept between calls
        scratch(4 * MB)                                          # freed by the call

    for name, fn in (("synchronize", lambda *a: None), ("memory_allocated", allocated),
                     ("reset_peak_memory_stats", reset_peak), ("max_memory_allocated", lambda *a: mem["peak"]),
                     ("empty_cache", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(runners, "DEVICE_TIME_OPS", ())
    ctx = runners.Ctx(torch.device("cuda"), HostTimer(target_s=0.0, min_samples=1, max_samples=1))
    row = {"op": "chunk_fwd", "errors": {}, "notes": [], "timing": {}, "err_detail": {}}
    impls = [runners.Impl("gdn", run=lambda i: scratch(6 * MB)), runners.Impl("flashinfer", run=fi_run)]
    runners.measure(row, impls, 1, ctx)
    assert row["gdn_peak_MB"] == 6 and row["gdn_held_MB"] == 0
    assert row["flashinfer_peak_MB"] == 4 and row["flashinfer_held_MB"] == 24
    assert fu._cache_buf_retired == [] and "earlier row" not in fu._cache_buf


def test_gpu_session_carries_a_triton_cache(tmp_path, monkeypatch):
    """--triton-cache: the stages run with TRITON_CACHE_DIR set to a folder restored from the given .tgz, and the
    folder's loadable files (metadata, cubin, launcher .so; not the IR) come back as $OUT/triton-cache.tgz."""
    import tarfile

    gs = _session_module()
    src = tmp_path / "cache"
    (src / "abc").mkdir(parents=True)
    for name in ("k.json", "__grp__k.json", "k.cubin", "k.ptx", "k.ttgir", "k.llir", "k.source"):
        (src / "abc" / name).write_text(name)
    (src / "launcher").mkdir()
    (src / "launcher" / "cuda_utils.so").write_text("so")
    first = tmp_path / "first.tgz"
    assert gs.save_triton_cache(str(src), str(first)) == 4
    with tarfile.open(first) as t:
        assert sorted(t.getnames()) == ["abc/__grp__k.json", "abc/k.cubin", "abc/k.json", "launcher/cuda_utils.so"]
    out = tmp_path / "out"
    monkeypatch.setattr(gs.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    # a sweep stage that sees the restored files through TRITON_CACHE_DIR and adds one kernel of its own
    code = ("import os; d = os.environ['TRITON_CACHE_DIR']; print(sorted(os.listdir(os.path.join(d, 'abc')))); "
            "os.makedirs(os.path.join(d, 'new'), exist_ok=True); "
            "open(os.path.join(d, 'new', 'n.cubin'), 'w').write('c')")
    sweep = json.dumps({"variants": [{"name": "v", "cmd": [sys.executable, "-c", code]}]})
    rc = gs.main(["--out", str(out), "--stages", "sweep", "--sweep", sweep, "--budget-s", "60",
                  "--triton-cache", str(first)])
    assert rc == 0
    assert "['__grp__k.json', 'k.cubin', 'k.json']" in open(out / "sweep" / "v" / "log.txt").read()
    with tarfile.open(out / "triton-cache.tgz") as t:
        assert "new/n.cubin" in t.getnames() and "abc/k.cubin" in t.getnames()
    assert gs.restore_triton_cache(str(tmp_path / "missing.tgz"), str(tmp_path / "x")) == 0


def test_triton_cache_in_parts(tmp_path):
    """A cache larger than a part goes on in x.1.tgz, x.2.tgz, ...; restoring x.tgz brings back every file of every
    part; a later, smaller save removes the parts it no longer needs."""
    import random

    gs = _session_module()
    src = tmp_path / "cache"
    rnd = random.Random(0)
    for i in range(6):   # incompressible 40 KB cubins, a part every ~50 KB
        (src / f"k{i}").mkdir(parents=True)
        (src / f"k{i}" / "k.cubin").write_bytes(bytes(rnd.getrandbits(8) for _ in range(40000)))
        (src / f"k{i}" / "k.json").write_text("{}")
    tgz = tmp_path / "c.tgz"
    assert gs.save_triton_cache(str(src), str(tgz), part_bytes=50000) == 12
    parts = sorted(p.name for p in tmp_path.glob("c*.tgz"))
    assert len(parts) >= 3 and "c.1.tgz" in parts and "c.2.tgz" in parts
    out = tmp_path / "restored"
    assert gs.restore_triton_cache(str(tgz), str(out)) == 12
    assert (out / "k5" / "k.cubin").read_bytes() == (src / "k5" / "k.cubin").read_bytes()
    for i in range(1, 6):   # smaller now: one part, the old ones removed
        (src / f"k{i}" / "k.cubin").unlink()
    assert gs.save_triton_cache(str(src), str(tgz), part_bytes=50000) == 7
    assert sorted(p.name for p in tmp_path.glob("c*.tgz")) == ["c.tgz"]


def test_profile_idle_gaps_between_kernels():
    """gdn profile --layer-train's gap count: idle time between consecutive kernel records (overlapping kernels on
    two streams are not gaps), the largest first with the kernels around them."""
    import types

    from gdn.benchmark.profile import _idle_gaps

    cuda = torch.autograd.DeviceType.CUDA

    def ev(s, e, n, dt=cuda):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=s, end=e), name=n, device_type=dt)

    prof = types.SimpleNamespace(events=lambda: [ev(30, 40, "c"), ev(0, 10, "a"), ev(5, 20, "b"), ev(41, 50, "d"),
                                                 ev(100, 200, "host", torch.autograd.DeviceType.CPU)])
    idle, gaps = _idle_gaps(prof)
    assert idle == 11 and [(g, a, b) for g, a, b in gaps] == [(10, "b", "c"), (1, "c", "d")]


def test_device_time_reports_the_hosts_enqueue_time(monkeypatch):
    """``CudaTimer.device_time`` also gives the host's time to enqueue one call with the GPU idle (``host_ms``, per
    call: a pass over the buffer sets divided by their number), which the bench rows carry as ``<impl>_host_ms``.
    The CUDA parts are stood in for here; a call that takes 3 ms of host time must read as at least that."""
    import time

    from gdn.benchmark.timing import CudaTimer

    t = CudaTimer.__new__(CudaTimer)
    t.target_ms, t.min_samples, t.max_samples, t._sleep_cycles_per_ms = 10.0, 5, 5, None
    monkeypatch.setattr(t, "_sync", lambda: None)
    monkeypatch.setattr(t, "_event_ms", lambda launch: 1.0)
    monkeypatch.setattr(t, "_cycles_per_ms", lambda: 1.0)
    monkeypatch.setattr(t, "_samples", lambda launch, n, before=None: [2.0] * n)
    calls = []

    def fn(i):
        calls.append(i)
        time.sleep(0.003)

    d = t._device_once(fn, 2)
    assert d.mode == "device" and d.median_ms == pytest.approx(1.0)     # 2 ms per sample over 2 calls
    assert 3.0 <= d.host_ms < 30.0 and set(calls) == {0, 1}
