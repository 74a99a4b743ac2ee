#!/usr/bin/env python3
"""One GPU session in one call: check, GPU tests, benchmark, tuning sweeps; everything under $OUT; a summary last.

Run from the repository root on the GPU machine (gdn need not be installed: ``src/`` is put on PYTHONPATH)::

    source /root/peers/env.sh            # after the peers were installed (see /work/shared/peers/prepare.sh)
    python3 bench/gpu_session.py         # --budget-s 540 by default

Stages, in order (``--stages`` picks a subset):

    env     GPU name, clocks and versions                                    -> $OUT/env.txt
    check   ``gdn check --device cuda`` (every registered check)             -> $OUT/check.log
    tests   ``pytest -m gpu`` on the test files that carry the gpu marker     -> $OUT/tests.log
    bench   ``gdn bench`` (full set; ``--quick`` for the small one)          -> $OUT/bench.log, $OUT/bench/*.json|png
    sweep   tuning variants (below)                                          -> $OUT/sweep/...

Every stage runs in its own process with a timeout cut from the remaining wall-clock budget; a stage that fails or
times out is logged and the session goes on; once the budget is spent the remaining stages are skipped. The benchmark
writes its JSON after every case, so a timed-out benchmark still leaves its rows; a benchmark that lost its CUDA
context (exit status 3) is restarted with ``--resume`` while time remains.

Sweeps: a JSON file given by ``--sweep FILE``, or by the environment variable ``GDN_SWEEP`` (a path, or the JSON
itself), or ``bench/sweeps.json`` when present::

    {"bench": ["--ops", "chunk_fwd", "--quick", "--no-peers"],          # default gdn-bench arguments of variants
     "variants": [
        {"name": "fwd-stages3", "env": {"GDN_TUNE": "chunk_fwd.state_stages=3"}},   # gdn bench under GDN_TUNE
        {"name": "rec-bv32-w4", "env": {"GDN_TUNE": "recurrent.BV=32,recurrent.warps=4,recurrent.stages=1"},
         "bench": ["--ops", "recurrent", "--quick"]},
        {"name": "prof", "cmd": ["python3", "-m", "gdn.cli", "profile", "--out", "{out}/profile.json"],
         "timeout_s": 120}                     # any command, run from the repo root; {out} and $OUT: its own folder
     ]}

Triton cache between calls (``--triton-cache FILE``): every call of the device tool starts a fresh machine, whose
cold compiles took a third of a session's device time. With the option the stages compile into one cache folder
(``TRITON_CACHE_DIR``), restored first from FILE when it exists (a .tgz carried with the call), and written back after
every stage to ``$OUT/triton-cache.tgz`` with only what Triton loads a kernel from (metadata .json, the .cubin, the
compiled launchers .so; ~6 MB for gdn's check + profile set, 15 MB with the whole check; past 12 MB it goes on in
``triton-cache.1.tgz``, ...: the device tool returns files of at most 16 MiB, 8 in all). Copy those files beside
FILE (same names) before the next call::

    python3 bench/gpu_session.py --triton-cache .scratch/triton-cache.tgz ...   # carry .scratch

Each bench variant writes ``$OUT/sweep/<gpu>[-quick]-<name>.json``; the summary compares gdn's time per case across
the main run and the variants. To continue a benchmark record from an earlier session, carry its JSON in the tree and
pass ``--bench-args="--resume-from bench/results/<gpu>.json"``. Tunables are the fields of the tuning tables
(``gdn.kernels.tuning``), overridden through ``GDN_TUNE`` (``gdn.config``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "src")
STAGES = ("env", "check", "tests", "bench", "sweep")
SUMMARY_CHARS = 11000   # the device tool returns the last 12,000 characters of the output


class Session:
    def __init__(self, out: str, budget_s: float, reserve_s: float = 12.0):
        self.out = out
        self.t0 = time.time()
        self.budget_s = budget_s
        self.reserve_s = reserve_s
        self.stages = []     # (name, status, seconds, detail)
        os.makedirs(out, exist_ok=True)
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = SRC + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self.env.setdefault("PYTHONUNBUFFERED", "1")

    def remaining(self) -> float:
        return self.budget_s - (time.time() - self.t0) - self.reserve_s

    def record(self, name, status, seconds, detail=""):
        self.stages.append((name, status, seconds, detail))
        print(f"[{time.time() - self.t0:6.0f}s] {name}: {status} ({seconds:.0f}s){' ' + detail if detail else ''}",
              flush=True)

    def run(self, name: str, cmd, log: str, timeout: float, env=None) -> tuple:
        """Run ``cmd`` with output to ``log``; returns (exit status or None on timeout/launch failure, seconds)."""
        t = time.time()
        timeout = max(1.0, timeout)
        shown = " ".join(cmd).replace("\n", " ")
        shown = shown if len(shown) <= 160 else shown[:157] + "..."
        print(f"[{t - self.t0:6.0f}s] {name}: {shown} (timeout {timeout:.0f}s, log {log})", flush=True)
        with open(log, "a") as f:
            f.write(f"$ {' '.join(shlex.quote(c) for c in cmd)}\n")
            f.flush()
            try:
                p = subprocess.Popen(cmd, cwd=REPO, env=env or self.env, stdout=f, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            except OSError as e:
                f.write(f"launch failed: {e}\n")
                return None, time.time() - t
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(p)
                f.write(f"\n*** killed after {timeout:.0f}s (session budget)\n")
                rc = None
        return rc, time.time() - t


def _kill_group(p):
    """End the stage's own process group (started with start_new_session), politely first."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [l.rstrip() for l in f if l.strip()]
        return " | ".join(lines[-n:])[-300:]
    except OSError:
        return ""


