"""``gdn bench``: the performance record of gdn's ops side by side with fla and FlashInfer on the current GPU.

    gdn bench [--quick] [--ops decode,recurrent,chunk_fwd,chunk_fwd_bwd,conv,layer,layer_decode] [--out DIR]
              [--no-peers] [--device cuda] [--budget-s S] [--resume | --resume-from JSON] [--match TEXT]
              [--tag NAME]
    gdn bench --floors [--copy-gbps 4270 --tflops 790]     # the two floors of every case; no GPU needed
    gdn bench --list                                       # the cases

First the device's two ceilings are measured (device-to-device copy bandwidth counting bytes read plus written; a bf16
8192^3 matrix product on random data), then every case is checked against the float64 reference and timed, for gdn
and for each importable peer. Writes ``<out>/<gpu-name>.json`` (``-quick`` appended for ``--quick``, ``-<tag>`` for
``--tag``) after every case, then the PNG beside it, and prints a table. Exit status: 0 done; 2 nothing to time (no
CUDA device, bad arguments); 3 the CUDA context was lost mid-run (the JSON holds the rows up to there; rerun with
``--resume`` to measure the rest). ``--resume-from JSON`` continues a record made in an earlier session (rows whose
case was measured, even with errors, are kept; skipped ones are measured).
"""
from __future__ import annotations

import datetime as _dt
import os
import sys
import time

from .cases import OPS, floors_table, full_cases, quick_cases, select

DEFAULT_PEERS = "fla,flashinfer"


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="a small set of cases with short timings (about a minute)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="folder for the JSON and PNG")
    p.add_argument("--no-peers", action="store_true", help="time gdn only")
    p.add_argument("--peers", default=DEFAULT_PEERS, help="peers to time when importable (default: %(default)s)")
    p.add_argument("--device", default="cuda", help="CUDA device (default: %(default)s)")
    p.add_argument("--match", default=None,
                   help="only cases whose key or label contains this text (several: comma-separated, any of them)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new case this many seconds after the first one started (the rest are "
                        "recorded as skipped; the ceilings and peer imports before it do not count)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already in the output JSON and measure only the missing cases")
    p.add_argument("--resume-from", default=None, metavar="JSON",
                   help="like --resume, taking the rows from this JSON (e.g. a previous session's record)")
    p.add_argument("--tag", default=None, help="suffix of the output file names (e.g. a tuning variant)")
    p.add_argument("--check-tokens", type=int, default=2048,
                   help="tokens of the prefix checked against the float64 reference (chunk, conv)")
    p.add_argument("--target-s", type=float, default=None,
                   help="device time of samples per measurement (default 0.2, --quick 0.1)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--floors", action="store_true",
                   help="print both floors of every selected case at --copy-gbps/--tflops and exit (no GPU needed)")
    p.add_argument("--copy-gbps", type=float, default=4270.0, help="copy bandwidth for --floors (H200: 4270)")
    p.add_argument("--tflops", type=float, default=790.0, help="bf16 matrix rate for --floors (H200: ~790)")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")


