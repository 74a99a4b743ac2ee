"""Every kernel configuration the ops launch compiles for sm_90 with the installed Triton (no GPU needed).

Runs ``python -m gdn.aot`` in a subprocess without ``TRITON_INTERPRET`` (compiling needs Triton's real JIT), so a
compile error on a Triton release nobody has a GPU for fails CI. Minutes on a cold cache (every chunk kernel is
compiled); Triton's cache (``TRITON_CACHE_DIR``) keeps the results between runs."""
import os
import subprocess
import sys



def test_every_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src)] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-m", "gdn.aot"], env=env, capture_output=True, text=True, timeout=1800)
    summary = [ln for ln in r.stdout.splitlines() if ln.startswith("gdn.aot:")]
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    # both scenario sets ran and compiled something (a recorder that saw no launch would pass vacuously)
    done = [ln for ln in summary if "distinct compiled kernels" in ln]
    assert len(done) == 2 and all(int(ln.split()[1]) > 20 for ln in done), summary
    # the Gluon Hopper kernels (state pass, fused passes, backward reverse pass, parts, prepare): every configuration
    # the launchers can pick compiles (or Gluon is absent)
    from gdn.aot import DH_CONFIGS, FUSED_CONFIGS, FUSED_T_CONFIGS, HOPPER_CONFIGS, PARTS_CONFIGS, PREPARE_CONFIGS

    n = (len(HOPPER_CONFIGS) + len(FUSED_CONFIGS) + len(FUSED_T_CONFIGS) + len(DH_CONFIGS) + len(PARTS_CONFIGS)
         + len(PREPARE_CONFIGS))
    hopper = [ln for ln in summary if ln.startswith("gdn.aot: hopper")]
    assert len(hopper) == 1 and ("Gluon not available" in hopper[0] or f" {n} of {n} " in hopper[0]), summary