# ----------------------------------------------------------------------------------------------------------------------
# Triton cache carried between calls
# ----------------------------------------------------------------------------------------------------------------------
CACHE_KEEP = (".json", ".cubin", ".so")   # what Triton reads back for a cached kernel (the IR files are not needed)


def _cache_parts(tgz: str):
    """The files of a cache written as ``tgz`` in parts: ``x.tgz``, then ``x.1.tgz``, ``x.2.tgz``, ..."""
    stem = tgz[:-4] if tgz.endswith(".tgz") else tgz
    yield tgz
    k = 1
    while True:
        yield f"{stem}.{k}.tgz"
        k += 1


def restore_triton_cache(tgz: str, cache_dir: str) -> int:
    """Unpack a cache written by :func:`save_triton_cache` (every part) into ``cache_dir``; returns the number of
    files."""
    import tarfile

    os.makedirs(cache_dir, exist_ok=True)
    n = 0
    for part in _cache_parts(tgz):
        if not os.path.isfile(part):
            return n
        with tarfile.open(part, "r:gz") as t:
            members = [m for m in t.getmembers() if m.isfile() and not m.name.startswith("/") and ".." not in m.name]
            t.extractall(cache_dir, members=members)
        n += len(members)


def save_triton_cache(cache_dir: str, tgz: str, part_bytes: int = 12 << 20) -> int:
    """Write the loadable part of a Triton cache folder (``CACHE_KEEP`` suffixes) to ``tgz``, going on in
    ``<stem>.1.tgz``, ... once a part passes ``part_bytes`` compressed (the device tool returns files of at most
    16 MiB); returns the file count. A group file lists every stage's IR too; Triton skips the listed files that
    are missing."""
    import gzip
    import tarfile

    paths = sorted(os.path.join(root, f) for root, _, files in os.walk(cache_dir) for f in files
                   if f.endswith(CACHE_KEEP))
    parts = _cache_parts(tgz)
    part = None   # (final name, raw file, gzip stream, tar) of the part being written

    def open_part():
        name = next(parts)
        raw = open(name + ".part", "wb")
        gz = gzip.GzipFile(fileobj=raw, mode="wb")
        return name, raw, gz, tarfile.open(fileobj=gz, mode="w")

    def close_part(name, raw, gz, tar):
        tar.close()
        gz.close()
        raw.close()
        os.replace(name + ".part", name)

    for path in paths:
        if part is not None and part[1].tell() > part_bytes:
            close_part(*part)
            part = None
        if part is None:
            part = open_part()
        part[3].add(path, arcname=os.path.relpath(path, cache_dir))
    close_part(*(part or open_part()))   # an empty cache: one empty archive
    for stale in parts:   # parts of an earlier, larger save
        if not os.path.isfile(stale):
            break
        os.remove(stale)
    return len(paths)