def _parse_list(text: str, allowed, what: str):
    items = [x.strip() for x in (text or "").split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise ValueError(f"{what}: unknown {', '.join(bad)}; expected a comma-separated subset of {','.join(allowed)}")
    return items


def _versions():
    import torch

    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    try:
        import gdn

        gv = getattr(gdn, "__version__", None)
    except Exception:
        gv = None
    return torch.__version__, tv, gv


def main(args) -> int:
    from .peers import PEERS

    try:
        ops = _parse_list(args.ops, OPS, "--ops")
        wanted_peers = [] if args.no_peers else _parse_list(args.peers, PEERS, "--peers")
    except ValueError as e:
        print(f"gdn bench: {e}", file=sys.stderr)
        return 2
    cases = select(quick_cases() if args.quick else full_cases(), ops, args.match)
    if args.list:
        for c in cases:
            print(c.key)
        return 0
    if args.floors:
        print(floors_table(cases, args.copy_gbps, args.tflops))
        return 0
    if not cases:
        print("gdn bench: no case selected (check --ops / --match)", file=sys.stderr)
        return 2

    import torch

    dev = torch.device(args.device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        why = "torch.cuda.is_available() is False" if dev.type == "cuda" else f"--device {args.device} is not CUDA"
        print(f"gdn bench: no CUDA device ({why}); nothing to time. The benchmark needs a GPU; "
              "`gdn check` verifies the ops on CPU, `gdn bench --floors` prints the model floors.", file=sys.stderr)
        return 2
    return _run(args, cases, wanted_peers, dev)


class _Device:
    """What the run needs from the device: its name and properties, the two ceilings and a timer."""

    def __init__(self, dev, quick: bool, target_s: float):
        import torch

        from .timing import CudaTimer, l2_bytes

        if dev.index is not None:
            torch.cuda.set_device(dev)
        self.dev = dev
        self.name = torch.cuda.get_device_name(dev)
        props = torch.cuda.get_device_properties(dev)
        self.l2_bytes = l2_bytes(dev)
        self.info = {"cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability(dev)),
                     "sm_count": props.multi_processor_count, "L2_MB": self.l2_bytes / 2 ** 20}
        self.quick = quick
        self.timer = CudaTimer(dev, target_s=target_s)

    def ceilings(self):
        from .timing import measure_copy_GBps, measure_matmul_TFLOPs

        return (measure_copy_GBps(self.dev, nbytes=(1 << 28) if self.quick else (1 << 30)),
                measure_matmul_TFLOPs(self.dev))


def _run(args, cases, wanted_peers, dev, device_cls=_Device) -> int:
    from . import report
    from .peers import detect
    from .plot import write_plot
    from .progress import Progress
    from .runners import ContextLost, Ctx, new_row, run_case

    t_start = time.time()
    quick = bool(args.quick)
    target = args.target_s if args.target_s else (0.1 if quick else 0.2)
    d = device_cls(dev, quick, target)
    name = d.name
    stem = report.result_stem(name) + ("-quick" if quick else "") + (f"-{args.tag}" if args.tag else "")
    json_path = os.path.join(args.out, stem + ".json")
    png_path = os.path.join(args.out, stem + ".png")
    prev = None
    if args.resume_from:
        prev = report.load_json(args.resume_from)
        if prev is None:
            print(f"gdn bench: --resume-from {args.resume_from}: not a readable JSON record; measuring everything",
                  file=sys.stderr)
    elif args.resume:
        prev = report.load_json(json_path)
    done = {r["key"]: r for r in (prev or {}).get("rows", []) if r.get("key") and not r.get("skipped")}

    tv, trv, gv = _versions()
    header = {
        "device": name, "copy_GBps": None, "bf16_TFLOPs": None, "torch": tv, "triton": trv, "gdn": gv, **d.info,
        "quick": quick, "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:], "peers": {},
        "method": ("median per call of CUDA-event samples after an untimed warm-up (taken again, up to twice, "
                   "while (p80 - p20) / median > 0.10; the least noisy kept); decode, recurrent and "
                   "layer_decode replay a CUDA graph of n_sets x reps calls; the other ops run eagerly; inputs rotate "
                   "over n_sets buffer sets that together touch at least twice the L2 cache; FLOP counts: "
                   "gdn.benchmark.cases"),
    }
    if prev and prev.get("copy_GBps") and prev.get("bf16_TFLOPs"):
        header["copy_GBps"], header["bf16_TFLOPs"] = prev["copy_GBps"], prev["bf16_TFLOPs"]
    else:
        print(f"gdn bench on {name}: measuring the copy bandwidth and the bf16 matrix rate", file=sys.stderr)
        try:
            header["copy_GBps"], header["bf16_TFLOPs"] = d.ceilings()
        except Exception as e:  # no fractions then, but the times still count
            header["ceilings_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"ceilings not measured: {header['ceilings_error']}", file=sys.stderr)
    copy_GBps, tflops = header["copy_GBps"], header["bf16_TFLOPs"]
    if copy_GBps and tflops:
        print(f"copy {copy_GBps:.0f} GB/s, bf16 {tflops:.0f} TFLOP/s", file=sys.stderr)

    infos = detect(wanted_peers)
    header["peers"] = {k: v.to_dict() for k, v in infos.items()}
    for k, v in infos.items():
        print(f"peer {k}: " + (f"{v.version}" if v.available else f"unavailable ({v.error})"), file=sys.stderr)
    ctx = Ctx(dev, d.timer, d.l2_bytes, frozenset(k for k, v in infos.items() if v.available),
              check_tokens=args.check_tokens)

    rows, lost, status = [], None, 0
    selected = {c.key for c in cases}
    # rows of the resumed record outside this selection stay in the record (e.g. --ops chunk_fwd after a decode run)
    kept = [r for k, r in done.items() if k not in selected]
    prog = Progress(len(cases))
    t_cases = time.time()   # the budget counts from here: the ceilings and peer imports above took their own time
    for c in cases:
        if c.key in done:
            rows.append(done[c.key])
        elif lost:
            rows.append(report.finalize_row(report.skipped_row(c, f"CUDA context lost ({lost})"), copy_GBps, tflops))
        elif args.budget_s is not None and time.time() - t_cases > args.budget_s:
            rows.append(report.finalize_row(report.skipped_row(c, "time budget"), copy_GBps, tflops))
        else:
            try:
                row = run_case(c, ctx)
            except ContextLost as e:
                row = e.row or new_row(c)
                row["errors"]["context"] = f"CUDA context lost: {e}"
                lost, status = str(e)[:200], 3
            rows.append(report.finalize_row(row, copy_GBps, tflops))
            header["elapsed_s"] = round(time.time() - t_start, 1)
            # resumed rows of cases not reached yet stay in the file too (a run cut off keeps the whole record)
            written = {r["key"] for r in rows}
            report.write_json(json_path, header, rows + [r for k, r in done.items() if k not in written])
        prog.update(c.label())
    prog.close()
    header["elapsed_s"] = round(time.time() - t_start, 1)
    rows = rows + kept
    report.write_json(json_path, header, rows)
    print(report.format_table(rows))
    print()
    for line in report.summary_lines(rows):
        print(line)
    plot = None
    if not args.no_plot:
        try:
            plot = write_plot(rows, png_path, title=f"gdn bench on {name} ({header['started']})")
        except Exception as e:  # a plot must never cost the record
            print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"wrote {json_path}" + (f" and {plot}" if plot else " (no plot: matplotlib missing or no times)"))
    if lost:
        print(f"CUDA context lost: {lost}; rerun with --resume to measure the remaining cases", file=sys.stderr)
    return status


__all__ = ["add_arguments", "main"]
