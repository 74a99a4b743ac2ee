"""Command line: ``gdn check`` (verify every op on this device) and ``gdn bench`` (time against fla/FlashInfer)."""
from __future__ import annotations

import argparse
import os
import sys


def _prepare_device(name: str | None) -> str:
    """Pick the device; without CUDA, run the Triton kernels through the interpreter (set before any kernel import)."""
    import torch

    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return name


def _cmd_check(args) -> int:
    device = _prepare_device(args.device)
    import torch

    from gdn.backend import backend_name, use_triton
    from gdn.checks import run_all
    from gdn.kernels import launch

    launch.VERIFY = True  # every fast launch also asks Triton which kernel it would run (gdn.kernels.launch)

    dev = torch.device(device)
    path = "triton" if use_triton(dev) else "torch reference"
    interp = " (Triton interpreter)" if dev.type == "cpu" and path == "triton" else ""
    print(f"gdn check on {device}{interp}: backend {backend_name()} -> {path}")
    only = set(args.ops.split(",")) if args.ops else None
    w_op, w_case = 14, 46
    print(f"{'op':<{w_op}}  {'case':<{w_case}}  {'rel_err':>10}  {'tol':>8}  result", flush=True)

    def show(rows):  # printed as each check finishes, so a slow or crashing op still leaves the rows before it
        for r in rows:
            status = "PASS" if r.passed else "FAIL"
            note = f"  {r.note}" if r.note else ""
            print(f"{r.op:<{w_op}}  {r.case:<{w_case}}  {r.rel_err:>10.2e}  {r.tol:>8.1e}  {status}{note}",
                  flush=True)

    names = [n for n in args.checks.split(",") if n] if args.checks else None
    results = run_all(dev, only=only, progress=show, names=names)
    failed = [r for r in results if not r.passed]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not results else 0


def _cmd_bench(args) -> int:
    from gdn.benchmark import main as bench_main

    return bench_main(args)


def _cmd_profile(args) -> int:
    from gdn.benchmark.profile import main as profile_main

    return profile_main(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gdn", description="Gated DeltaNet kernels")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="verify every op against the float64 reference on this device")
    c.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available, else cpu")
    c.add_argument("--ops", default=None, help="comma-separated subset of check modules")
    c.add_argument("--checks", default=None,
                   help="comma-separated: only the check functions whose name contains one of these (e.g. "
                        "reverse_sm90,target_shapes; a cold GPU compiles only what they launch)")
    c.set_defaults(fn=_cmd_check)
    b = sub.add_parser("bench", help="time the ops (and fla / FlashInfer when importable)")
    try:
        from gdn.benchmark import add_arguments
    except ImportError:  # benchmark module not built yet
        add_arguments = None
    if add_arguments is not None:
        add_arguments(b)
    b.set_defaults(fn=_cmd_bench)
    from gdn.benchmark.profile import add_arguments as profile_arguments

    pr = sub.add_parser("profile", help="per-kernel CUDA times of the chunked op (forward, or forward + backward)")
    profile_arguments(pr)
    pr.set_defaults(fn=_cmd_profile)
    args = p.parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