# ----------------------------------------------------------------------------------------------------------------------
# stages
# ----------------------------------------------------------------------------------------------------------------------
def stage_env(s: Session, args):
    log = os.path.join(s.out, "env.txt")
    code = ("import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', "
            "torch.version.cuda, 'available', torch.cuda.is_available());\n"
            "import importlib\n"
            "for m in ('triton', 'fla', 'flashinfer', 'matplotlib', 'tqdm', 'numpy'):\n"
            "    try: print(m, getattr(importlib.import_module(m), '__version__', '?'))\n"
            "    except Exception as e: print(m, 'not importable:', type(e).__name__, str(e)[:200])\n"
            "if torch.cuda.is_available():\n"
            "    p = torch.cuda.get_device_properties(0); print('gpu', p.name, p.multi_processor_count, 'SMs', "
            "round(p.total_memory / 2**30), 'GiB', 'L2', getattr(p, 'L2_cache_size', 0) // 2**20, 'MB')\n")
    rc, sec = s.run("env", [sys.executable, "-c", code], log, min(60, s.remaining()))
    s.run("env", ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,"
                  "power.draw,power.limit,memory.used", "--format=csv"], log, min(15, s.remaining()))
    s.record("env", "ok" if rc == 0 else f"exit {rc}", sec, _tail(log, 2))


def stage_check(s: Session, args):
    log = os.path.join(s.out, "check.log")
    cmd = [sys.executable, "-m", "gdn.cli", "check", "--device", "cuda"] + shlex.split(args.check_args or "")
    rc, sec = s.run("check", cmd, log, min(args.check_s, s.remaining()))
    detail = ""
    try:
        text = open(log, errors="replace").read()
        m = re.findall(r"(\d+) passed, (\d+) failed", text)
        if m:
            detail = f"{m[-1][0]} passed, {m[-1][1]} failed"
        fails = [l.strip() for l in text.splitlines() if re.search(r"\bFAIL\b", l)]
        if fails:
            detail += "; failing: " + " || ".join(fails[:8])[:600]
    except OSError:
        pass
    s.record("check", "ok" if rc == 0 else ("timeout" if rc is None else f"exit {rc}"), sec, detail or _tail(log))


def _gpu_test_files() -> list:
    """Test files that carry the gpu marker (passed to pytest directly: collecting the whole suite costs time)."""
    hits = []
    for root, _, files in os.walk(os.path.join(REPO, "tests")):
        for fn in sorted(files):
            if fn.endswith(".py"):
                path = os.path.join(root, fn)
                try:
                    if re.search(r"mark\.gpu\b", open(path, errors="replace").read()):
                        hits.append(os.path.relpath(path, REPO))
                except OSError:
                    pass
    return sorted(hits)


def stage_tests(s: Session, args):
    files = _gpu_test_files()
    if not files:
        s.record("tests", "skipped", 0, "no test carries the gpu marker")
        return
    log = os.path.join(s.out, "tests.log")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"] + files
    rc, sec = s.run("tests", cmd, log, min(args.tests_s, s.remaining()))
    s.record("tests", "ok" if rc == 0 else ("timeout" if rc is None else f"exit {rc}"), sec, _tail(log, 1))


CEILINGS_S = 15.0   # gdn bench's copy / matmul measurement and peer imports, before its budget starts counting


def _bench_cmd(out_dir, extra, budget_s):
    cmd = [sys.executable, "-m", "gdn.cli", "bench", "--out", out_dir]
    if budget_s is not None:
        cmd += ["--budget-s", f"{max(1.0, budget_s - CEILINGS_S):.0f}"]
    return cmd + list(extra)


def _without_resume_from(argv: list) -> list:
    """A retry resumes from its own output, not from the record the first attempt started from."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--resume-from":
            skip = True
        elif not a.startswith("--resume-from="):
            out.append(a)
    return out


def _sweep_budget(s: Session, args, sweep) -> float:
    """Time kept back for the sweeps: --sweep-s, at most 40% of what remains."""
    if not sweep or "sweep" not in args.stages:
        return 0.0
    return min(float(args.sweep_s), 0.4 * max(0.0, s.remaining()))


def stage_bench(s: Session, args, sweep):
    out_dir = os.path.join(s.out, "bench")
    log = os.path.join(s.out, "bench.log")
    extra = (["--quick"] if args.quick else []) + shlex.split(args.bench_args or "")
    t_total, status, rc = 0.0, "", None
    for attempt in range(3):
        avail = s.remaining() - _sweep_budget(s, args, sweep)
        if avail < 20:
            status = status or "skipped (budget)"
            break
        # the benchmark stops starting cases at its own budget; the margin covers the case in flight and the plot
        margin = min(60.0, 0.25 * avail)
        cmd = _bench_cmd(out_dir, (_without_resume_from(extra) + ["--resume"]) if attempt else extra, avail - margin)
        rc, sec = s.run("bench", cmd, log, avail)
        t_total += sec
        status = "ok" if rc == 0 else ("timeout" if rc is None else f"exit {rc}")
        if rc != 3:   # 3: CUDA context lost mid-run: resume the remaining cases in a fresh process
            break
    s.record("bench", status, t_total, _tail(log, 1))


def load_sweep(args):
    src = args.sweep or os.environ.get("GDN_SWEEP")
    if not src and os.path.exists(os.path.join(REPO, "bench", "sweeps.json")):
        src = os.path.join(REPO, "bench", "sweeps.json")
    if not src:
        return None
    try:
        if src.lstrip().startswith("{"):
            cfg = json.loads(src)
        else:
            with open(src if os.path.isabs(src) else os.path.join(REPO, src)) as f:
                cfg = json.load(f)
    except (OSError, ValueError) as e:
        print(f"sweep: cannot read {src[:200]!r}: {e}", flush=True)
        return {"error": str(e), "variants": []}
    if isinstance(cfg, list):
        cfg = {"variants": cfg}
    return cfg


def stage_sweep(s: Session, args, sweep):
    if not sweep:
        s.record("sweep", "skipped", 0, "no sweep configured (--sweep, GDN_SWEEP, bench/sweeps.json)")
        return []
    if sweep.get("error"):
        s.record("sweep", "failed", 0, f"bad sweep config: {sweep['error']}")
        return []
    out_dir = os.path.join(s.out, "sweep")
    os.makedirs(out_dir, exist_ok=True)
    default_bench = list(sweep.get("bench") or ["--quick", "--no-peers"])
    done = []
    t_stage = time.time()
    for i, v in enumerate(sweep.get("variants", [])):
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(v.get("name") or f"v{i}"))
        left = s.remaining()
        if left < 15:
            done.append((name, "skipped (budget)", 0.0))
            continue
        env = dict(s.env)
        env.update({str(k): str(val) for k, val in (v.get("env") or {}).items()})
        vdir = os.path.join(out_dir, name)
        os.makedirs(vdir, exist_ok=True)
        log = os.path.join(vdir, "log.txt")
        timeout = min(float(v.get("timeout_s") or left), left)
        if v.get("cmd"):
            env["OUT"] = vdir
            cmd = [str(c).replace("{out}", vdir) for c in v["cmd"]]
        else:
            bench = list(v.get("bench") or default_bench)
            cmd = _bench_cmd(out_dir, bench + ["--tag", name, "--no-plot"], timeout - min(30.0, 0.3 * timeout))
        rc, sec = s.run(f"sweep {name}", cmd, log, timeout, env=env)
        done.append((name, "ok" if rc == 0 else ("timeout" if rc is None else f"exit {rc}"), sec))
    ok = sum(1 for _, st, _ in done if st == "ok")
    s.record("sweep", f"{ok}/{len(done)} ok", time.time() - t_stage,
             ", ".join(f"{n}: {st}" for n, st, _ in done)[:400])
    return done


# ----------------------------------------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------------------------------------
def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _main_json(out):
    d = os.path.join(out, "bench")
    if not os.path.isdir(d):
        return None, None
    files = sorted((os.path.getmtime(os.path.join(d, f)), f) for f in os.listdir(d) if f.endswith(".json"))
    if not files:
        return None, None
    path = os.path.join(d, files[-1][1])
    return path, _load(path)


def _fmt(x, spec):
    return "-" if not isinstance(x, (int, float)) or (isinstance(x, float) and not math.isfinite(x)) else \
        format(x, spec)


def sweep_table(out, main_doc, done) -> list:
    """gdn's time per case: the main run, then each bench variant (ms)."""
    names = [n for n, st, _ in done]
    docs = {}
    sdir = os.path.join(out, "sweep")
    for n in names:
        hits = [f for f in (os.listdir(sdir) if os.path.isdir(sdir) else []) if f.endswith(f"-{n}.json")]
        if hits:
            docs[n] = _load(os.path.join(sdir, hits[0]))
    docs = {k: v for k, v in docs.items() if v}
    if not docs:
        return []
    base = {r["key"]: r.get("gdn_ms") for r in (main_doc or {}).get("rows", []) if r.get("key")}
    keys = []
    for d in docs.values():
        for r in d.get("rows", []):
            if r.get("key") and r["key"] not in keys:
                keys.append(r["key"])
    cols = ["main"] + list(docs)
    lines = ["sweep: gdn ms per case (main run, then each variant)",
             "  " + "case".ljust(52) + "".join(c[:12].rjust(13) for c in cols)]
    for k in keys:
        vals = [base.get(k)] + [next((r.get("gdn_ms") for r in d.get("rows", []) if r.get("key") == k), None)
                                for d in docs.values()]
        short = k.replace("|K128|V128", "").replace("|H", " H").replace("|", " ")
        lines.append("  " + short[:52].ljust(52) + "".join(_fmt(v, ".5f").rjust(13) for v in vals))
    return lines


def profile_table(out, done) -> list:
    """The ``gdn profile`` variants' (``{out}/profile.json``) gdn rows: device time per call and the kernels' sum per
    shape (us), one column per variant."""
    docs = {}
    for n, _, _ in done:
        d = _load(os.path.join(out, "sweep", n, "profile.json"))
        if d:
            docs[n] = {(r.get("shape"), r.get("mode")): r for r in d if r.get("peer") == "gdn"}
    if not docs:
        return []
    keys = []
    for d in docs.values():
        keys += [k for k in d if k not in keys]
    lines = ["sweep: gdn profile, device us per call / kernel sum us (one column per variant)",
             "  " + "shape".ljust(26) + "".join(n[:16].rjust(17) for n in docs)]
    for k in keys:
        cells = []
        for d in docs.values():
            r = d.get(k)
            cells.append("-" if r is None else f"{_fmt(r.get('device_us'), '.1f')}/{_fmt(r.get('total_us'), '.1f')}")
        lines.append("  " + f"{k[0]} {k[1]}"[:26].ljust(26) + "".join(c.rjust(17) for c in cells))
    return lines


def bench_lines(doc) -> list:
    if not doc:
        return ["bench: no JSON written"]
    rows = doc.get("rows", [])
    head = (f"bench: {doc.get('device')}  copy {_fmt(doc.get('copy_GBps'), '.0f')} GB/s  "
            f"bf16 {_fmt(doc.get('bf16_TFLOPs'), '.0f')} TFLOP/s  torch {doc.get('torch')}  "
            f"triton {doc.get('triton')}  peers " + ", ".join(f"{k} {v.get('version') if v.get('available') else 'absent'}"
                                  for k, v in (doc.get("peers") or {}).items()))
    try:
        sys.path.insert(0, SRC)
        from gdn.benchmark import report

        table = report.format_table(rows, cols=("op", "model", "shape", "state", "gdn ms", "fla ms", "fi ms", "x fla",
                                                "x fi", "lim%", "bound", "gdn err", "fla err", "fi err", "note"))
        lines = [head] + table.splitlines() + [""] + report.summary_lines(rows)
    except Exception as e:   # the summary must not depend on gdn importing
        timed = sum(1 for r in rows if isinstance(r.get("gdn_ms"), (int, float)))
        lines = [head, f"{timed}/{len(rows)} rows timed (table unavailable: {type(e).__name__}: {e})"]
    return lines


def summarize(s: Session, done_sweep):
    path, doc = _main_json(s.out)
    parts = []
    blines = bench_lines(doc)
    slines = sweep_table(s.out, doc, done_sweep or []) + profile_table(s.out, done_sweep or [])
    stage_lines = ["", f"session summary ({time.time() - s.t0:.0f}s of {s.budget_s:.0f}s budget; files under "
                       f"{s.out})", f"  {'stage':<7} {'status':<18} {'secs':>5}  detail"]
    for name, status, sec, detail in s.stages:
        stage_lines.append(f"  {name:<7} {status:<18} {sec:5.0f}  {detail}")
    if path:
        stage_lines.append(f"  bench JSON: {path}")
    fixed = "\n".join(slines + stage_lines)
    room = SUMMARY_CHARS - len(fixed) - 200
    text_b = "\n".join(blines)
    if len(text_b) > room:   # keep the head and the per-op summary; cut rows from the middle of the table
        keep_tail = [l for l in blines[-12:]]
        acc, out_l = 0, []
        for l in blines[:-12]:
            if acc + len(l) + 1 > room - sum(len(x) + 1 for x in keep_tail) - 80:
                break
            out_l.append(l)
            acc += len(l) + 1
        text_b = "\n".join(out_l + [f"... table cut for length: full table in {s.out}/bench.log"] + keep_tail)
    parts = [text_b, fixed]
    text = "\n".join(parts)
    with open(os.path.join(s.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(s.out, "summary.json"), "w") as f:
        json.dump({"stages": [dict(zip(("stage", "status", "seconds", "detail"), st)) for st in s.stages],
                   "bench_json": path, "elapsed_s": time.time() - s.t0}, f, indent=1)
    print("\n" + text, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole session")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "gdn_gpu_session"),
                   help="output folder (default: $OUT, else a folder under the system's temp dir)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--quick", action="store_true", help="gdn bench --quick")
    p.add_argument("--bench-args", default="", help="extra arguments of gdn bench, written with '=': --bench-args=\"--ops decode,chunk_fwd\"")
    p.add_argument("--check-args", default="", help="extra arguments of gdn check, written with '=': --check-args=\"--ops chunk\"")
    p.add_argument("--check-s", type=float, default=150.0, help="time cap of the check stage")
    p.add_argument("--tests-s", type=float, default=90.0, help="time cap of the GPU tests stage")
    p.add_argument("--sweep", default=None, help="sweep config (JSON file or inline JSON); else $GDN_SWEEP, "
                                                 "else bench/sweeps.json")
    p.add_argument("--sweep-s", type=float, default=120.0, help="time kept for the sweeps when one is configured")
    p.add_argument("--triton-cache", default=None, help="a .tgz Triton cache to start from (when it exists); the "
                                                        "stages' cache is written to $OUT/triton-cache.tgz")
    args = p.parse_args(argv)
    args.stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    bad = [x for x in args.stages if x not in STAGES]
    if bad:
        p.error(f"--stages: unknown {bad}; expected a subset of {STAGES}")
    s = Session(os.path.abspath(args.out), args.budget_s)
    cache_dir = None
    if args.triton_cache:
        cache_dir = s.env["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "gdn-triton-cache")
        s.record("triton cache", "ok", 0, f"{restore_triton_cache(args.triton_cache, cache_dir)} files restored")
    sweep = load_sweep(args)
    done_sweep = []
    for name in STAGES:
        if name not in args.stages:
            continue
        if s.remaining() < 5:
            s.record(name, "skipped (budget)", 0)
            continue
        try:
            if name == "env":
                stage_env(s, args)
            elif name == "check":
                stage_check(s, args)
            elif name == "tests":
                stage_tests(s, args)
            elif name == "bench":
                stage_bench(s, args, sweep)
            elif name == "sweep":
                done_sweep = stage_sweep(s, args, sweep)
        except Exception as e:   # a stage's own failure never ends the session
            s.record(name, "error", 0, f"{type(e).__name__}: {e}")
        if cache_dir:
            save_triton_cache(cache_dir, os.path.join(s.out, "triton-cache.tgz"))
    summarize(s, done_sweep)
    bad_stage = [st for st in s.stages if not (st[1] == "ok" or st[1].startswith("skipped")
                                               or re.fullmatch(r"(\d+)/\1 ok", st[1]))]
    return 1 if bad_stage else 0


if __name__ == "__main__":
    sys.exit(main())
